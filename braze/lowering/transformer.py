"""nn.TransformerEncoderLayer's fused fast path (`torch._transformer_encoder_layer_fwd`, what an
eval layer with batch_first calls) lowered as the ops its CPU kernel runs, in its order, so each
becomes braze's own (GEMMs, softmax, layer_norm, elementwise) or an ATen call of its own; and
nn.MultiheadAttention's (`torch._native_multi_head_attention`, the same kernel's attention) where
eager takes it.

ATen's CPU path (transformers/transformer.cpp, attention.cpp, NativeMultiheadAttnKernel.cpp):
optional layer_norm; qkv = matmul(x, W_qkv.t()) without bias; q = (q + b_q) * s with s =
float(1 / sqrtf(head_dim)), k + b_k, v + b_v, each laid out [B, H, T, head_dim]; scores = bmm(q,
k^T); softmax over the last dimension (no scaled_dot_product_attention on CPU); bmm with v; the
heads back to [B*T, D] and addmm with the output projection; + src; layer_norm (post-norm);
addmm, relu or gelu, addmm; + the residual; layer_norm (post-norm). Checked bit for bit against
the fused op for relu/gelu, pre/post-norm, head sizes 10 to 64, batch 1-4, lengths 1-128, strided
inputs, 1 and 2 threads (tests/test_transformer.py). Fast mode, with heads of a multiple of 32:
the projection with its bias, then fast mode's attention kernel on q, k and v where the
projection left them (`_fused_attention`; transformer-layer 1.036x as fast, one process, 21
rounds).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.nn.functional as F

from .. import jit
from ..codegen import float32
from .core import Lowerer, NotNative, Sym, is_float32

_ARGS = (
    "src embed_dim num_heads qkv_weight qkv_bias proj_weight proj_bias use_gelu norm_first eps norm_weight_1 "
    "norm_bias_1 norm_weight_2 norm_bias_2 ffn_weight_1 ffn_bias_1 ffn_weight_2 ffn_bias_2 mask mask_type"
).split()


def _encoder_layer(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
    g = dict(zip(_ARGS, args)) | kwargs
    src, heads = g["src"], g["num_heads"]
    if g.get("mask") is not None:
        raise NotNative("the fused transformer layer with a mask (ATen's _masked_softmax: glibc expf, double sums)")
    _foldable(src, "the fused transformer layer")
    b, t, d = src.meta.shape
    ops = _Ops(lw)
    x = ops.norm(src, g, 1) if g["norm_first"] else src
    x = ops.add(_attention(ops, x, g, b, t, d, heads), src)
    if not g["norm_first"]:
        x = ops.norm(x, g, 1)
    h = ops.norm(x, g, 2) if g["norm_first"] else x
    h = ops.addmm(g["ffn_bias_1"], ops.method("reshape", h, b * t, d), g["ffn_weight_1"])
    h = ops.call(F.gelu if g["use_gelu"] else torch.relu, h)
    y = ops.add(ops.method("view", ops.addmm(g["ffn_bias_2"], h, g["ffn_weight_2"]), b, t, d), x)
    return ops.norm(y, g, 2) if not g["norm_first"] else y


_NATIVE_MHA_ARGS = (
    "query key value embed_dim num_head qkv_weight qkv_bias proj_weight proj_bias mask need_weights".split()
)


def _native_multihead_attention(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> tuple:
    """torch._native_multi_head_attention (nn.MultiheadAttention's fast path, as a TorchDynamo
    graph holds it): the fused layer's attention, the same ATen kernel (native_multi_head_attention_cpu)."""
    g = dict(zip(_NATIVE_MHA_ARGS, args)) | kwargs
    x = _self_attention(g)
    if g.get("mask") is not None or g.get("need_weights", True):
        raise NotNative("the fused attention with a mask, or returning its weights")
    _foldable(x, "the fused attention")
    b, t, d = x.meta.shape
    return _attention(_Ops(lw, "torch._native_multi_head_attention"), x, g, b, t, d, g["num_head"]), None


def _self_attention(g: dict) -> Sym:
    """The one tensor an attention's query, key and value are (the lowerings take self-attention)."""
    x = g["query"]
    if not (isinstance(x, Sym) and x is g["key"] and x is g["value"]):
        raise NotNative("attention whose query, key and value are not one tensor")
    return x


