"""PyTorch's OpInfo database through braze (the practice of Inductor's test_torchinductor_opinfo).

Every float32 CPU op in `op_db`, a few samples each: the sample's tensors become the compiled
function's arguments (its other values are constants of the function), and braze must give
what eager gives (`torch.equal`, NaN equal to NaN, with eager's dtypes, shapes and strides),
raise what eager raises, and change the inputs as eager changes them; or have an expected
outcome, with its reason, in `opinfo_expected.py`. Each case runs through one capture path
(`fx`: braze.compile; `dynamo`: torch.compile(backend="braze")), on 1 or 2 threads, with the
sample's inputs as given, as strided views or in transposed memory (same values).

Through torch.compile, TorchDynamo runs each op on fake tensors while it traces, before braze
sees a graph: where eager raises, it raises its own error (a subclass of eager's, holding
eager's message or its fake kernel's). That outcome is `error_by_dynamo`: TorchDynamo's to
decide, not braze's.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

import braze

from .helpers import copy, differs, num_threads
from .opinfo_expected import expected

PATHS = ("fx", "dynamo")
LAYOUTS = ("given", "strided", "transposed")
# Outcomes that fail the sweep. (A crash ends the process, and the sweep with it.)
BAD = ("wrong", "inputs_differ", "braze_error", "error_differs", "no_error")


@functools.cache
def ops() -> dict[str, Any]:
    """The float32 CPU OpInfos by name ('name.variant'); importing op_db takes ~5 s."""
    from torch.testing._internal.common_methods_invocations import op_db

    table = {}
    for op in op_db:
        if op.supports_dtype(torch.float32, "cpu"):
            table[op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")] = op
    return table


@dataclass
class Case:
    op: str
    sample: int
    path: str
    threads: int
    layout: str


@dataclass
class Outcome:
    case: Case
    kind: str  # exact, error (eager's, raised the same way), expected, or one of BAD
    native: int = 0  # native kernels in the programs the call compiled
    fallback: str = ""  # why braze ran the call eagerly, if it did
    detail: str = ""


@functools.cache
def samples(name: str, n: int) -> list[Any]:
    """The op's first n samples (made once: eager and braze get copies)."""
    torch.manual_seed(0)
    return list(ops()[name].sample_inputs("cpu", torch.float32, requires_grad=False))[:n]


def function(op: Any, sample: Any) -> tuple[Any, list[torch.Tensor]]:
    """A function of the sample's tensors (in a code object of its own: TorchDynamo counts
    recompilations per code object) and those tensors."""
    leaves, spec = pytree.tree_flatten((sample.input, sample.args, sample.kwargs))
    where = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
    params = ", ".join(f"t{i}" for i in range(len(where)))
    src = (
        f"def f({params}):\n"
        "    values = list(leaves)\n"
        f"    for i, t in zip(where, ({params}{',' if len(where) == 1 else ''})):\n"
        "        values[i] = t\n"
        "    inp, args, kwargs = unflatten(values, spec)\n"
        "    return op(inp, *args, **kwargs)\n"
    )
    namespace = {"leaves": leaves, "where": where, "unflatten": pytree.tree_unflatten, "spec": spec, "op": op.op}
    exec(compile(src, f"<opinfo {op.name}>", "exec"), namespace)
    return namespace["f"], [leaves[i] for i in where]


def relaid(t: torch.Tensor, layout: str) -> torch.Tensor:
    """`t`'s values in another memory layout: every other element of a wider buffer (strided)
    or with its last two dimensions' strides swapped (transposed)."""
    if layout == "strided" and t.dim() >= 1 and t.numel() > 1 and t.layout == torch.strided:
        wide = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)[..., ::2]
        return wide.copy_(t)
    if layout == "transposed" and t.dim() >= 2 and t.layout == torch.strided:
        return t.mT.contiguous().mT
    return t


def _wrapped(got: BaseException | None, want: BaseException) -> bool:
    """TorchDynamo's own error where eager raises, raised while it traced (before braze sees a
    graph): a subclass of eager's error type, with eager's message or its fake kernel's."""
    from torch._dynamo.exc import TorchDynamoException

    return isinstance(got, TorchDynamoException) and isinstance(got, type(want))


def _call(fn: Any, args: list[Any]) -> tuple[Any, BaseException | None]:
    torch.manual_seed(1234)  # random ops draw the same numbers in both runs
    try:
        return fn(*args), None
    except Exception as e:  # noqa: BLE001 - eager's error is the reference
        return None, e


