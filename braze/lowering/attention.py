"""scaled_dot_product_attention: ATen's call in exact mode (its flash attention's bits are not
reproduced); fast mode's own kernel (attention.py): causal or not, with a boolean or additive
float mask or none, grouped key and value heads, no dropout."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..ir import Node, Op, contiguous_strides
from .core import Lowerer, NotNative, Sym, is_float32

_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _attention(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
    if not lw.fast:
        raise NotNative("exact mode: ATen's flash attention (its bits are not reproduced)")
    given = dict(zip(_ARGS, args)) | kwargs
    q, k, v, mask = given["query"], given["key"], given["value"], given.get("attn_mask")
    causal, grouped = given.get("is_causal", False), given.get("enable_gqa", False)
    if given.get("dropout_p", 0.0) != 0.0 or not isinstance(causal, bool) or not isinstance(grouped, bool):
        raise NotNative("attention with dropout, or whose is_causal or enable_gqa is not a constant")
    if not (all(is_float32(t) for t in (q, k, v)) and isinstance(out, torch.Tensor) and out.dtype == torch.float32):
        raise NotNative("attention of tensors that are not float32")
    if not grouped and all(isinstance(t, Sym) for t in (q, k, v)):  # Hugging Face's repeat_kv
        nodes = {n.name: n for n in lw.nodes}
        unrepeated = [_repeated(lw, nodes, t) for t in (k, v)]
        if all(unrepeated) and unrepeated[0][1] == unrepeated[1][1]:
            (k, _), (v, _) = unrepeated
            grouped = True
    mq, mk, mv = q.meta, k.meta, v.meta
    if any(m.dim() != 4 or m.stride(3) != 1 for m in (mq, mk, mv, out)):
        raise NotNative("attention of tensors that are not [batch, heads, tokens, d] with contiguous rows")
    (batch, heads, queries, d), kv_heads, keys = mq.shape, mk.shape[1], mk.shape[2]
    shared = kv_heads == heads or (grouped and kv_heads > 0 and heads % kv_heads == 0)
    if mk.shape[0] != batch or mk.shape != mv.shape or mk.shape[3] != d or not shared or out.shape != mq.shape:
        raise NotNative("attention whose batches, heads or head sizes do not match")
    if d % 32 or keys == 0:
        raise NotNative("attention over no keys, or with a head size that is not a multiple of 32")
    inputs = (q.name, k.name, v.name)
    kind = 0
    if mask is not None:
        if not (isinstance(mask, Sym) and mask.is_tensor and mask.meta.dtype in (torch.bool, torch.float32)):
            raise NotNative("attention with a mask that is not a boolean or float32 tensor")
        try:
            rows = mask.meta.expand(batch, heads, queries, keys)
        except RuntimeError as e:
            raise NotNative("attention with a mask that does not broadcast") from e
        if keys > 1 and rows.stride(3) != 1:
            raise NotNative("attention with a mask whose keys are not contiguous")
        kind, inputs = (1 if mask.meta.dtype == torch.bool else 2), (*inputs, mask.name)
    scale = given.get("scale")
    scale = 1 / math.sqrt(d) if scale is None else float(scale)
    return lw.emit(Op.ATTENTION, inputs, out, scale=scale, causal=causal, mask=kind)


def _repeated(lw: Lowerer, nodes: dict[str, Node], s: Sym) -> tuple[Sym, int] | None:
    """Where s is Hugging Face's repeat_kv of some x [B, KV, T, D], its copy of x[:, :, None]
    expanded to [B, KV, G, T, D] viewed as [B, KV G, T, D]: (x, as a view of its own, G); else
    None. Grouped-query attention on x reads each key and value head where x has it (head h:
    x's h // G, as the copy's), so the copy goes (dce). `nodes`: the lowered ones by name."""
    view = nodes.get(s.name)
    copy = nodes.get(view.inputs[0]) if view is not None and view.op is Op.VIEW else None
    expanded = nodes.get(copy.inputs[0]) if copy is not None and copy.op is Op.COPY else None
    if expanded is None or expanded.op is not Op.VIEW or expanded.name not in lw.real:
        return None
    shape, stride = expanded.meta.shape, expanded.meta.stride
    if len(shape) != 5 or stride[2] != 0 or not isinstance(shape[2], int) or shape[2] < 2:
        return None
    b, kv, g, t, d = shape
    dense = copy.meta.stride == contiguous_strides(shape) and copy.meta.offset == 0
    if tuple(s.meta.shape) != (b, kv * g, t, d) or not s.meta.is_contiguous() or s.meta.storage_offset() or not dense:
        return None
    source = Sym(expanded.name, lw.real[expanded.name])
    return lw.view(source, lambda e: e.select(2, 0)), g