def _foldable(x: Sym, what: str) -> None:
    if not (is_float32(x) and x.meta.dim() == 3 and x.meta.numel() > 0):
        raise NotNative(f"{what} of a tensor that is not non-empty 3-D float32")
    if x.meta.stride(0) != x.meta.stride(1) * x.meta.shape[1]:
        raise NotNative(f"{what} of an input its matmul does not fold into one GEMM")


def _attention(ops: _Ops, x: Sym, g: dict, b: int, t: int, d: int, heads: int) -> Sym:
    dh = d // heads
    if ops.lw.fast and dh % 32 == 0:
        return _fused_attention(ops, x, g, heads, batch_first=True)
    qkv = ops.call(F.linear, ops.method("view", x, b * t, d), g["qkv_weight"])  # ATen: mm(x, W^T)
    qkv = ops.method("view", qkv, b, t, 3, heads, dh)
    bias = ops.method("view", g["qkv_bias"], 3, 1, 1, heads, dh)
    scale = float32(1.0 / float32(dh**0.5))  # sqrtf, then a double division rounded to float

    def part(i: int, scaled: bool = False) -> Sym:
        v = ops.add(ops.item(qkv, (slice(None), slice(None), i)), ops.item(bias, i))
        v = ops.call(operator.mul, v, scale) if scaled else v
        v = ops.method("contiguous", ops.method("permute", v, 0, 2, 1, 3))
        return ops.method("view", v, b * heads, t, dh)

    q, k, v = part(0, scaled=True), part(1), part(2)
    scores = ops.call(torch.softmax, ops.call(torch.bmm, q, ops.method("transpose", k, 2, 1)), -1)
    ctx = ops.method("view", ops.call(torch.bmm, scores, v), b, heads, t, dh)
    ctx = ops.method("view", ops.method("contiguous", ops.method("permute", ctx, 0, 2, 1, 3)), b * t, d)
    return ops.method("view", ops.addmm(g["proj_bias"], ctx, g["proj_weight"]), b, t, d)


def _fused_attention(ops: _Ops, x: Sym, g: dict, heads: int, batch_first: bool) -> Sym:
    """Fast mode: x [batch, tokens, d] (or [tokens, batch, d]) through the projection (g's
    qkv_weight) with its bias in the GEMM, fast mode's attention kernel reading the heads in
    place from its output (the scale on the scores, no [batch heads, tokens, tokens] scores in
    memory), its output the output projection's input (as it stands where the batch comes
    first)."""
    a, c, d = x.meta.shape
    dh = d // heads
    qkv = ops.call(F.linear, ops.method("reshape", x, a * c, d), g["qkv_weight"], g["qkv_bias"])
    qkv = ops.method("view", qkv, a, c, 3, heads, dh)
    order = (0, 2, 1, 3) if batch_first else (1, 2, 0, 3)  # to [batch, heads, tokens, dh]
    q, k, v = (ops.method("permute", ops.item(qkv, (slice(None), slice(None), i)), *order) for i in range(3))
    ctx = ops.call(F.scaled_dot_product_attention, q, k, v)
    ctx = ops.method("permute", ctx, *((0, 2, 1, 3) if batch_first else (2, 0, 1, 3)))
    ctx = ops.addmm(g["proj_bias"], ops.method("reshape", ctx, a * c, d), g["proj_weight"])
    return ops.method("view", ctx, a, c, d)


_MHA_ARGS = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask", "average_attn_weights")


