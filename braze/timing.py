"""Honest timing on a noisy machine: interleaved rounds, per-round ratios, medians.

Used by `braze demo` and `braze bench`; not part of compiling anything.
"""

from __future__ import annotations

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


@dataclass
class Split:
    """One round of calls of a program, divided: the whole call, and the part in BLAS calls."""

    call_us: float
    blas_us: float

    @property
    def own_us(self) -> float:
        """Everything but the BLAS calls: guard, allocation, loops, the call from Python."""
        return self.call_us - self.blas_us


def split(fn: Callable[..., Any], args: tuple, rounds: int = 15, seconds: float = 0.05) -> Split | None:
    """braze's own time per call of `fn` beside its BLAS calls', measured in the same calls.

    `fn` is compiled again with config.blas_clock: its program adds the cycles of the CPU's
    time-stamp counter spent inside each BLAS call (and each of braze's own GEMM kernels, which
    do the work of one) to a counter. A round times `n` calls by the
    wall clock and by that counter; the BLAS share of the round's cycles is the BLAS share of its
    time. The fastest round's split is returned (other work on the machine only adds time). The
    counting itself (two reads of the counter per BLAS call) adds a few nanoseconds to braze's
    side. None when braze runs `fn` eagerly.
    """
    from . import api, config

    with config.patch(blas_clock=True):
        clocked = api.compile(fn)
        clocked(*args)
    progs = clocked.programs()
    if not progs or progs[0].blas_clock is None:
        return None
    counter, now = progs[0].blas_clock
    n = max(1, int(seconds / max(_per_call_us(clocked, args, seconds) * 1e-6, 1e-9)))
    best: Split | None = None
    for _ in range(rounds):
        counter.value = 0
        c0, t0 = now(), time.perf_counter()
        for _ in range(n):
            clocked(*args)
        t1, c1 = time.perf_counter(), now()
        us = (t1 - t0) / n * 1e6
        if best is None or us < best.call_us:
            best = Split(us, us * counter.value / max(c1 - c0, 1))
    return best
