"""Attention kernels, built once per process into the JIT. Fast mode's (mode="fast"):
softmax(q k^T * scale + mask) v for each (batch, head), causal or not, with a boolean or additive
float mask or none:

    braze_attention[_bool|_float](q, k, v, out, mask, H, group, T, S, d,
                    <b, h, t strides of q, k, v, out, mask>, scale, causal, lo, hi, error)

for the rows [lo, hi) of the (batch, head, query) rows, which codegen splits evenly between
threads (split by (batch, head) pair, ViT-Tiny's three heads kept one of two threads waiting a
third of the time); `group` query heads share each key and value head (grouped-query attention).
For each pair with rows in the range: k is packed into panels of 32 keys (gathers of 16), then
per block of 12 of those queries the scores q k^T come from a register-blocked
kernel (24 AVX-512 accumulators: per head dimension one broadcast of q per row, two vector loads
of the panel), each row's softmax is taken unnormalised (its max, Sleef's exp of score * scale
(+ mask) - max, their sum: 16-lane trees; as in ATen's kernel NaN scores do not count in the max,
and a row whose max is -inf gives 0; causal rows stop at their own key), the same kernel
multiplies the block by v read in place (its rows are the panels' rows), and the rows are divided
by their sums. d must be a multiple of 32. Not eager's arithmetic (ATen's flash attention blocks keys and rescales as it
goes): within the accuracy contract, at ATen's error against float64 here. A thread that
cannot have its scratch memory (the packed keys and a block's scores: 4 (S + 31) (d + 12) bytes)
computes nothing and sets OUT_OF_MEMORY in the word `error` points to (the program raises
torch.OutOfMemoryError).

Exact mode's, braze_attention_exact[_bool|_float] (EXACT_NAMES, the same arguments): ATen's
flash attention's arithmetic for one block of keys (docs/aten-bits.md): the same packed keys and
score kernel (an FMA chain over d from 0: MKL's order), then ATen's scaling (with a mask, one
fmaf), max, exp_u20 on the 16-lane body and double exp on the tail, sum, and the product by v
through gemmkernel's kernel in MKL's order, each row times 1 / sum.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Callable

import llvmlite.ir as ll
import torch

from . import gemmkernel, jit
from .codegen import (
    F32,
    I1,
    I32,
    I64,
    LANES16,
    OUT_OF_MEMORY,
    PTR,
    VOID,
    combine_lanes,
    counted_loop,
    declared,
    fma,
    gather,
    lanes_below,
    masked_load,
    masked_store,
    maximum,
    pieces,
    smaller,
    splat,
)
from .gemmkernel import block_kernel, carried

NAME = "braze_attention"
NAMES = [NAME, f"{NAME}_bool", f"{NAME}_float"]  # by kind of mask: none, boolean, additive float
# exact mode's, ATen's flash attention's arithmetic (one block of keys), by kind of mask as NAMES
EXACT = f"{NAME}_exact"
EXACT_NAMES = [EXACT, f"{EXACT}_bool", f"{EXACT}_float"]
# Queries per block (24 accumulators; 6 rows: 12, 7-9% slower, one thread, BERT's and ViT's
# shapes), keys or head dimensions per panel. A last block of 7-11 queries is the kernels of 6
# rows and of the rest: only these heights are built (all twelve took 259 ms to build, six 124).
MR, NR = 12, 32
HEIGHTS = (1, 2, 3, 4, 5, 6, MR)
# q, k, v, out, mask; heads, group, T, S, d; b, h, t strides of q, k, v, out and mask; scale,
# causal, lo, hi; the program's error word
ARGS = [PTR] * 5 + [I64] * 5 + [I64] * 15 + [F32, I64, I64, I64, PTR]


def _pack_keys(b: ll.IRBuilder, k: ll.Value, ldk: ll.Value, s: ll.Value, d: ll.Value, packed: ll.Value) -> None:
    """packed[p][c][j] = k[(32 p + j) ldk + c] (0 past the S keys): 16 keys a masked gather."""
    spad = b.mul(b.sdiv(b.add(s, I64(NR - 1)), I64(NR)), I64(NR))
    with counted_loop(b, I64(0), spad, 16) as t:
        mask = lanes_below(b, b.sub(s, t))
        dst = b.add(b.mul(b.sdiv(t, I64(NR)), b.mul(d, I64(NR))), b.srem(t, I64(NR)))
        with counted_loop(b, I64(0), d) as c:
            value = gather(b, k, b.add(b.mul(t, ldk), c), ldk, mask)
            b.store(value, b.gep(packed, [b.add(dst, b.mul(c, I64(NR)))], source_etype=F32), align=4)


def _softmax_rows(
    b: ll.IRBuilder,
    scores: ll.Value,
    rows: ll.Value,
    limit: Callable[[ll.Value], ll.Value],
    extent: ll.Value,
    spad: ll.Value,
    scale: ll.Value,
    mask: Callable[[ll.Value, ll.Value, ll.Value, ll.Value], ll.Value],
    inverse: ll.Value,
) -> None:
    """Each of `rows` rows of scores (spad apart): z = mask(row, t, score * scale, lanes) over its
    first limit(row) entries, then exp(z - max z) there and 0 after them up to `extent`; the
    sum's reciprocal goes to inverse[row]."""
    exp = declared(b.module, "Sleef_expf16_u10", LANES16, [LANES16])
    low, zero = ll.Constant(LANES16, [float("-inf")] * 16), ll.Constant(LANES16, [0.0] * 16)
    factor = splat(b, scale, 16)
    with counted_loop(b, I64(0), rows) as r:
        s = limit(r)
        row = b.gep(scores, [b.mul(r, spad)], source_etype=F32)
        at = lambda t: b.gep(row, [t], source_etype=F32)  # noqa: E731

        def most(t: ll.Value, acc: list[ll.Value]) -> list[ll.Value]:
            lanes = lanes_below(b, b.sub(s, t))
            z = mask(r, t, b.fmul(b.load(at(t), typ=LANES16, align=4), factor), lanes)
            b.store(z, at(t), align=4)
            value = b.select(lanes, z, low)
            return [b.select(b.fcmp_ordered(">", value, acc[0]), value, acc[0])]  # NaN never wins

        (top,) = carried(b, I64(0), s, 16, [low], most)
        top = combine_lanes(b, top, lambda x, y: b.select(b.fcmp_ordered(">", x, y), x, y))
        empty = b.fcmp_ordered("==", top, F32(float("-inf")))  # every score NaN or -inf: eager's row is 0
        top = splat(b, top, 16)

        def exps(t: ll.Value, acc: list[ll.Value]) -> list[ll.Value]:
            e = b.call(exp, [b.fsub(b.load(at(t), typ=LANES16, align=4), top)])
            e = b.select(b.and_(lanes_below(b, b.sub(s, t)), b.not_(splat(b, empty, 16))), e, zero)
            b.store(e, at(t), align=4)
            return [b.fadd(acc[0], e)]

        (total,) = carried(b, I64(0), extent, 16, [zero], exps)
        inverse_sum = b.select(empty, F32(0.0), b.fdiv(F32(1.0), combine_lanes(b, total, b.fadd)))
        b.store(inverse_sum, b.gep(inverse, [r], source_etype=F32))


