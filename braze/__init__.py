"""braze: a compiler for PyTorch models on the CPU that answers in milliseconds.

import braze
fast = braze.compile(model)   # returns at once; the first call compiles
out = fast(x)                 # bit-identical to model(x)
"""

from __future__ import annotations

import gc
import time
from typing import Any

from . import config

if config.gc_freeze:  # before braze's own imports: a full collection of torch's objects costs ~100 ms
    gc.freeze()

from .api import BrazeWarning, CompiledFunction, CompiledModule, compile  # noqa: E402
from .debug import Report  # noqa: E402

__all__ = ["compile", "explain", "config", "CompiledFunction", "CompiledModule", "BrazeWarning", "Report"]
__version__ = "0.1.0"


def explain(fn: Any, *example_inputs: Any) -> Report:
    """Compile `fn` for `example_inputs` and describe every stage (nothing is run).

    The report holds the captured graph, the IR before and after each pass, the fusion groups,
    which ops run natively and which through ATen (and why), the LLVM IR, optimised IR,
    assembly, and milliseconds per stage; for a compiled wrapper, also every program it has
    compiled so far and why.
    """
    import torch

    from . import capture, debug
    from .api import build_program

    target = fn.fn if isinstance(fn, CompiledFunction) else fn
    t0 = time.perf_counter()
    if isinstance(target, torch.fx.GraphModule):
        captured = capture.from_graph_module(target)
    else:
        captured = capture.trace(target, len(example_inputs))
    capture_ms = (time.perf_counter() - t0) * 1e3
    with config.patch(debug_dir=""), _want_text():
        prog = build_program(captured, tuple(example_inputs))
    prog.timings.insert(0, ("capture", capture_ms))
    secs = debug.sections(prog, captured.graph)
    if isinstance(fn, CompiledFunction):
        secs["compilations of this wrapper"] = debug.compilations(fn)
    text = "\n\n".join(f"=== {name} ===\n{body}" for name, body in secs.items())
    report = Report(text)
    report.program = prog
    report.sections = secs
    return report


class _want_text:
    """Ask codegen to keep the LLVM IR and assembly text (costs a few ms, so only here)."""

    def __enter__(self) -> None:
        from . import runtime

        runtime.Program._want_text = True

    def __exit__(self, *exc: object) -> None:
        from . import runtime

        runtime.Program._want_text = False
