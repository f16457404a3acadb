"""Pooling kernels: native functions that give ATen's float32 CPU pooling results bit for bit,
built once per process into the JIT and called by programs.

    braze_max_pool2d_planes(x, y, h, w, oh, ow, kh, kw, sh, sw, ph, pw, dh, dw, lo, hi)
        planes lo..hi of a contiguous [planes, h, w] x into a contiguous [planes, oh, ow] y: ATen's
        max_pool2d_with_indices loop for contiguous inputs (MaxPoolKernel.cpp): each window
        clipped to the image, walked row by row from -inf, a value taken when it is greater than
        the maximum so far or NaN (so NaN propagates, and of equal values the first stays)

A maximum computes nothing, but its NaN rule, which of two equal zeros it keeps and the clipping
of windows are ATen's choices: a probe (`max_pool_same`) compares the kernel with ATen before any
program uses it.
"""

from __future__ import annotations

import ctypes
import functools

import llvmlite.ir as ll
import torch

from . import jit
from .codegen import F32, I64, PTR, VOID, counted_loop

MAX_POOL = "braze_max_pool2d_planes"
ARGS = 14  # h, w, oh, ow, kh, kw, sh, sw, ph, pw, dh, dw, lo, hi


def _first_inside(b: ll.IRBuilder, start: ll.Value, step: ll.Value) -> ll.Value:
    """ATen's `while (start < 0) start += dilation`."""
    behind = b.sub(I64(0), start)
    steps = b.sdiv(b.add(behind, b.sub(step, I64(1))), step)
    return b.select(b.icmp_signed("<", start, I64(0)), b.add(start, b.mul(steps, step)), start)


def _window(b: ll.IRBuilder, o: ll.Value, size: ll.Value, k: ll.Value, s: ll.Value, p: ll.Value, d: ll.Value):
    """[first, end) of output position o's window along one axis, clipped to [0, size)."""
    start = b.sub(b.mul(o, s), p)
    end = b.add(start, b.add(b.mul(b.sub(k, I64(1)), d), I64(1)))
    end = b.select(b.icmp_signed("<", end, size), end, size)
    return _first_inside(b, start, d), end


def _max_pool(module: ll.Module) -> None:
    fn = ll.Function(module, ll.FunctionType(VOID, [PTR, PTR] + [I64] * ARGS), MAX_POOL)
    x, y, h, w, oh, ow, kh, kw, sh, sw, ph, pw, dh, dw, lo, hi = fn.args
    b = ll.IRBuilder(fn.append_basic_block("entry"))
    with b.goto_entry_block():
        best = b.alloca(F32)
    with counted_loop(b, lo, hi) as plane:
        src = b.gep(x, [b.mul(plane, b.mul(h, w))], source_etype=F32)
        dst = b.gep(y, [b.mul(plane, b.mul(oh, ow))], source_etype=F32)
        with counted_loop(b, I64(0), oh) as i:
            row0, row1 = _window(b, i, h, kh, sh, ph, dh)
            with counted_loop(b, I64(0), ow) as j:
                col0, col1 = _window(b, j, w, kw, sw, pw, dw)
                b.store(F32(float("-inf")), best)
                with counted_loop(b, row0, row1, dh) as r, counted_loop(b, col0, col1, dw) as c:
                    v = b.load(b.gep(src, [b.add(b.mul(r, w), c)], source_etype=F32), typ=F32)
                    m = b.load(best, typ=F32)
                    take = b.or_(b.fcmp_ordered(">", v, m), b.fcmp_unordered("uno", v, v))
                    b.store(b.select(take, v, m), best)
                b.store(b.load(best, typ=F32), b.gep(dst, [b.add(b.mul(i, ow), j)], source_etype=F32))
    b.ret_void()


def library(kernel: str) -> int:
    """The address of pooling kernel `kernel` (jit.kernel: built alone when first needed)."""
    return jit.kernel(kernel, {MAX_POOL: _max_pool}[kernel])


def max_pool2d_planes(x: torch.Tensor, kernel: tuple, stride: tuple, padding: tuple, dilation: tuple, out: tuple):
    """The native max pool of a contiguous float32 [..., h, w] x into [..., *out] (for the probe)."""
    fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, *[ctypes.c_int64] * ARGS)(library(MAX_POOL))
    h, w = x.shape[-2:]
    y = torch.empty(*x.shape[:-2], *out)
    planes = x.numel() // max(h * w, 1)
    fn(x.data_ptr(), y.data_ptr(), h, w, *out, *kernel, *stride, *padding, *dilation, 0, planes)
    return y


def max_pool_same() -> bool:
    """Whether the native max pool gives ATen's bits here: windows with padding, dilation, strides
    and ceil mode, NaN, infinities, signed zeros and ties. Once per process (planes are split
    between threads in both: the split cannot change bits)."""
    return _max_pool_same()


@functools.cache
def _max_pool_same() -> bool:
    gen = torch.Generator().manual_seed(0)
    inf, nan = float("inf"), float("nan")
    x = torch.randn(3, 2, 9, 11, generator=gen)
    x[0, 0, 1, :6] = torch.tensor([nan, 1.0, -inf, inf, -0.0, 0.0])
    x[0, 1, :2, :2] = torch.tensor([[-0.0, 0.0], [0.0, -0.0]])
    x[1, 0] = -inf
    x[2, 1, ::2] = torch.round(x[2, 1, ::2])
    windows = ((2, 2, 0, 1, False), (3, 2, 1, 1, True), (3, 1, 1, 2, False), ((2, 3), (1, 2), (1, 0), 1, True))
    for k, s, p, d, ceil in windows:
        want = torch.nn.functional.max_pool2d(x, k, s, p, d, ceil_mode=ceil)
        pairs = [torch.nn.modules.utils._pair(v) for v in (k, s, p, d)]
        if not jit.same_bits(max_pool2d_planes(x, *pairs, tuple(want.shape[-2:])), want):
            return False
    return True
