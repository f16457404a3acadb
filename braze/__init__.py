"""braze: a compiler for PyTorch models on the CPU that answers in milliseconds.

import braze
fast = braze.compile(model)   # returns at once; the first call compiles
out = fast(x)                 # bit-identical to model(x)
"""

from __future__ import annotations

import gc
import time
from typing import Any

import torch  # imported here, so that the freeze below holds its objects whatever came first

from . import config

if config.gc_freeze:  # before braze's own imports: a full collection of torch's objects costs ~100 ms
    gc.freeze()

from .accuracy import Accuracy, check_accuracy  # noqa: E402
from .api import MODES, BrazeWarning, CompiledFunction, CompiledModule, compile  # noqa: E402
from .debug import Report  # noqa: E402

__all__ = [
    "compile",
    "explain",
    "check_accuracy",
    "Accuracy",
    "config",
    "CompiledFunction",
    "CompiledModule",
    "BrazeWarning",
    "Report",
]
__version__ = "0.1.0"


def explain(fn: Any, *example_inputs: Any, mode: str | None = None, **example_kwargs: Any) -> Report:
    """Compile `fn` for `example_inputs` (in `mode`, as braze.compile) and describe every stage.

    The report holds the captured graph, the IR before and after each pass, the fusion groups,
    which ops run natively and which through ATen (and why), the LLVM IR, optimised IR,
    assembly, and milliseconds per stage; for a compiled wrapper, also every program it has
    compiled so far and why. A model that torch.fx cannot trace (or a call with keywords) is
    compiled as braze.compile would: captured by TorchDynamo, each of its graphs' programs
    generic in the sizes TorchDynamo left symbolic, as they run; a fresh wrapper calls it once
    on the inputs, without gradients, and each graph gets its sections, headed "graph i:". A
    wrapper is explained in the mode it was compiled with (`mode`, if given, must be that
    one). `mode` is braze's: a model's own keyword argument of that name cannot be given here.
    """
    import dataclasses

    from . import capture, debug
    from .api import exact_instead

    target = fn.fn if isinstance(fn, CompiledFunction) else fn
    if isinstance(fn, CompiledFunction) and mode not in (None, fn.mode):
        raise ValueError(f"braze.explain: this wrapper was compiled in {fn.mode} mode, not {mode}")
    mode = fn.mode if isinstance(fn, CompiledFunction) else mode or "exact"
    if mode not in MODES:
        raise ValueError(f"braze: unknown mode {mode!r} (one of {', '.join(MODES)})")
    t0 = time.perf_counter()
    wrapper = None
    try:
        if example_kwargs:
            raise capture.CaptureError("keyword arguments")
        if isinstance(target, torch.fx.GraphModule):
            captured = capture.from_graph_module(target)
        else:
            captured = capture.trace(target, len(example_inputs))
    except capture.CaptureError:
        captured = None
    secs: dict[str, str] = {}
    within = "faster kernels within the accuracy contract" if mode == "fast" else "eager's bits"
    secs["mode"] = f"  {mode} ({within})"
    if captured is None:
        dynamic = fn.dynamic if isinstance(fn, CompiledFunction) else None
        wrapper, programs = _dynamo_programs(target, mode, dynamic, example_inputs, example_kwargs)
        capture_ms = (time.perf_counter() - t0) * 1e3 - sum(getattr(p, "total_ms", 0.0) for p in programs)
    else:
        capture_ms = (time.perf_counter() - t0) * 1e3
        captured = dataclasses.replace(captured, mode=mode)
        try:
            programs = [_program(captured, tuple(example_inputs))]
        except Exception as e:
            prog = exact_instead(captured, lambda c: _program(c, tuple(example_inputs)))  # as the wrapper does
            if prog is None:
                raise
            programs = [prog]
            failed = f"fast mode's lowering failed ({type(e).__name__}: {e})"
            secs["mode"] += f"\n  {failed}; exact mode's program, which the wrapper runs"
    for i, prog in enumerate(programs):
        rest = [t for t in prog.timings if t[0] != "capture"]  # (a wrapper's program has its own)
        prog.timings[:] = [("capture", max(capture_ms, 0.0) if i == 0 else 0.0), *rest]
        head = f"graph {i}: " if len(programs) > 1 else ""
        secs.update({head + name: body for name, body in debug.sections(prog, prog.captured_graph).items()})
    if wrapper is not None:
        secs["compilations of this call"] = debug.compilations(wrapper)
    if isinstance(fn, CompiledFunction):
        secs["compilations of this wrapper"] = debug.compilations(fn)
    text = "\n\n".join(f"=== {name} ===\n{body}" for name, body in secs.items())
    report = Report(text)
    report.program = programs[0] if programs else None
    report.programs = programs
    report.sections = secs
    return report


def _program(captured: Any, args: tuple) -> Any:
    from .api import build_program

    with config.patch(debug_dir=""), _want_text():
        return build_program(captured, args)


def _dynamo_programs(
    target: Any, mode: str, dynamic: bool | None, args: tuple, kwargs: dict
) -> tuple[CompiledFunction, list[Any]]:
    """What braze's wrapper compiles for one call of `target` captured by TorchDynamo: a fresh
    wrapper (`mode`, `dynamic`: as braze.compile's) called once, without gradients, and the
    program of each of TorchDynamo's graphs, generic where the wrapper's are (in the sizes
    TorchDynamo made symbolic), as they run."""
    wrapper = compile(target, mode=mode, dynamic=dynamic)
    with torch.no_grad(), config.patch(debug_dir=""), _want_text():
        wrapper(*args, **kwargs)
    return wrapper, [p for sub in wrapper._subgraphs for p in sub.programs()]


class _want_text:
    """Ask codegen to keep the LLVM IR and assembly text (costs a few ms, so only here)."""

    def __enter__(self) -> None:
        from . import runtime

        runtime.Program._want_text = True

    def __exit__(self, *exc: object) -> None:
        from . import runtime

        runtime.Program._want_text = False
