"""Pooling kernels: native functions that give ATen's float32 CPU pooling results bit for bit,
built once per process into the JIT and called by programs.

    braze_max_pool2d_planes(x, y, h, w, oh, ow, kh, kw, sh, sw, ph, pw, dh, dw, lo, hi)
        planes lo..hi of a contiguous [planes, h, w] x into a contiguous [planes, oh, ow] y: ATen's
        max_pool2d_with_indices loop for contiguous inputs (MaxPoolKernel.cpp): each window
        clipped to the image, walked row by row from -inf, a value taken when it is greater than
        the maximum so far or NaN (so NaN propagates, and of equal values the first stays)

    braze_max_pool2d_pixels(x, y, c, h, w, oh, ow, kh, kw, sh, sw, ph, pw, dh, dw, lo, hi)
        output rows lo..hi (image * oh + row) of a channels-last [N, OH, OW, C] y from a
        channels-last [N, H, W, C] x: the same windows and rule, 16 channels a vector (fast
        mode's; ATen's channels-last loop has the same order)

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
from .codegen import F32, I64, LANES16, PTR, VOID, counted_loop, lanes_below, masked_load, masked_store

MAX_POOL = "braze_max_pool2d_planes"
ARGS = 14  # h, w, oh, ow, kh, kw, sh, sw, ph, pw, dh, dw, lo, hi
MAX_POOL_PIXELS = "braze_max_pool2d_pixels"  # c, then ARGS


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
                    b.store(_greater_or_nan(b, v, b.load(best, typ=F32)), best)
                b.store(b.load(best, typ=F32), b.gep(dst, [b.add(b.mul(i, ow), j)], source_etype=F32))
    b.ret_void()


def _greater_or_nan(b: ll.IRBuilder, v: ll.Value, best: ll.Value) -> ll.Value:
    """ATen's update of a window's maximum: v where it is greater or NaN."""
    return b.select(b.or_(b.fcmp_ordered(">", v, best), b.fcmp_unordered("uno", v, v)), v, best)


def _max_pool_pixels(module: ll.Module) -> None:
    fn = ll.Function(module, ll.FunctionType(VOID, [PTR, PTR] + [I64] * (ARGS + 1)), MAX_POOL_PIXELS)
    x, y, c, h, w, oh, ow, kh, kw, sh, sw, ph, pw, dh, dw, lo, hi = fn.args
    b = ll.IRBuilder(fn.append_basic_block("entry"))
    with b.goto_entry_block():
        best = b.alloca(LANES16)
    vectors = b.sdiv(b.add(c, I64(15)), I64(16))
    with counted_loop(b, lo, hi) as r:
        image, i = b.sdiv(r, oh), b.srem(r, oh)
        src = b.gep(x, [b.mul(image, b.mul(b.mul(h, w), c))], source_etype=F32)
        row0, row1 = _window(b, i, h, kh, sh, ph, dh)
        with counted_loop(b, I64(0), ow) as j:
            col0, col1 = _window(b, j, w, kw, sw, pw, dw)
            dst = b.gep(y, [b.mul(b.add(b.mul(r, ow), j), c)], source_etype=F32)
            with counted_loop(b, I64(0), vectors) as v:
                first = b.mul(v, I64(16))
                mask = lanes_below(b, b.sub(c, first))
                b.store(ll.Constant(LANES16, [float("-inf")] * 16), best)
                with counted_loop(b, row0, row1, dh) as rr, counted_loop(b, col0, col1, dw) as cc:
                    at = b.add(b.mul(b.add(b.mul(rr, w), cc), c), first)
                    value = masked_load(b, b.gep(src, [at], source_etype=F32), mask)
                    b.store(_greater_or_nan(b, value, b.load(best, typ=LANES16)), best)
                masked_store(b, b.load(best, typ=LANES16), b.gep(dst, [first], source_etype=F32), mask)
    b.ret_void()


def library(kernel: str) -> int:
    """The address of pooling kernel `kernel` (jit.kernel: built alone when first needed)."""
    return jit.kernel(kernel, {MAX_POOL: _max_pool, MAX_POOL_PIXELS: _max_pool_pixels}[kernel])


def max_pool2d_planes(x: torch.Tensor, kernel: tuple, stride: tuple, padding: tuple, dilation: tuple, out: tuple):
    """The native max pool of a contiguous float32 [..., h, w] x into [..., *out] (for the probe)."""
    fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, *[ctypes.c_int64] * ARGS)(library(MAX_POOL))
    h, w = x.shape[-2:]
    y = torch.empty(*x.shape[:-2], *out)
    planes = x.numel() // max(h * w, 1)
    fn(x.data_ptr(), y.data_ptr(), h, w, *out, *kernel, *stride, *padding, *dilation, 0, planes)
    return y


def max_pool2d_pixels(x: torch.Tensor, kernel: tuple, stride: tuple, padding: tuple, dilation: tuple, out: tuple):
    """The native max pool of a channels-last float32 [N, C, H, W] x into [N, C, *out] (tests)."""
    fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, *[ctypes.c_int64] * (ARGS + 1))
    n, c, h, w = x.shape
    y = torch.empty(n, c, *out).contiguous(memory_format=torch.channels_last)
    pooled = (h, w, *out, *kernel, *stride, *padding, *dilation, 0, n * out[0])
    fn(library(MAX_POOL_PIXELS))(x.data_ptr(), y.data_ptr(), c, *pooled)
    return y


def max_pool_same() -> bool:
    """Whether the native max pools (of planes, of channels-last pixels) give ATen's bits here:
    windows with padding, dilation, strides and ceil mode, NaN, infinities, signed zeros and
    ties, 2 and 17 channels. Once per process (work is split between threads by whole planes or
    rows in both: the split cannot change bits)."""
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
        for xs in (x, x.reshape(1, 6, 9, 11).repeat(1, 3, 1, 1)[:, :17]):
            pixels = xs.contiguous(memory_format=torch.channels_last)
            want = torch.nn.functional.max_pool2d(pixels, k, s, p, d, ceil_mode=ceil)
            if not jit.same_bits(max_pool2d_pixels(pixels, *pairs, tuple(want.shape[-2:])), want):
                return False
    return True
