"""Pooling rows: max_pool2d through braze's pooling kernels (braze/pool.py: of contiguous planes,
of channels-last pixels), where a probe shows they give ATen's bits; adaptive_avg_pool2d to
1 x 1 as the mean ATen computes, and in fast mode, of channels-last activations, as a GEMM of a
row of ones by the pixel rows."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.modules.utils import _pair

from .. import pool
from ..ir import Op
from . import gemm
from .conv import pixel_rows
from .core import Lowerer, NotNative, Sym, is_float32, no_out, plain_layer
from .rows import _sum

_MAX_POOL_ARGS = ("input", "kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices")


def _max_pool2d(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
    """ATen's max_pool2d of a contiguous (C, H, W) or (N, C, H, W) input: pool.py's kernel over
    each plane (ceil_mode only changes the output size, which lowering took from eager)."""
    no_out(kwargs)
    if isinstance(fn, torch.nn.MaxPool2d):
        given = {k: getattr(fn, k) for k in _MAX_POOL_ARGS[1:]} | {"input": args[0]}
    else:
        given = dict(zip(_MAX_POOL_ARGS, args)) | kwargs
    x = given.get("input", given.get("self"))
    if given.get("return_indices"):
        raise NotNative("max_pool2d returning indices")
    if not (is_float32(x) and x.meta.dim() in (3, 4)):
        raise NotNative("max_pool2d of a tensor that is not float32 (C, H, W) or (N, C, H, W)")
    pixels = pixel_rows(x.meta, out) and not x.meta.is_contiguous()
    planes = x.meta.is_contiguous() and isinstance(out, torch.Tensor) and out.is_contiguous()
    if not (planes or pixels):
        raise NotNative("max_pool2d of a strided input (ATen's other loop)")
    kernel = _pair(given["kernel_size"])
    stride = _pair(given.get("stride") or kernel)  # None or [] means the kernel size, as in ATen
    padding, dilation = _pair(given.get("padding", 0)), _pair(given.get("dilation", 1))
    if not all(isinstance(v, int) for v in (*kernel, *stride, *padding, *dilation)):
        raise NotNative("max_pool2d with sizes that are not integers")
    if out.numel() == 0:
        raise NotNative("max_pool2d with an empty result")
    if not pool.max_pool_same():
        raise NotNative("a probe found braze's max_pool2d does not give ATen's bits here")
    window = {"kernel": kernel, "stride": stride, "padding": padding, "dilation": dilation}
    return lw.emit(Op.MAX_POOL, (x.name,), out, pixels=pixels, **window)


def _adaptive_avg_pool2d(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
    """adaptive_avg_pool2d to 1 x 1, which ATen computes as the mean over the last two
    dimensions; else (other sizes, or a mean braze cannot match) ATen's own, as the functional
    call makes it, which native code calls (codegen/calls.py)."""
    no_out(kwargs)
    if isinstance(fn, torch.nn.AdaptiveAvgPool2d):
        x, size = args[0], fn.output_size
    else:
        given = dict(zip(("input", "output_size"), args)) | kwargs
        x, size = given.get("input"), given.get("output_size")
    if not (isinstance(x, Sym) and x.is_tensor and x.meta.dim() in (3, 4)):
        raise NotNative("adaptive_avg_pool2d of a tensor that is not (C, H, W) or (N, C, H, W)")
    # F.adaptive_avg_pool2d's own defaulting: None keeps the input's size
    size = [d if s is None else s for s, d in zip(_pair(size), x.meta.shape[-2:])]
    why = "adaptive_avg_pool2d to a size other than 1 x 1 (ATen's windowed kernel)"
    if size == [1, 1]:
        if lw.fast and is_float32(x) and pixel_rows(x.meta, out):
            return _pixel_mean(lw, x, out)
        try:
            return _sum(mean=True)(lw, torch.mean, (x, (-2, -1), True), {}, out)
        except NotNative as e:
            why = str(e)
    return lw.extern(torch._C._nn.adaptive_avg_pool2d, (x, size), {}, "adaptive_avg_pool2d (ATen's)", why, out)


_AVG_POOL_ARGS = ("kernel_size", "stride", "padding", "ceil_mode", "count_include_pad", "divisor_override")


def _avg_pool2d(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
    """An AvgPool2d layer as the functional call it makes: ATen's avg_pool2d (braze has no
    kernel of its own), which native code calls (codegen/calls.py)."""
    if not plain_layer(fn, torch.nn.AvgPool2d) or kwargs or len(args) != 1:
        raise NotNative("an AvgPool2d layer whose call is more than ATen's avg_pool2d")
    given = (args[0], *(getattr(fn, k) for k in _AVG_POOL_ARGS))
    return lw.extern(F.avg_pool2d, given, {}, "avg_pool2d (ATen's)", "ATen's average pooling", out)


def _pixel_mean(lw: Lowerer, x: Sym, out: torch.Tensor) -> Sym:
    """Fast mode: the mean of each image's channels-last pixel rows, [H*W, C], as GEMMs of rows
    of ones by them (MKL's; a batch of images, batched GEMMs), divided by H*W as ATen's mean
    divides. ATen's channels-last mean is several calls (sum, div, copy): ~20 us a pool inside
    a program, ~200 us of MobileNet-V3-small's 2.4 ms.

    The pixels are summed in two levels, as blocks of `inner` rows side by side, then those
    sums: one GEMM of ones adds its terms in order (MKL's FMA chain), so its error grows with
    their count. In one level a MobileNet-style model on 16 x 32 pixels took fast mode to 4.2x
    eager's largest error on this AMD CPU (the contract allows 4x); in two, 0.96x."""
    n, c, h, w = x.meta.shape
    inner = _block(h * w, 1 if n == 1 else -(-gemm.BMM_MIN_MACS // c))
    rows = lw.view(x, lambda t: t.permute(0, 2, 3, 1).reshape(n, h * w // inner, inner * c))
    total = _ones_times(lw, rows)  # [n, 1, inner * C]: each block position's sum
    if inner > 1:
        total = _ones_times(lw, lw.view(total, lambda t: t.reshape(n, inner, c)))
    total = lw.view(total, lambda t: t.as_strided(out.shape, out.stride(), t.storage_offset()))
    return lw.elementwise(Op.DIV, (total, float(h * w)), out)


def _ones_times(lw: Lowerer, rows: Sym) -> Sym:
    """[n, r, q] -> [n, 1, q]: a row of r ones times each [r, q] (a GEMM; n > 1: a batched one)."""
    n, r, q = rows.meta.shape
    ones = lw.param(torch.ones(1, r), "ones")
    if n == 1:
        total = gemm._gemm(lw, ones, lw.view(rows, lambda t: t[0]), None, 0.0)
        return lw.view(total, lambda t: t.unsqueeze(0))
    each = lw.view(ones, lambda t: t.expand(n, 1, r))
    return gemm._bmm(lw, torch.bmm, (each, rows), {}, torch.empty(n, 1, q, device="meta"))


def _block(p: int, least: int) -> int:
    """How many pixels of p to sum per block: the divisor d of p, from `least` on (where a batched
    GEMM of d x C has fewer multiply-adds, ATen's bmm runs its own loop), with the fewest terms
    per sum, d + p / d; 1 (one level) where none is."""
    blocks = [d for d in range(max(least, 2), p) if p % d == 0]
    return min(blocks, key=lambda d: d + p // d, default=1)
