"""Fast mode's own float32 functions (mode="fast"): not eager's bits, but within the accuracy
contract (accuracy.py), and cheaper than the ATen calls they replace. Built once per process into
the JIT, called by programs by name, elements split between threads as ATen splits them.

    braze_gelu_erf(x, y, n)    gelu(x) = x (1 + erf(x / sqrt 2)) / 2

erf(a / sqrt 2), a = |x|, comes from a table of degree-5 polynomials, one per quarter of a binade
from 2^-4 to 8, one for [0, 2^-4), and the constant 1 from 8 on (erf(8 / sqrt 2) is 1 in float32).
The interval is read off a's bits, each coefficient is picked for all 16 lanes at once from a
32-entry table (one AVX-512 two-register permute), and the polynomial runs in u = a - the
interval's start (a's bits with the low 21 cleared; u = a in the first): in a itself, float32
coefficients lose accuracy by a^5 (11 ulp in [2.5, 3]). The polynomials are fitted here, on first
use, by least squares on Chebyshev nodes in float64, each coefficient rounded to float32 in turn
with the rest fitted again: at most 1.6 ulp of erf (1.2 from 2^-4 on), over 10^5 values per
interval. Then the sign of x, and x (1 + p) / 2 as eager computes it, so NaN and infinities give
eager's NaN. Over 10^6 values of N(0, 9), half eager's error against float64 (tests/test_fast.py
applies the contract).
"""

from __future__ import annotations

import ctypes
import functools
import math

import llvmlite.ir as ll
import torch

from . import jit
from .codegen import (
    F32,
    I32,
    I64,
    LANES16,
    PTR,
    VOID,
    counted_loop,
    declared,
    fma,
    lanes_below,
    masked_load,
    masked_store,
    split_between_threads,
)

FUNCTIONS = ("gelu_erf",)
DEGREE = 5
FIRST = 0x3D800000  # the bits of 2^-4, where the quarter-binade intervals start
INTERVALS = 29  # [0, 2^-4), then 28 quarters of the binades up to 8; entries 29-31: the constant 1
GRAIN = 16384  # elements per thread at least (ATen's gelu splits from here)
V16I = ll.VectorType(I32, 16)


def name(fn: str) -> str:
    return f"braze_{fn}"


def _interval(t: int) -> tuple[float, float]:
    if t == 0:
        return 0.0, 2.0**-4
    bits = torch.tensor([FIRST + ((t - 1) << 21), FIRST + (t << 21)], dtype=torch.int32)
    lo, hi = bits.view(torch.float32).tolist()
    return lo, hi


@functools.cache
def erf_table() -> list[list[float]]:
    """Each coefficient (highest degree first) of each interval's polynomial, 32 entries each."""
    coefficients = []
    nodes = torch.cos(math.pi * (torch.arange(400, dtype=torch.float64) + 0.5) / 400)
    for t in range(INTERVALS):
        lo, hi = _interval(t)
        a = (lo + hi) / 2 + (hi - lo) / 2 * nodes
        y = torch.special.erf(a / math.sqrt(2))
        powers = torch.stack([(a - lo) ** (DEGREE - j) for j in range(DEGREE + 1)], 1) / y[:, None]
        fixed: list[float] = []
        for j in range(DEGREE + 1):  # relative least squares; round one coefficient, refit the rest
            rest = 1 - powers[:, :j] @ torch.tensor(fixed, dtype=torch.float64)
            c = torch.linalg.lstsq(powers[:, j:], rest[:, None]).solution[0, 0]
            fixed.append(c.to(torch.float32).item())
        coefficients.append(fixed)
    coefficients += [[0.0] * DEGREE + [1.0]] * (32 - INTERVALS)
    return [[c[j] for c in coefficients] for j in range(DEGREE + 1)]


def _gelu(b: ll.IRBuilder, x: ll.Value) -> ll.Value:
    """gelu of 16 lanes."""
    coefficients = erf_table()
    permute = declared(b.module, "llvm.x86.avx512.vpermi2var.ps.512", LANES16, [LANES16, V16I, LANES16])
    ivec = lambda v: ll.Constant(V16I, [v] * 16)  # noqa: E731
    bits = b.bitcast(x, V16I)
    abits = b.and_(bits, ivec(0x7FFFFFFF))
    t = b.sub(b.lshr(abits, ivec(21)), ivec((FIRST >> 21) - 1))
    t = b.select(b.icmp_signed("<", t, ivec(0)), ivec(0), t)
    t = b.select(b.icmp_signed(">", t, ivec(31)), ivec(31), t)
    pick = (
        lambda table: b.call(  # noqa: E731
            permute, [ll.Constant(LANES16, table[:16]), t, ll.Constant(LANES16, table[16:])]
        )
    )
    a = b.bitcast(abits, LANES16)
    start = b.bitcast(b.and_(abits, ivec(-(1 << 21))), LANES16)
    u = b.select(b.icmp_signed("==", t, ivec(0)), a, b.fsub(a, start))
    p = pick(coefficients[0])
    for table in coefficients[1:]:
        p = fma(b, p, u, pick(table))
    signed = b.bitcast(b.xor(b.bitcast(p, V16I), b.and_(bits, ivec(-(2**31)))), LANES16)
    one, half = (ll.Constant(LANES16, [v] * 16) for v in (1.0, 0.5))
    return b.fmul(b.fmul(x, b.fadd(one, signed)), half)


def _chunk(module: ll.Module, fn: str) -> ll.Function:
    """(x, y, n): 16 elements a step, the last few under a mask."""
    f = ll.Function(module, ll.FunctionType(VOID, [PTR, PTR, I64]), f"{name(fn)}_chunk")
    f.linkage = "internal"
    x, y, n = f.args
    b = ll.IRBuilder(f.append_basic_block("entry"))
    at = lambda p, i: b.gep(p, [i], source_etype=F32)  # noqa: E731
    body_end = b.and_(n, I64(-16))
    with counted_loop(b, I64(0), body_end, 16) as i:
        b.store(_gelu(b, b.load(at(x, i), typ=LANES16, align=4)), at(y, i), align=4)
    with b.if_then(b.icmp_signed("<", body_end, n)):
        mask = lanes_below(b, b.sub(n, body_end))
        masked_store(b, _gelu(b, masked_load(b, at(x, body_end), mask)), at(y, body_end), mask)
    b.ret_void()
    return f


def library(kernel: str) -> int:
    """The address of kernel `kernel` (name(fn); jit.kernel: built alone when first needed)."""
    fn = kernel.removeprefix(name(""))
    grain = lambda b, n, threads: I64(GRAIN)  # noqa: E731
    return jit.kernel(kernel, lambda module: split_between_threads(module, kernel, _chunk(module, fn), grain))


def run(fn: str, x: torch.Tensor) -> torch.Tensor:
    """The native kernel on a contiguous float32 tensor (for tests)."""
    kernel = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)(library(name(fn)))
    y = torch.empty_like(x)
    kernel(x.data_ptr(), y.data_ptr(), x.numel())
    return y