# Vectorized<float>::exp_u20 (ATen's vec512_float.h), exact mode's exp in the vector body of
# the flash kernel's _exp_reduce_sum_fusion_kernel: its clamps, x = n ln2 + r with n = floor(x
# log2e + 0.5), a degree-5 polynomial of r by FMAs, times 2^(n - 1), times 2
_LOG2E, _LN2 = 0x3FB8AA3B, 0x3F317218
_LN_FLT_MIN, _LN_FLT_MAX = 0xC2AEAC50, 0x42B17218
F64 = ll.DoubleType()
_POLY = (0.00828929059, 0.0418978221, 0.166676521, 0.499991506, 0.999999701, 1.0)


def _bits(word: int) -> float:
    return struct.unpack("<f", struct.pack("<I", word))[0]


def _exp_u20(b: ll.IRBuilder, x: ll.Value) -> ll.Value:
    """exp_u20 of 16 floats, operation for operation (min/max as the x86 instructions order
    their operands: a NaN becomes the upper clamp; below ln(FLT_MIN) the result is 0)."""
    const = lambda v: splat(b, F32(v), 16)  # noqa: E731
    low, high = const(_bits(_LN_FLT_MIN)), const(_bits(_LN_FLT_MAX))
    below = b.fcmp_ordered("<", x, low)
    src = b.select(b.fcmp_ordered("<", x, high), x, high)  # _mm512_min_ps(x, high)
    src = b.select(b.fcmp_ordered(">", src, low), src, low)  # _mm512_max_ps(src, low)
    fx = b.call(
        declared(b.module, "llvm.floor.v16f32", LANES16, [LANES16]), [fma(b, src, const(_bits(_LOG2E)), const(0.5))]
    )
    r = fma(b, b.fneg(fx), const(_bits(_LN2)), src)  # _mm512_fnmadd_ps(fx, ln2, src)
    p = fma(b, r, const(_POLY[0]), const(_POLY[1]))
    for c in _POLY[2:]:
        p = fma(b, r, p, const(c))
    i32s = ll.VectorType(I32, 16)
    n = b.fptosi(b.fsub(fx, const(1.0)), i32s)
    power = b.bitcast(b.shl(b.add(n, splat(b, I32(127), 16)), splat(b, I32(23), 16)), LANES16)
    power = b.select(below, const(0.0), power)
    res = b.fmul(p, power)
    return b.fadd(res, res)


