"""Window kernels: native functions built once per process into the JIT and called by programs.
Max pooling gives ATen's float32 CPU results bit for bit; the depthwise convolution is fast
mode's (its own order of additions, within the accuracy contract).

    braze_max_pool2d_planes(x, y, h, w, oh, ow, kh, kw, sh, sw, ph, pw, dh, dw, lo, hi)
        planes lo..hi of a contiguous [planes, h, w] x into a contiguous [planes, oh, ow] y: ATen's
        max_pool2d_with_indices loop for contiguous inputs (MaxPoolKernel.cpp): each window
        clipped to the image, walked row by row from -inf, a value taken when it is greater than
        the maximum so far or NaN (so NaN propagates, and of equal values the first stays)

    braze_depthwise_conv2d_nhwc(x, w, b, y, h, w, c, oh, ow, kh, kw, sh, sw, ph, pw, dh, dw, lo, hi)
        output rows lo..hi (of n * oh) of a depthwise convolution (one filter per channel) of a
        channels-last x [n, h, w, c] by w [kh, kw, c] plus b [c] (or nothing, where b is null)
        into a channels-last y [n, oh, ow, c]: 16 channels at a time, the window's taps added in
        order with FMAs, taps outside the image skipped (zero padding)

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
from .codegen.loops import fma

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


DEPTHWISE = "braze_depthwise_conv2d_nhwc"
DEPTHWISE_ARGS = 15  # h, w, c, oh, ow, kh, kw, sh, sw, ph, pw, dh, dw, lo, hi
LANES = 16


def _depthwise(module: ll.Module) -> None:
    fn = ll.Function(module, ll.FunctionType(VOID, [PTR] * 4 + [I64] * DEPTHWISE_ARGS), DEPTHWISE)
    x, w, bias, y, h, wd, c, oh, ow, kh, kw, sh, sw, ph, pw, dh, dw, lo, hi = fn.args
    b = ll.IRBuilder(fn.append_basic_block("entry"))
    vec = ll.VectorType(F32, LANES)
    full = b.mul(b.sdiv(c, I64(LANES)), I64(LANES))
    has_bias = b.icmp_unsigned("!=", bias, ll.Constant(PTR, None))
    with b.goto_entry_block():
        sums = {vec: b.alloca(vec), F32: b.alloca(F32)}

    def channels(row: ll.Value, i: ll.Value, j: ll.Value, ch: ll.Value, ty: ll.Type) -> None:
        """y[row, j, ch : ch + width] = bias + the window's taps, for a vector or one channel."""
        zero = ll.Constant(ty, [0.0] * LANES) if ty is vec else F32(0.0)
        start = b.select(has_bias, b.gep(bias, [ch], source_etype=F32), b.gep(y, [ch], source_etype=F32))
        acc = sums[ty]
        b.store(b.select(has_bias, b.load(start, typ=ty, align=4), zero), acc)
        n = b.sdiv(row, oh)
        with counted_loop(b, I64(0), kh) as ki:
            ih = b.add(b.sub(b.mul(i, sh), ph), b.mul(ki, dh))
            with b.if_then(b.and_(b.icmp_signed(">=", ih, I64(0)), b.icmp_signed("<", ih, h))):
                with counted_loop(b, I64(0), kw) as kj:
                    iw = b.add(b.sub(b.mul(j, sw), pw), b.mul(kj, dw))
                    with b.if_then(b.and_(b.icmp_signed(">=", iw, I64(0)), b.icmp_signed("<", iw, wd))):
                        pixel = b.add(b.mul(b.add(b.mul(n, h), ih), wd), iw)
                        xv = b.load(b.gep(x, [b.add(b.mul(pixel, c), ch)], source_etype=F32), typ=ty, align=4)
                        tap = b.add(b.mul(ki, kw), kj)
                        wv = b.load(b.gep(w, [b.add(b.mul(tap, c), ch)], source_etype=F32), typ=ty, align=4)
                        b.store(fma(b, xv, wv, b.load(acc, typ=ty)), acc)
        out = b.add(b.mul(b.add(b.mul(row, ow), j), c), ch)
        b.store(b.load(acc, typ=ty), b.gep(y, [out], source_etype=F32), align=4)

    with counted_loop(b, lo, hi) as row:
        i = b.srem(row, oh)
        with counted_loop(b, I64(0), ow) as j:
            with counted_loop(b, I64(0), full, LANES) as ch:
                channels(row, i, j, ch, vec)
            with counted_loop(b, full, c) as ch:
                channels(row, i, j, ch, F32)
    b.ret_void()


def library(kernel: str) -> int:
    """The address of window kernel `kernel` (jit.kernel: built alone when first needed)."""
    return jit.kernel(kernel, {MAX_POOL: _max_pool, DEPTHWISE: _depthwise}[kernel])


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
