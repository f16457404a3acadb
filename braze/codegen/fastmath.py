"""Fast mode's tanh (mode="fast"): within 1.1 ulp of the true value (tests/test_fastmath.py
measures it against float64 on 2.6 million values and the special ones), where exact mode calls
MKL's vmsTanh as ATen does. Each lane's result depends on no other lane, so loops compute it at
any width and fuse it with its neighbours: GPT-2's tanh GELU becomes one loop (a GEMM's
epilogue), where vmsTanh was a pass of its own between two loops (gpt2-tiny 1.04x as fast).
Its permutes are AVX-512's: lowering takes it where ATen's kernels are the AVX512 build's.

For |x| < 0.625 Cephes' tanhf polynomial, x + x^3 Q(x^2) with Q of degree 4; from 0.625 to 9.02
a polynomial of degree 5 in |x| - c per quarter binade of |x| (17 of them, picked as oneDNN's
GELU picks its: from |x|'s bits, each coefficient one AVX-512 permute of a 32-entry table),
fitted here in float64 on Chebyshev nodes; above, 1 (tanh rounds to 1 from 9.02 on). x's sign on
the result (tanh(-0) is -0); NaN stays NaN. No exp and no division: 1 - 2 / (e^(2|x|) + 1) on a
polynomial exp ran at 0.55x vmsTanh's speed, this at 0.88x, alone (one thread, 256K values).
"""

from __future__ import annotations

import functools
import math

import llvmlite.ir as ll
import torch

from .loops import F32, I32, _intrinsic, fma, lane_types, per_width, pick

TANH_POLY = (-5.70498872745e-3, 2.06390887954e-2, -5.37397155531e-2, 1.33314422036e-1, -3.33332819422e-1)
TANH_SMALL = 0.625
TANH_ONE = 9.02  # tanh(x) rounds to 1 from here on
TANH_DEGREE = 5
HALF_BITS = 0x3F000000 >> 21  # 0.5's bits, shifted to the quarter binades


def _quarter(i: int) -> tuple[float, float]:
    """The i-th quarter binade of |x| from 0.5: [lo, hi)."""
    binade, quarter = divmod(i, 4)
    lo = 0.5 * 2.0**binade
    return lo * (1 + quarter / 4), lo * (1 + (quarter + 1) / 4)


@functools.cache
def _tanh_tables() -> list[list[float]]:
    """Per quarter binade of |x| from 0.5 (index 0) to 10 (16): its center, then the coefficients
    (degree 0 up) of the polynomial in |x| - center through tanh at TANH_DEGREE + 1 Chebyshev
    nodes (float64), as float32 tables of 32 entries."""
    nodes = [math.cos((2 * j + 1) * math.pi / (2 * TANH_DEGREE + 2)) for j in range(TANH_DEGREE + 1)]
    vander = torch.tensor([[u**k for k in range(TANH_DEGREE + 1)] for u in nodes], dtype=torch.float64)
    columns = [[0.0] * 32 for _ in range(TANH_DEGREE + 2)]
    for i in range(17):
        lo, hi = _quarter(i)
        center, half = (lo + hi) / 2, (hi - lo) / 2
        values = torch.tensor([math.tanh(center + half * u) for u in nodes], dtype=torch.float64)
        coefficients = torch.linalg.solve(vander, values).tolist()  # in u = (|x| - center) / half
        columns[0][i] = center
        for k, c in enumerate(coefficients):
            columns[k + 1][i] = c / half**k
    return columns


def fast_tanh(b: ll.IRBuilder, x: ll.Value) -> ll.Value:
    """tanh(x) (one float or a vector), through per_width."""
    return per_width(b, x, "braze_fast_tanh", _tanh)


def _tanh(b: ll.IRBuilder, x: ll.Value) -> ll.Value:
    shaped, const = lane_types(x)
    f = lambda v: const(F32, v)  # noqa: E731
    ity = shaped(I32)
    a = _intrinsic(b, "fabs", x)
    z = b.fmul(a, a)
    q = f(TANH_POLY[0])
    for c in TANH_POLY[1:]:
        q = fma(b, q, z, f(c))
    small = fma(b, b.fmul(a, z), q, a)
    center, *coefficients = _tanh_tables()
    index = b.sub(b.lshr(b.bitcast(a, ity), const(I32, 21)), const(I32, HALF_BITS))
    index = b.select(b.icmp_signed("<", index, const(I32, 0)), const(I32, 0), index)
    index = b.select(b.icmp_signed(">", index, const(I32, 16)), const(I32, 16), index)
    t = b.fsub(a, pick(b, center, index))
    p = pick(b, coefficients[-1], index)
    for column in reversed(coefficients[:-1]):
        p = fma(b, p, t, pick(b, column, index))
    y = b.select(b.fcmp_ordered("<", a, f(TANH_SMALL)), small, b.select(b.fcmp_ordered("<", a, f(TANH_ONE)), p, f(1.0)))
    y = b.select(b.fcmp_unordered("uno", x, x), b.fadd(x, x), y)
    return _intrinsic(b, "copysign", y, x)