def _softmax_rows_exact(
    b: ll.IRBuilder,
    scores: ll.Value,
    rows: ll.Value,
    s: ll.Value,
    spad: ll.Value,
    scale: ll.Value,
    inverse: ll.Value,
    mask: Callable[[ll.Value, ll.Value, int], ll.Value] | None,
) -> None:
    """ATen's flash attention on each of `rows` rows of s scores (spad apart; one block of keys;
    FlashAttentionKernel.cpp, its AVX512 build): z = score * scale stored, its max (a vector body
    of 16-lane at::vec::maximum and its lane tree, then a scalar tail that ignores NaN; a NaN in
    the body makes the max NaN); with a mask (mask(row, t, width): its values), z = fmaf(score,
    scale, mask) (GCC contracted them) and a NaN anywhere makes the max NaN (reduce_all); then
    exp_u20(z - max) on the body, (float) exp((double) (z - max)) on the tail, their sum (16 lanes
    in column order, the lane tree, then the tail in order), and 1 / sum (1 where the sum is 0)
    to inverse[row]; a row whose max is -inf has weights 0 and sum 0."""
    exp = declared(b.module, "exp", F64, [F64])
    low, zero = ll.Constant(LANES16, [float("-inf")] * 16), ll.Constant(LANES16, [0.0] * 16)
    factor = splat(b, scale, 16)
    body = b.mul(b.sdiv(s, I64(16)), I64(16))
    with counted_loop(b, I64(0), rows) as r:
        row = b.gep(scores, [b.mul(r, spad)], source_etype=F32)
        at = lambda t: b.gep(row, [t], source_etype=F32)  # noqa: E731

        def scaled(t: ll.Value, acc: list[ll.Value]) -> list[ll.Value]:
            x = b.load(at(t), typ=LANES16, align=4)
            z = b.fmul(x, factor) if mask is None else fma(b, x, factor, mask(r, t, 16))
            b.store(z, at(t), align=4)
            return [maximum(b, acc[0], z)]

        def scaled_tail(t: ll.Value, acc: list[ll.Value]) -> list[ll.Value]:
            x = b.load(at(t), typ=F32)
            z = b.fmul(x, scale) if mask is None else fma(b, x, scale, mask(r, t, 1))
            b.store(z, at(t))
            larger = b.select(b.fcmp_ordered(">", z, acc[0]), z, acc[0])
            nan = b.fcmp_unordered("uno", z, acc[0])
            return [larger if mask is None else b.select(nan, F32(float("nan")), larger)]

        (lanes,) = carried(b, I64(0), body, 16, [low], scaled)
        top = combine_lanes(b, lanes, lambda x, y: maximum(b, x, y))
        (tail,) = carried(b, body, s, 1, [F32(float("-inf"))], scaled_tail)
        nan = b.fcmp_unordered("uno", top, top if mask is None else tail)
        top = b.select(nan, F32(float("nan")), b.select(b.fcmp_ordered("<", tail, top), top, tail))
        empty = b.fcmp_ordered("==", top, F32(float("-inf")))
        shift = splat(b, top, 16)

        def exps(t: ll.Value, acc: list[ll.Value]) -> list[ll.Value]:
            e = _exp_u20(b, b.fsub(b.load(at(t), typ=LANES16, align=4), shift))
            e = b.select(splat(b, empty, 16), zero, e)
            b.store(e, at(t), align=4)
            return [b.fadd(acc[0], e)]

        def exps_tail(t: ll.Value, acc: list[ll.Value]) -> list[ll.Value]:
            d = b.fpext(b.fsub(b.load(at(t), typ=F32), top), F64)
            e = b.select(empty, F32(0.0), b.fptrunc(b.call(exp, [d]), F32))
            b.store(e, at(t))
            return [b.fadd(acc[0], e)]

        (lanes,) = carried(b, I64(0), body, 16, [zero], exps)
        (total,) = carried(b, body, s, 1, [combine_lanes(b, lanes, b.fadd)], exps_tail)
        total = b.select(nan, F32(float("nan")), b.select(empty, F32(0.0), total))  # (the rescale's fmaf)
        total = b.select(b.fcmp_ordered("==", total, F32(0.0)), F32(1.0), total)
        b.store(b.fdiv(F32(1.0), total), b.gep(inverse, [r], source_etype=F32))


