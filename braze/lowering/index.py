"""Indexing rows: embedding lookups as native row copies (bit-identical: nothing is computed)."""

from __future__ import annotations

from typing import Any

import torch

from ..ir import Op
from .core import Lowerer, NotNative, Sym, is_float32

_EMBEDDING_ARGS = ("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse")


def _embedding(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
    """F.embedding / nn.Embedding in forward: out[..., :] = weight[index[...], :]. padding_idx,
    scale_grad_by_freq and sparse only change gradients; max_norm renormalises the weight in
    place, which stays ATen's. An index outside the weight's rows raises eager's IndexError at
    run time (the kernel flags it, the program raises once its kernels are done)."""
    if isinstance(fn, torch.nn.Embedding):
        index, weight, max_norm = args[0] if args else kwargs["input"], lw.param(fn.weight, "weight"), fn.max_norm
    else:
        given = dict(zip(_EMBEDDING_ARGS, args)) | kwargs
        index, weight, max_norm = given.get("input"), given.get("weight"), given.get("max_norm")
    if max_norm is not None:
        raise NotNative("embedding with max_norm (it renormalises the weight in place)")
    if not (isinstance(index, Sym) and index.is_tensor and index.meta.dtype in (torch.int64, torch.int32)):
        raise NotNative("embedding with indices that are not an int64 or int32 tensor")
    if not (is_float32(weight) and weight.meta.dim() == 2 and weight.meta.stride(1) == 1):
        raise NotNative("embedding of a weight that is not float32, 2-D with contiguous rows")
    if not (isinstance(out, torch.Tensor) and out.is_contiguous() and out.numel() > 0):
        raise NotNative("embedding with an empty or non-contiguous result")
    return lw.emit(Op.EMBEDDING, (index.name, weight.name), out, rows=weight.meta.shape[0])
