"""Row kernels: layer_norm, softmax, log_softmax, sum and mean through braze's native kernels
(braze/rows.py), where a probe shows they give ATen's bits."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .. import rows, sleef
from ..ir import Op
from .core import Lowerer, NotNative, Sym, is_float32, no_out, plain_layer


def _layer_norm_parts(fn: Any, args: tuple, kwargs: dict) -> tuple[Any, tuple, Any, Any, Any]:
    if isinstance(fn, torch.nn.LayerNorm):
        return args[0], tuple(fn.normalized_shape), fn.weight, fn.bias, fn.eps
    names = ("input", "normalized_shape", "weight", "bias", "eps")
    given = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
    return (
        given["input"],
        tuple(given["normalized_shape"]),
        given.get("weight"),
        given.get("bias"),
        given.get("eps", 1e-5),
    )


def _layer_norm(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
    """ATen's layer_norm: the input made contiguous, then each row of the normalised size through
    rows.py's kernel (RowwiseMoments, then fma((x - mean) * rstd, weight, bias))."""
    no_out(kwargs)
    x, shape, w, b, eps = _layer_norm_parts(fn, args, kwargs)
    if isinstance(fn, torch.nn.LayerNorm):
        w, b = lw.weights(fn)
    if not (isinstance(w, Sym) and isinstance(b, Sym)):
        raise NotNative("layer_norm without both weight and bias (ATen's scalar path)")
    n = math.prod(shape)
    for t in (x, w, b):
        if not is_float32(t):
            raise NotNative("layer_norm of tensors that are not float32")
    if (
        tuple(w.meta.shape) != shape
        or tuple(b.meta.shape) != shape
        or not (w.meta.is_contiguous() and b.meta.is_contiguous())
    ):
        raise NotNative("layer_norm with a weight or bias that is not contiguous of the normalised shape")
    if n == 0 or not isinstance(eps, float) or not isinstance(out, torch.Tensor) or not out.is_contiguous():
        raise NotNative("layer_norm of zero-size rows, or an eps or result braze does not expect")
    if not rows.layer_norm_same():
        raise NotNative("a probe found braze's layer_norm does not give ATen's bits here")
    x = lw.view(x, lambda t: t.contiguous())
    return lw.emit(Op.LAYER_NORM, (x.name, w.name, b.name), out, n=n, rows=out.numel() // n, eps=eps)


def _softmax(log: bool) -> Callable[..., Sym]:
    """ATen's (log_)softmax over the last dimension: the input made contiguous, then rows.py's
    kernel on each row (other dimensions run ATen's other kernel, with another order: its call)."""
    label = "log_softmax" if log else "softmax"

    def row(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
        no_out(kwargs)
        if isinstance(fn, (torch.nn.Softmax, torch.nn.LogSoftmax)):
            x, dim, dtype = args[0], fn.dim, None
        else:
            given = dict(zip(("input", "dim", "_stacklevel", "dtype"), args)) | kwargs
            x, dim, dtype = given.get("input", given.get("self")), given.get("dim"), given.get("dtype")
        if not (is_float32(x) and x.meta.dim() > 0):
            raise NotNative(f"{label} of a tensor that is not float32 with dimensions")
        if not isinstance(dim, int) or dim not in (-1, x.meta.dim() - 1) or dtype not in (None, torch.float32):
            raise NotNative(f"{label} over a dimension other than the last (ATen's other kernel), or another dtype")
        n = x.meta.shape[-1]
        if n == 0 or not isinstance(out, torch.Tensor) or not out.is_contiguous():
            raise NotNative(f"{label} of empty rows, or a result braze does not expect")
        other = sleef.other_capability()  # the kernels call Sleef's 16-lane functions
        if other:
            raise NotNative(other)
        if not rows.softmax_same(log):
            raise NotNative(f"a probe found braze's {label} does not give ATen's bits here")
        x = lw.view(x, lambda t: t.contiguous())
        return lw.emit(Op.SOFTMAX, (x.name,), out, n=n, rows=out.numel() // n, log=log)

    return row


def _sum(mean: bool) -> Callable[..., Sym]:
    """ATen's sum (mean: that sum / n) of a contiguous input over its last dimensions (or all of
    them): ATen's reduction merges the reduced dimensions into one, so each row of the input viewed
    as [kept..., reduced] goes through rows.py's cascade sum (and its two passes over one long
    row). Other dimensions and strided inputs keep ATen's call."""
    label = "mean" if mean else "sum"

    def row(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
        no_out(kwargs)
        given = dict(zip(("input", "dim", "keepdim"), args)) | kwargs
        x, dim, dtype = given.get("input", given.get("self")), given.get("dim"), given.get("dtype")
        if not (is_float32(x) and x.meta.dim() > 0):
            raise NotNative(f"{label} of a tensor that is not float32 with dimensions")
        rank = x.meta.dim()
        dims = range(rank) if dim is None else tuple(dim) if isinstance(dim, (tuple, list)) else (dim,)
        if not dims or not all(isinstance(d, int) and -rank <= d < rank for d in dims):
            raise NotNative(f"{label} over dimensions braze does not read")
        kept = rank - len(dims)
        if sorted(d % rank for d in dims) != list(range(kept, rank)) or dtype not in (None, torch.float32):
            raise NotNative(f"{label} over other dimensions than the last ones, or into another dtype")
        n = math.prod(x.meta.shape[kept:])
        if n == 0 or not x.meta.is_contiguous() or not isinstance(out, torch.Tensor) or not out.is_contiguous():
            raise NotNative(f"{label} of an empty or strided row (ATen's loops take another order)")
        if not rows.sum_same():
            raise NotNative(f"a probe found braze's {label} does not give ATen's bits here")
        lead = tuple(x.meta.shape[:kept])
        if kept != rank - 1:
            x = lw.view(x, lambda t: t.reshape(*lead, n))
        total = lw.emit(Op.SUM, (x.name,), torch.empty(lead, device="meta"), n=n, rows=math.prod(lead), mean=mean)
        return total if tuple(out.shape) == lead else lw.view(total, lambda t: t.view(out.shape))

    return row


def _group_norm(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
    """A GroupNorm layer as the functional call it makes: ATen's group_norm (braze has no kernel
    of its own), which native code calls (codegen/calls.py)."""
    if not plain_layer(fn, torch.nn.GroupNorm) or kwargs or len(args) != 1:
        raise NotNative("a GroupNorm layer whose call is more than ATen's group_norm")
    w, b = lw.weights(fn)
    given = (args[0], fn.num_groups, w, b, fn.eps)
    return lw.extern(F.group_norm, given, {}, "group_norm (ATen's)", "ATen's group_norm", out)