def _multihead_attention(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> tuple:
    """nn.MultiheadAttention's self-attention without masks or weights returned. Exact mode: where
    eager takes the module's fused kernel (torch._native_multi_head_attention), that kernel's ops
    (_attention); fast mode: heads of a multiple of 32, _fused_attention."""
    g = dict(zip(_MHA_ARGS, args)) | kwargs
    x = _self_attention(g)
    if g.get("need_weights", True) or g.get("attn_mask") is not None or g.get("key_padding_mask") is not None:
        raise NotNative("nn.MultiheadAttention with a mask, or returning its weights")
    lw.reads_training.append(fn)  # the program is for this flag: the entry checks it
    if not lw.fast:
        return _eagers_fused_kernel(lw, fn, x), None
    if (fn.training and fn.dropout) or fn.bias_k is not None or fn.add_zero_attn or not fn._qkv_same_embed_dim:
        raise NotNative("nn.MultiheadAttention with dropout, added keys or separate projections")
    if not (is_float32(x) and x.meta.dim() == 3 and fn.head_dim % 32 == 0):
        raise NotNative("nn.MultiheadAttention of a tensor that is not 3-D float32, or heads not a multiple of 32")
    ops = _Ops(lw, "nn.MultiheadAttention")
    return _fused_attention(ops, x, _projections(lw, fn), fn.num_heads, fn.batch_first), None


def _projections(lw: Lowerer, fn: Any) -> dict[str, Any]:
    """The module's in- and output projections as the program's parameters, named as the fused
    kernel's arguments (a bias it lacks None)."""
    w, bias = lw.weights(fn.out_proj)
    return {
        "qkv_weight": lw.param(fn.in_proj_weight, "in_proj_weight"),
        "qkv_bias": None if fn.in_proj_bias is None else lw.param(fn.in_proj_bias, "in_proj_bias"),
        "proj_weight": w,
        "proj_bias": bias,
    }


def _eagers_fused_kernel(lw: Lowerer, fn: Any, x: Sym) -> Sym:
    """Exact mode: the fused kernel's ops where eager's forward would call that kernel; elsewhere
    the module's call stays (eager then runs F.multi_head_attention_forward, whose
    scaled_dot_product_attention's bits braze does not reproduce). The forward chooses at each
    call, from the module's attributes (the entry watches them, as every called layer's) and
    torch.backends.mha's switch (watched too); its other conditions (grad, autocast,
    torch-function modes, devices) are ones under which no program runs."""
    if jit.dict_version(torch.backends.mha.__dict__) is None or jit.dict_version(fn.__dict__) is None:
        raise NotNative("exact mode: this Python's dictionaries have no version tag to watch eager's choice by")
    lw.watched.append(torch.backends.mha)
    why = _why_not_fused(fn, x)
    if why:
        raise NotNative(f"exact mode: eager runs nn.MultiheadAttention's other path here ({why})")
    _foldable(x, "nn.MultiheadAttention")
    b, t, d = x.meta.shape
    return _attention(_Ops(lw, "nn.MultiheadAttention"), x, _projections(lw, fn), b, t, d, fn.num_heads)


def _why_not_fused(fn: Any, x: Sym) -> str:
    """Why nn.MultiheadAttention.forward (torch 2.13) would not call its fused kernel on x as
    self-attention without masks, or "" where it would."""
    w, bias = fn.in_proj_weight, fn.in_proj_bias
    if not torch.backends.mha.get_fastpath_enabled():
        return "torch.backends.mha's fast path is off"
    if x.meta.dim() != 3:
        return "an input that is not batched"
    if w is None or bias is None:
        return "separate projections, or no bias"
    if not is_float32(x) or w.dtype != torch.float32 or bias.dtype != torch.float32:
        return "not float32"
    if fn.training:
        return "training"
    if fn.num_heads % 2:
        return "an odd number of heads"
    if not fn.batch_first:
        return "batch_first is False"
    if fn.bias_k is not None or fn.bias_v is not None or fn.add_zero_attn:
        return "added keys"
    return ""


class _Ops:
    """The calls of the decomposition, each lowered as the graph's own calls are (lw.call)."""

    def __init__(self, lw: Lowerer, within: str = "torch._transformer_encoder_layer_fwd") -> None:
        self.lw, self.within = lw, within

    def call(self, fn: Any, *args: Any) -> Any:
        name = getattr(fn, "__name__", str(fn))
        return self.lw.call(fn, args, {}, key=fn, label=f"{self.within}: {name}")

    def method(self, name: str, *args: Any) -> Any:
        return self.lw.call(getattr(torch.Tensor, name), args, {}, key=name, label=f"{self.within}: .{name}")

    def add(self, a: Sym, b: Sym) -> Sym:
        return self.call(operator.add, a, b)

    def item(self, x: Sym, index: Any) -> Sym:
        return self.call(operator.getitem, x, index)

    def addmm(self, bias: Sym, x: Sym, weight: Sym) -> Sym:
        """addmm(bias, x, weight^T), which is what ATen's linear of a matrix calls (as a linear,
        fast mode may run it on a packed weight)."""
        return self.call(F.linear, x, weight, bias)

    def norm(self, x: Sym, g: dict, i: int) -> Sym:
        d = x.meta.shape[-1]
        return self.lw.call(
            F.layer_norm,
            (x, (d,), g[f"norm_weight_{i}"], g[f"norm_bias_{i}"], g["eps"]),
            {},
            key=F.layer_norm,
            label=f"{self.within}: layer_norm",
        )