def run(case: Case) -> Outcome:
    """Run one case: eager, then braze on copies of the same inputs."""
    op = ops()[case.op]
    fn, tensors = function(op, samples(case.op, SAMPLES)[case.sample])
    tensors = [relaid(t, case.layout) for t in tensors]
    eager_in, braze_in = [copy(t) for t in tensors], [copy(t) for t in tensors]
    with num_threads(case.threads):
        want, want_error = _call(fn, eager_in)
        if case.path == "dynamo":
            torch._dynamo.reset()
            compiled = torch.compile(fn, backend="braze")
        else:
            compiled = braze.compile(fn)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            got, got_error = _call(compiled, braze_in)
    fell = next((str(w.message) for w in said if issubclass(w.category, braze.BrazeWarning)), "")
    native = sum(p.kernel_count for p in _programs(compiled, fn))
    out = Outcome(case, "exact", native, fell)
    if want_error is not None:
        same = got_error is not None and type(got_error) is type(want_error) and str(got_error) == str(want_error)
        out.kind = "error" if same else ("no_error" if got_error is None else "error_differs")
        if case.path == "dynamo" and _wrapped(got_error, want_error):
            out.kind = "error_by_dynamo"
        out.detail = "" if same else f"eager: {want_error!r:.150} braze: {got_error!r:.150}"
    elif got_error is not None:
        out.kind, out.detail = "braze_error", f"{got_error!r:.300}"
    else:
        values = expected(case.op).get("compare", "values") == "values"
        if why := differs(got, want, values):
            out.kind, out.detail = "wrong", why
        elif why := differs(braze_in, eager_in, values):
            out.kind, out.detail = "inputs_differ", why
    known = expected(case.op)
    if out.kind == known.get("outcome") and case.path in known.get("paths", PATHS):
        out.kind = "expected"
    return out


def _programs(compiled: Any, fn: Any) -> list[Any]:
    """The programs braze compiled for this call: the wrapper's, or those of the wrappers
    TorchDynamo made of its graphs (it keeps them in the function's globals)."""
    if isinstance(compiled, braze.CompiledFunction):
        return compiled.programs()
    wrappers = [getattr(v, "__wrapped__", None) for k, v in fn.__globals__.items() if k.startswith("__compiled_fn")]
    return [p for w in wrappers if isinstance(w, braze.CompiledFunction) for p in w.programs()]


def cases(full: bool) -> list[tuple[str, str]]:
    """(op, path) pairs: every op on both paths (full), or every op through FX and, through
    TorchDynamo, the ops braze lowers itself (the fast subset `make test` runs)."""
    names = list(ops())
    if full:
        return [(name, path) for name in names for path in PATHS]
    return [(name, "fx") for name in names] + [(name, "dynamo") for name in names if name in DYNAMO_FAST]


def runs(name: str, path: str, full: bool) -> list[Case]:
    """The cases of one op on one path: each sample as given on 2 threads; the first sample also
    on 1 thread and with strided and transposed inputs (full), or the first sample only (fast)."""
    threads = torch.get_num_threads()
    if not full:
        return [Case(name, 0, path, threads, "given")]
    if not samples(name, SAMPLES):
        return []
    out = [Case(name, i, path, 2, "given") for i in range(len(samples(name, SAMPLES)))]
    return out + [Case(name, 0, path, n, layout) for n in (1, 2) for layout in LAYOUTS if (n, layout) != (2, "given")]


SAMPLES = int(os.environ.get("BRAZE_OPINFO_SAMPLES", 3))

# Ops with native lowerings, and ops whose capture TorchDynamo once changed: the fast subset's
# TorchDynamo cases.
DYNAMO_FAST = frozenset(
    "add sub mul div.no_rounding_mode neg abs nn.functional.relu nn.functional.leaky_relu clamp clamp_min clamp_max "
    "nn.functional.hardtanh nn.functional.relu6 nn.functional.hardsigmoid nn.functional.hardswish "
    "nn.functional.threshold nn.functional.prelu maximum minimum lt le gt ge eq ne where masked_fill pow square "
    "reciprocal cat stack mm addmm bmm matmul nn.functional.linear narrow __getitem__ addcdiv addcmul lerp "
    "index_select gather repeat_interleave nonzero split t transpose permute reshape view expand".split()
)


def summary(outcomes: list[Outcome]) -> str:
    """Cases by outcome; ops with native code (any case that compiled a native kernel), per path."""
    lines = [f"OpInfo sweep: {len({o.case.op for o in outcomes})} ops, {len(outcomes)} cases"]
    for path in PATHS:
        mine = [o for o in outcomes if o.case.path == path]
        if not mine:
            continue
        kinds = Counter(o.kind for o in mine)
        native = {o.case.op for o in mine if o.native}
        fell = sum(bool(o.fallback) for o in mine)
        ops_ = len({o.case.op for o in mine})
        lines.append(f"  {path}: " + ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())))
        lines.append(f"  {path}: native code in {len(native)} of {ops_} ops; braze ran {fell} cases eagerly")
    return "\n".join(lines)


def write_report(outcomes: list[Outcome], path: str) -> None:
    """Every case and its outcome, as JSON lines."""
    with open(path, "w") as f:
        for o in outcomes:
            f.write(
                json.dumps({**dataclasses.asdict(o.case), **{k: v for k, v in vars(o).items() if k != "case"}}) + "\n"
            )