def _mask_values(b: ll.IRBuilder, kind: int, base: ll.Value, stride: ll.Value, first: ll.Value) -> Callable:
    """mask(row, t, width): the values of a boolean mask as ATen makes them float (0 where true,
    -inf where false) or of a float one, at keys t.. (width 16 or 1) of row `first + row` (which
    starts at base + (first + row) * stride elements of its dtype; its keys contiguous)."""

    def mask(r: ll.Value, t: ll.Value, width: int) -> ll.Value:
        at = b.add(b.mul(b.add(first, r), stride), t)
        floats = LANES16 if width == 16 else F32
        if kind == 2:
            return b.load(b.gep(base, [at], source_etype=F32), typ=floats, align=4)
        bytes_ = ll.VectorType(ll.IntType(8), 16) if width == 16 else ll.IntType(8)
        flags = b.load(b.gep(base, [at], source_etype=ll.IntType(8)), typ=bytes_, align=1)
        keep = b.icmp_unsigned("!=", flags, ll.Constant(bytes_, [0] * 16 if width == 16 else 0))
        value = lambda v: ll.Constant(floats, [v] * 16 if width == 16 else v)  # noqa: E731
        return b.select(keep, value(0.0), value(float("-inf")))

    return mask


def _masking(b: ll.IRBuilder, kind: int, base: ll.Value, stride: ll.Value, first: ll.Value) -> Callable:
    """mask(row, t, z, lanes): z where there is no mask (kind 0); z where a boolean mask is true,
    -inf where false (kind 1); z plus a float mask (kind 2). The mask's row `first + row` starts at
    base + (first + row) * stride (elements of its dtype), its keys contiguous."""
    i8s = ll.VectorType(ll.IntType(8), 16)

    def mask(r: ll.Value, t: ll.Value, z: ll.Value, lanes: ll.Value) -> ll.Value:
        if kind == 0:
            return z
        at = b.add(b.mul(b.add(first, r), stride), t)
        if kind == 2:
            return b.fadd(z, masked_load(b, b.gep(base, [at], source_etype=F32), lanes))
        load = declared(b.module, "llvm.masked.load.v16i8.p0", i8s, [PTR, I32, ll.VectorType(I1, 16), i8s])
        flags = b.call(load, [b.gep(base, [at], source_etype=ll.IntType(8)), I32(1), lanes, ll.Constant(i8s, [0] * 16)])
        keep = b.icmp_unsigned("!=", flags, ll.Constant(i8s, [0] * 16))
        return b.select(keep, z, ll.Constant(LANES16, [float("-inf")] * 16))

    return mask


