"""scaled_dot_product_attention: ATen's call in exact mode (its flash attention's bits are not
reproduced); fast mode's own kernel (attention.py) without mask, dropout or causal masking."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..ir import Op
from .core import Lowerer, NotNative, Sym, is_float32

_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _attention(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
    if not lw.fast:
        raise NotNative("exact mode: ATen's flash attention (its bits are not reproduced)")
    given = dict(zip(_ARGS, args)) | kwargs
    q, k, v = given["query"], given["key"], given["value"]
    if given.get("attn_mask") is not None or given.get("dropout_p", 0.0) != 0.0 or given.get("is_causal", False):
        raise NotNative("attention with a mask, dropout or causal masking")
    if given.get("enable_gqa", False):
        raise NotNative("attention with grouped key and value heads")
    if not (all(is_float32(t) for t in (q, k, v)) and isinstance(out, torch.Tensor) and out.dtype == torch.float32):
        raise NotNative("attention of tensors that are not float32")
    metas = [q.meta, k.meta, v.meta, out]
    if any(m.dim() != 4 or m.stride(3) != 1 for m in metas):
        raise NotNative("attention of tensors that are not [batch, heads, tokens, d] with contiguous rows")
    (mq, mk, mv, mo), d = metas, metas[0].shape[3]
    if mq.shape[:2] != mk.shape[:2] or mk.shape != mv.shape or mk.shape[3] != d or d % 32 or mo.shape != mq.shape:
        raise NotNative("attention whose heads differ in number or size, or whose head size is not a multiple of 32")
    scale = given.get("scale")
    scale = 1 / math.sqrt(d) if scale is None else float(scale)
    return lw.emit(Op.ATTENTION, (q.name, k.name, v.name), out, scale=scale)
