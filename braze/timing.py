"""Honest timing on a noisy machine: interleaved rounds, per-round ratios, medians.

Used by `braze demo` and `braze bench`; not part of compiling anything.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Timing:
    rounds: list[float] = field(default_factory=list)  # microseconds per call, one per round

    @property
    def us(self) -> float:
        """The steady-state time: the fastest round (the least disturbed by other work)."""
        return min(self.rounds)


class Comparison(dict):
    def speedup(self, name: str, base: str) -> float:
        """Median over rounds of base/name, each ratio from one round (so drift cancels)."""
        return statistics.median(b / a for a, b in zip(self[name].rounds, self[base].rounds))


def _per_call_us(fn: Callable[..., Any], args: tuple, seconds: float) -> float:
    n = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(n):
            fn(*args)
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            return elapsed / n * 1e6
        n = max(n * 2, int(n * seconds / max(elapsed, 1e-9) * 1.1))


def compare(fns: dict[str, Callable[..., Any]], args: tuple, rounds: int = 15, seconds: float = 0.05) -> Comparison:
    """Time each function on `args`, interleaved: every round runs each once, in rotating order."""
    out = Comparison({name: Timing() for name in fns})
    names = list(fns)
    for fn in fns.values():  # warm-up (and compile)
        fn(*args)
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            out[name].rounds.append(_per_call_us(fns[name], args, seconds))
    return out


def blas_only(prog: Any) -> dict[str, Callable[..., Any]]:
    """Two callables to time beside the program, ignoring their arguments: `blas` makes the
    program's sgemm_ calls alone, with the same arguments, through ctypes; `ctypes` makes an empty
    native call the same way. `braze - (blas - ctypes)` (see overhead_us) is everything braze
    adds to the BLAS calls: the guard, allocation, pointer set-up, loops, the call from Python.

    Built from the program's own GEMM nodes with bias and epilogue removed, run on buffers of
    the program's sizes. Empty when the program makes no GEMM.
    """
    import ctypes

    import torch

    from .codegen import ModuleBuilder, Segment
    from .ir import Op
    from .jit import compile_module
    from .runtime import _VOID_FN

    gemms = [n for s in prog.segments for n in s.kernels if n.op is Op.GEMM]
    if not gemms:
        return {}
    bare = [dataclasses.replace(n, inputs=n.inputs[:2] + (None,), attrs={**n.attrs, "body": ()}) for n in gemms]
    mb = ModuleBuilder("blas_only", prog._access, 1 << 62)
    names = [mb.segment(Segment("blas", bare)).name, mb.segment(Segment("empty", [])).name]
    addr = compile_module(str(mb.module), names, 2, False).addresses
    blas, empty = _VOID_FN(addr[names[0]]), _VOID_FN(addr[names[1]])
    nbytes: dict[int, int] = {}
    for n in bare:
        for v in (n.name, *n.value_inputs()):
            acc = prog._access(v)
            nbytes[acc.slot] = max(nbytes.get(acc.slot, 0), (acc.meta.span + 1) * 4)
    buffers = {slot: torch.randn(nb // 4) for slot, nb in nbytes.items()}
    table = (ctypes.c_void_p * (max(nbytes) + 1))()
    for slot, t in buffers.items():
        table[slot] = t.data_ptr()
    at = ctypes.addressof(table)

    def call(fn: Any) -> Callable[..., Any]:
        return lambda *_, keep=(table, buffers): fn(at)  # they live as long as the callable

    return {"blas": call(blas), "ctypes": call(empty)}


def overhead_us(r: Comparison, name: str) -> float:
    """What `name` adds to its BLAS calls (see blas_only), from the fastest round of each: other
    work on the machine only ever adds time, and the rounds were interleaved."""
    return r[name].us - (r["blas"].us - r["ctypes"].us)