def _head(module: ll.Module, kind: int, kernels: dict[int, ll.Function], exact: bool) -> ll.Function:
    """(q, ldq, k, ldk, v, ldv, out, ldo, mask, ldm, first, end, S, d, scale, causal, packed,
    scores): queries [first, end) of one (batch, head), its keys packed already. Causal: query i
    sees keys 0..i (PyTorch's is_causal, aligned at the top left). Mask `kind`: none, a boolean
    or an additive float one (rows ldm apart, see _masking). `exact`: ATen's flash attention's
    softmax (_softmax_rows_exact) and its product by v in MKL's order (gemmkernel's kernel), for
    one block of keys (lowering/attention.py checks); causal, the scores of the keys after a
    row's query -inf (ATen's block of keys is all of them)."""
    args = [PTR, I64] * 5 + [I64] * 4 + [F32, I64, PTR, PTR]
    f = ll.Function(module, ll.FunctionType(VOID, args), f"{NAME}_head{kind}")
    f.linkage = "internal"
    q, ldq, k, ldk, v, ldv, out, ldo, mask, ldm, first, end, s, d, scale, causal, packed, scores = f.args
    b = ll.IRBuilder(f.append_basic_block("entry"))
    at = lambda p, i: b.gep(p, [i], source_etype=F32)  # noqa: E731
    spad = b.mul(b.sdiv(b.add(s, I64(NR - 1)), I64(NR)), I64(NR))
    inverse = b.alloca(F32, size=I64(MR))
    causal = b.icmp_signed("!=", causal, I64(0))
    with counted_loop(b, first, end, MR) as i:
        height = smaller(b, b.sub(end, i), I64(MR))
        # the keys this block's queries see: all, or (causal) up to its last query; exact, all
        # (ATen's block of keys is all of them: those after a row's query are -inf there)
        limit = s if exact else b.select(causal, smaller(b, s, b.add(i, height)), s)

        def block(args: list[ll.Value]) -> None:
            null = ll.Constant(PTR, None)
            args = [*args, null, I64(0), null, I64(0), null]  # the sums alone, from 0, nothing prefetched
            for mr in range(1, MR + 1):
                with b.if_then(b.icmp_signed("==", height, I64(mr))):
                    if mr in kernels:
                        b.call(kernels[mr], args)
                    else:  # the first 6 rows, then the rest (x's and out's rows 6 on)
                        b.call(kernels[6], args)
                        x, ldx, out, ldo = args[0], args[1], args[5], args[6]
                        rest = [at(x, b.mul(ldx, I64(6))), *args[1:5], at(out, b.mul(ldo, I64(6))), *args[6:]]
                        b.call(kernels[mr - 6], rest)

        with counted_loop(b, I64(0), b.sdiv(b.add(limit, I64(NR - 1)), I64(NR))) as p:
            col = b.mul(p, I64(NR))
            keys = at(packed, b.mul(col, d))
            block([at(q, b.mul(i, ldq)), ldq, keys, I64(NR), d, at(scores, col), spad, b.sub(limit, col)])
        rows = at(out, b.mul(i, ldo))
        if exact:  # sgemm_(N, N) of v by the weights, as ATen calls it: K in MKL's blocks
            with b.if_then(causal), counted_loop(b, I64(0), height) as r:
                row = at(scores, b.mul(r, spad))
                with counted_loop(b, b.add(b.add(i, r), I64(1)), s) as c:
                    b.store(F32(float("-inf")), at(row, c))
            values = _mask_values(b, kind, mask, ldm, i) if kind else None
            _softmax_rows_exact(b, scores, height, s, spad, scale, inverse, values)
            product = declared(module, gemmkernel.NAME, VOID, gemmkernel.ARGS)
            null = ll.Constant(PTR, None)
            b.call(product, [scores, spad, v, ldv, rows, ldo, null, I64(0), d, s, I64(0), height, I64(0)])
        else:
            row_limit = lambda r: b.select(causal, smaller(b, s, b.add(b.add(i, r), I64(1))), s)  # noqa: E731
            masking = _masking(b, kind, mask, ldm, i)
            _softmax_rows(b, scores, height, row_limit, limit, spad, scale, masking, inverse)
            with counted_loop(b, I64(0), b.sdiv(d, I64(NR))) as p:
                col = b.mul(p, I64(NR))
                block([scores, spad, at(v, col), ldv, limit, at(rows, col), ldo, I64(NR)])
        with counted_loop(b, I64(0), height) as r:
            factor = splat(b, b.load(b.gep(inverse, [r], source_etype=F32), typ=F32), 16)
            row = at(rows, b.mul(r, ldo))
            with counted_loop(b, I64(0), d, 16) as c:
                mask = lanes_below(b, b.sub(d, c))
                masked_store(b, b.fmul(masked_load(b, at(row, c), mask), factor), at(row, c), mask)
    b.ret_void()
    return f


