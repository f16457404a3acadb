"""Fast mode's attention (mode="fast"): softmax(q k^T * scale + mask) v for each (batch, head),
causal or not, with a boolean or additive float mask or none, built once per process into the JIT:

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
"""

from __future__ import annotations

from collections.abc import Callable

import llvmlite.ir as ll

from . import jit
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
    gather,
    lanes_below,
    masked_load,
    masked_store,
    pieces,
    smaller,
    splat,
)
from .gemmkernel import block_kernel, carried

NAME = "braze_attention"
NAMES = [NAME, f"{NAME}_bool", f"{NAME}_float"]  # by kind of mask: none, boolean, additive float
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


def _head(module: ll.Module, kind: int, kernels: dict[int, ll.Function]) -> ll.Function:
    """(q, ldq, k, ldk, v, ldv, out, ldo, mask, ldm, first, end, S, d, scale, causal, packed,
    scores): queries [first, end) of one (batch, head), its keys packed already. Causal: query i
    sees keys 0..i (PyTorch's is_causal, aligned at the top left). Mask `kind`: none, a boolean
    or an additive float one (rows ldm apart, see _masking)."""
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
        # the keys this block's queries see: all, or (causal) up to its last query
        limit = b.select(causal, smaller(b, s, b.add(i, height)), s)

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
        row_limit = lambda r: b.select(causal, smaller(b, s, b.add(b.add(i, r), I64(1))), s)  # noqa: E731
        masking = _masking(b, kind, mask, ldm, i)
        _softmax_rows(b, scores, height, row_limit, limit, spad, scale, masking, inverse)
        rows = at(out, b.mul(i, ldo))
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


def _entry(module: ll.Module, kind: int) -> None:
    """NAMES[kind]: the kernel for one kind of mask (each is built when first needed)."""
    head = _head(module, kind, {mr: block_kernel(module, NAME, mr) for mr in HEIGHTS})
    malloc = declared(module, "malloc", PTR, [I64])
    free = declared(module, "free", VOID, [PTR])
    f = ll.Function(module, ll.FunctionType(VOID, ARGS), NAMES[kind])
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


def library(kernel: str) -> int:
    """The kernel's address (jit.kernel: built alone when first needed)."""
    return jit.kernel(kernel, lambda module: _entry(module, NAMES.index(kernel)))
