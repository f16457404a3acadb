"""scaled_dot_product_attention: in exact mode ATen's flash attention, braze's kernel of its
arithmetic (attention.EXACT_NAMES) where its probe agrees (one block of keys; causal, a mask or
neither; docs/aten-bits.md), else ATen's call (in a program generic in its sizes, the kernel
may take its place per call: per_call, passes.attention_per_call); fast mode's own kernel
(attention.py): causal or not, with a boolean or additive float mask or none, grouped key and
value heads, no dropout."""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from .. import attention, config, jit
from ..codegen import float32
from ..ir import Node, Op, TensorMeta, contiguous_strides
from .core import Lowerer, NotNative, Sym, is_float32

_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def arguments(args: tuple, kwargs: dict) -> dict[str, Any]:
    """A call's arguments by name (a call's, or those an EXTERN node of it keeps)."""
    return dict(zip(_ARGS, args)) | kwargs


def _attention(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
    given = arguments(args, kwargs)
    if not lw.fast:
        return _exact(lw, given, out)
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


def _exact(lw: Lowerer, given: dict, out: Any) -> Sym:
    """Exact mode: attention.EXACT_NAMES' kernel, where it gives ATen's bits (else ATen's call,
    why said)."""
    q, k, v, mask = (given.get(a) for a in ("query", "key", "value", "attn_mask"))
    metas = {t.name: TensorMeta.of(t.meta) for t in (q, k, v, mask) if isinstance(t, Sym) and t.is_tensor}
    form = _form(given, metas, TensorMeta.of(out) if isinstance(out, torch.Tensor) else None)
    if isinstance(form, dict):
        queries, keys = q.meta.shape[2], k.meta.shape[2]
        if not all(isinstance(n, int) for m in metas.values() for n in (*m.shape, *m.stride)):
            form = "sizes that change between calls"
        elif not flash_sizes_ok(queries, keys):
            form = "sizes where ATen takes other paths (blocks of 1-3 queries, under 12 keys) or over 512 keys"
        elif not _same(tuple(q.meta.shape), keys, form["scale"], form["causal"], form["mask"]):
            form = "its probe at these sizes disagrees"
        else:
            inputs = (q.name, k.name, v.name) + ((mask.name,) if form["mask"] else ())
            return lw.emit(Op.ATTENTION, inputs, out, exact=True, **form)
    raise NotNative(f"exact mode: ATen's flash attention ({form})")


def _form(given: dict, metas: dict[str, TensorMeta], out: TensorMeta | None) -> dict[str, Any] | str:
    """The attrs of braze's kernel for this call of ATen's flash attention (scale, causal, mask:
    0 none, 1 boolean, 2 float), or why it cannot reproduce it: it computes one block of keys
    (ATen's are 512) with MKL's order in both products, for float32 [batch, heads, tokens, d]
    rows (d a multiple of 32 up to 192), the same batches and heads throughout, a mask that
    broadcasts with its keys contiguous. (The sizes at which it does: flash_sizes_ok.)"""
    q, k, v, mask = (given.get(a) for a in ("query", "key", "value", "attn_mask"))
    causal = given.get("is_causal", False)
    if not config.exact_attention:
        return "config.exact_attention is off (and in a program generic in its sizes)"
    if not isinstance(causal, bool) or (causal and mask is not None):
        return "causality not a constant, or with a mask (eager raises)"
    if given.get("dropout_p", 0.0) != 0.0 or given.get("enable_gqa", False) is not False:
        return "dropout or grouped heads"
    if not torch._C._get_flash_sdp_enabled():
        return "disabled: eager runs the math kernel"
    tensors = (q, k, v) if mask is None else (q, k, v, mask)
    if out is None or not all(isinstance(t, Sym) and t.name in metas for t in tensors):
        return "operands that are not tensors"
    (mq, mk, mv), mm = (metas[t.name] for t in (q, k, v)), metas[mask.name] if mask is not None else None
    if any(m.dtype != torch.float32 or len(m.shape) != 4 or m.stride[3] != 1 for m in (mq, mk, mv, out)):
        return "tensors that are not float32 [batch, heads, tokens, d] with contiguous rows"
    d = mq.shape[3]
    if mk.shape != mv.shape or mk.shape[:2] != mq.shape[:2] or mk.shape[3] != d or out.shape != mq.shape:
        return "keys and values not of the queries' batches, heads and head size"
    if not isinstance(d, int) or d % 32 or d > 192:
        return "a head size that is not a multiple of 32 up to 192"
    kind = 0
    if mm is not None:
        if mm.dtype not in (torch.bool, torch.float32) or len(mm.shape) > 4 or mm.stride[-1] != 1:
            return "a mask that is not boolean or float32 with contiguous keys"
        rows = (1,) * (4 - len(mm.shape)) + tuple(mm.shape)
        if any(r != 1 and r != n for r, n in zip(rows, (*mq.shape[:3], mk.shape[2]))):
            return "a mask that does not broadcast"
        kind = 1 if mm.dtype == torch.bool else 2
    return {"scale": _flash_scale(d, given.get("scale")), "causal": causal, "mask": kind}


# Token counts (queries, keys) a program generic in its sizes probes before its ATen call may run
# braze's kernel at the sizes checked per call (flash_sizes_ok): the keys' 16-lane tails 0-15, the
# queries' blocks of 32 and 64, one block of keys at most, and queries and keys apart
PER_CALL_PROBES = ((12, 12), (17, 17), (31, 31), (36, 36), (100, 100), (197, 197), (260, 260), (512, 512), (17, 100))


def per_call(given: dict, metas: dict[str, TensorMeta], out: TensorMeta) -> dict[str, Any] | None:
    """For ATen's call of scaled_dot_product_attention in a program generic in its sizes (given:
    its arguments by name; metas: the program's layouts of its tensors): the kernel's attrs
    (_form), where it gives ATen's flash bits at every size meeting its conditions (the call
    checks them: codegen/calls.py), as its probes at PER_CALL_PROBES show; else None."""
    form = _form(given, metas, out)
    if not isinstance(form, dict):
        return None
    d, heads = metas[given["query"].name].shape[3], metas[given["query"].name].shape[1]
    heads = heads if isinstance(heads, int) else 2
    if not all(_same((1, heads, t, d), s, form["scale"], form["causal"], form["mask"]) for t, s in PER_CALL_PROBES):
        return None
    return form


# ATen's flash attention's blocks of queries, (from this many queries, the block), largest first;
# the least a block may hold and the keys (one block of them) where braze's kernel takes its paths
QUERY_BLOCKS = ((768, 256), (192, 64), (0, 32))
MIN_BLOCK = 4  # (blocks of 1-3 queries: MKL's other kernels)
KEYS = (12, 512)


def flash_sizes_ok(queries: int, keys: int) -> bool:
    """Whether ATen's flash attention of these token counts takes the paths braze's kernel
    reproduces: one block of keys (KEYS), every block of queries at least MIN_BLOCK
    (codegen/calls.py checks the same per call, from the same constants)."""
    block = next(size for start, size in QUERY_BLOCKS if queries >= start)
    rest = queries % block
    return queries >= MIN_BLOCK and (rest == 0 or rest >= MIN_BLOCK) and KEYS[0] <= keys <= KEYS[1]


def _flash_scale(d: int, scale: Any) -> float:
    """ATen's scale: the given one, or 1 / sqrt(d) in double; a float32 value either way."""
    return float32(1.0 / math.sqrt(d) if scale is None else float(scale))


def _same(shape: tuple[int, ...], keys: int, scale: float, causal: bool, mask: int) -> bool:
    return _probe(shape, keys, scale, causal, mask, jit.mkl_threads())


@functools.cache
def _probe(shape: tuple[int, ...], keys: int, scale: float, causal: bool, mask: int, threads: int) -> bool:  # noqa: ARG001
    """Whether attention.EXACT_NAMES' kernel gives ATen's flash attention's bits at these sizes:
    random queries, keys and values with NaN, infinities, signed zeros, huge values and
    denormals among them (a row's NaN: its place only); a boolean (mask 1) or float (2) mask with
    a fifth of its keys masked (false, -inf), the first row all. Once per process, sizes, scale,
    causality, kind of mask and MKL's thread count (`threads`: in the key)."""
    gen = torch.Generator().manual_seed(0)
    batch, heads, queries, d = shape
    q, k, v = (torch.randn(batch, heads, n, d, generator=gen) for n in (queries, keys, keys))
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e30, 3e38, 1e-40])
    for t in (q, k, v):
        flat = t.view(-1)
        at = torch.randint(0, flat.numel(), (max(1, flat.numel() // 256),), generator=gen)
        flat[at] = special[torch.randint(0, len(special), at.shape, generator=gen)]
    masked = torch.rand(batch, heads, queries, keys, generator=gen) < 0.2
    masked[:, :, 0] = True
    rows = None
    if mask == 1:
        rows = ~masked
    elif mask == 2:
        rows = torch.randn(batch, heads, queries, keys, generator=gen).masked_fill(masked, -float("inf"))
    eager = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=rows, is_causal=causal, scale=scale)
    return jit.same_bits(attention.exact(q, k, v, scale, causal, rows), eager, nan_payloads=False)


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