def _entry(module: ll.Module, kind: int, exact: bool = False) -> None:
    """NAMES[kind]: the kernel for one kind of mask (each is built when first needed); with
    `exact`, EXACT_NAMES[kind], on gemmkernel's block kernels of up to 6 rows (already built for
    its product by v: building 12-row ones of its own took 250 of its 300 ms)."""
    if exact:
        blocks = {mr: declared(module, f"{gemmkernel.BLOCKS}_{mr}", VOID, gemmkernel.BLOCK_ARGS) for mr in range(1, 7)}
    else:
        blocks = {mr: block_kernel(module, NAME, mr) for mr in HEIGHTS}
    head = _head(module, kind, blocks, exact)
    malloc = declared(module, "malloc", PTR, [I64])
    free = declared(module, "free", VOID, [PTR])
    f = ll.Function(module, ll.FunctionType(VOID, ARGS), (EXACT_NAMES if exact else NAMES)[kind])
    q, k, v, out, mask, heads, group, t_, s, d, *strides, scale, causal, lo, hi, error = f.args
    b = ll.IRBuilder(f.append_basic_block("entry"))
    spad = b.mul(b.sdiv(b.add(s, I64(NR - 1)), I64(NR)), I64(NR))
    scratch = b.call(malloc, [b.mul(b.mul(spad, b.add(d, I64(MR))), I64(4))])
    with b.if_then(b.icmp_unsigned("==", scratch, ll.Constant(PTR, None))):
        b.atomic_rmw("or", error, I64(OUT_OF_MEMORY), "monotonic")
        b.ret_void()
    scores = b.gep(scratch, [b.mul(spad, d)], source_etype=F32)
    rows = b.select(b.icmp_signed(">", t_, I64(1)), t_, I64(1))  # (T, or 1 where T is 0: no rows)
    # the pairs with rows in [lo, hi), each from its first row there to its last
    with pieces(b, lo, hi, rows) as (pair, _, first, end):
        batch, h = b.sdiv(pair, heads), b.srem(pair, heads)
        kv = b.sdiv(h, group)  # grouped heads: `group` query heads share a key and value head
        base = []
        for j, (p, head_) in enumerate(zip((q, k, v, out, mask), (h, kv, kv, h, h))):
            offset = b.add(b.mul(batch, strides[3 * j]), b.mul(head_, strides[3 * j + 1]))
            size = 1 if j == 4 and kind == 1 else 4  # a boolean mask's elements are bytes
            base.append(b.gep(p, [b.mul(offset, I64(size))], source_etype=ll.IntType(8)))
        args = [x for pair_ in zip(base, (strides[3 * j + 2] for j in range(5))) for x in pair_]
        _pack_keys(b, args[2], args[3], s, d, scratch)  # (once per pair and thread)
        b.call(head, [*args, first, end, s, d, scale, causal, scratch, scores])
    b.call(free, [scratch])
    b.ret_void()


def exact(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool = False,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """EXACT_NAMES' kernels on float32 [B, H, T, d] q and [B, H, S, d] k, v (rows contiguous),
    causal or not, with a boolean or float mask [B, H, T, S] (keys contiguous) or none, on one
    thread (probes)."""
    (batch, heads, queries, d), keys = q.shape, k.shape[2]
    out = torch.empty(batch, heads, queries, d)
    error = ctypes.c_int64(0)
    words = [ctypes.c_int64] * 20
    kernel = ctypes.CFUNCTYPE(None, *[ctypes.c_void_p] * 5, *words, ctypes.c_float, *words[:3], ctypes.c_void_p)
    strides = [s for t in (q, k, v, out) for s in t.stride()[:3]]
    strides += [0, 0, 0] if mask is None else list(mask.stride()[:3])
    sizes = (heads, 1, queries, keys, d)
    pointers = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), None if mask is None else mask.data_ptr())
    rows = (0, batch * heads * queries)
    name = EXACT_NAMES[0 if mask is None else 1 if mask.dtype == torch.bool else 2]
    kernel(library(name))(*pointers, *sizes, *strides, scale, int(causal), *rows, ctypes.addressof(error))
    if error.value:
        raise torch.OutOfMemoryError("attention's scratch memory")
    return out


def library(kernel: str) -> int:
    """The kernel's address (jit.kernel: built alone when first needed; EXACT after the GEMM
    kernel it calls)."""
    if kernel in EXACT_NAMES:
        gemmkernel.library(gemmkernel.NAME)
        return jit.kernel(kernel, lambda module: _entry(module, EXACT_NAMES.index(kernel), exact=True))
    return jit.kernel(kernel, lambda module: _entry(module, NAMES.index(kernel)))
