"""braze's own float32 GEMM, in the order of operations MKL's sgemm_ follows here, so it gives
eager's bits where it runs; built once per process into the JIT and probed against ATen before
use (`same`).

MKL's order (this wheel's MKL on this AMD CPU, docs/aten-bits.md): each output is its initial
value (the bias ATen copied in, or nothing where beta is 0) plus, block after block of K, a sum
that starts at 0 and adds x[i, k] * w[k, j] for k in order with one FMA each; blocks are 192
long (K up to 192: one block; K below 384: blocks of K // 2, the rest a block of its own).
MKL takes other paths for rows it hands a thread in a chunk of fewer than 4, for outputs of
fewer than 12 columns, and with K = 1 (where it keeps a product's -0), so programs use this
kernel only from MIN_ROWS rows per MKL thread, MIN_N columns and MIN_K up.

    braze_gemm_rows(x, ldx, w, ldw, c, ldc, init, ldi, N, K, lo, hi, chunk)
        rows lo..hi of c[M, N] (row stride ldc) = init + x[M, K] @ w[K, N], both operands with
        unit column stride; init: a bias row (ldi 0), c itself as ATen filled it (ldi = ldc), or
        null (beta 0: the sums alone); K in MKL's blocks (chunk 0) or in blocks of `chunk`
    braze_gemm_rows_nk(...)
        the same with linear's weight, w[N, K] (rows ldw apart): c = init + x @ w.T
    braze_gemm_rows_packed(...)
        the same with w packed by `pack` (ldw: packed_depth(K)): fast mode keeps linear's
        weight packed between calls (fast.GemmPack), where exact mode cannot see every change
    braze_gemm_rows_seeded(x, ldx, w, ldw, c, ldc, seed, 0, N, K, lo, hi, chunk)
    braze_gemm_rows_nk_seeded(...)
        c = x @ w (w [K, N]; nk: x @ w.T) with K in blocks of `chunk`, the first block's sums
        starting from the seed (null: 0), each later block's from 0 added to c: the order of
        oneDNN's 1 x 1 convolutions (docs/aten-bits.md), whose bias is the seed: a value per
        row (seed[row]) of an NCHW image's product, a row of columns (seed[col]) of a
        channels-last one's

Per block of K, 32 columns at a time: a [K, N] weight is read in place (the last, narrower
panel copied into a zero-padded one), a [N, K] one packed into a panel on the stack, 16 x 16
blocks loaded along K and transposed in registers (each thread packs the panels it computes:
exact mode keeps no weight between calls, so none can be stale), or in fast mode read from
the panels `pack` made once; whichever it is, what the next panel reads is prefetched while
this one's rows run. A block longer than KC (`chunk`: oneDNN's orders) packs its panel
on the heap; where the heap refuses it, each row's block is computed in pieces of KC packed on
the stack, each piece's sums the next one's seed: the same chain of FMAs, slower. Then one
register-blocked kernel of up to 6 rows x 32 columns per block of rows (a thread's rows in blocks
of as even heights as that allows): 12 AVX-512 accumulators, per k one broadcast of x per row and
two loads of the panel, two steps of k a turn of the loop in the blocks of 5 and 6 rows.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Iterator

import llvmlite.ir as ll
import torch

from . import jit
from .codegen import (
    F32,
    I32,
    I64,
    LANES16,
    PTR,
    VOID,
    counted_loop,
    declared,
    fma,
    lanes_below,
    masked_load,
    masked_store,
    smaller,
    splat,
)

NAME = "braze_gemm_rows"  # W [K, N]
NAME_NK = "braze_gemm_rows_nk"  # W [N, K]: linear's weight
NAME_PACKED = "braze_gemm_rows_packed"  # W as `pack` lays it out (fast mode's kept weights)
NAME_SEEDED = "braze_gemm_rows_seeded"  # W [K, N], sums from a value per row (oneDNN's order)
NAME_NK_SEEDED = "braze_gemm_rows_nk_seeded"  # W [N, K], sums from a row of columns
ARGS = [PTR, I64, PTR, I64, PTR, I64, PTR, I64, I64, I64, I64, I64, I64]
MR, NR = 6, 32  # rows per block kernel (12 accumulators), columns per panel
UNROLL = 2  # steps of K per turn of the loop of the block kernels of MR - 1 and MR rows
KC = 192  # MKL's block of K
MIN_ROWS = 16  # per MKL thread (MKL gives chunks of fewer than 4 rows to another kernel)
MIN_N = 16  # below 12 columns MKL takes another path
MIN_K = 2  # with K = 1 MKL's output is the product itself: -0 where the kernel's 0 + -0 gives +0
# Values the probes put first in an operand: NaN, infinities, -0, a denormal, a large one
SPECIAL = (float("nan"), float("inf"), -0.0, 1e-41, -float("inf"), 3e38)


def carried(
    b: ll.IRBuilder, lo: ll.Value, hi: ll.Value, step: int, init: list[ll.Value], body: Callable[..., list[ll.Value]]
) -> list[ll.Value]:
    """A counted loop over [lo, hi) by `step` whose values start as `init` and become
    body(i, values) each step; the values after it (init where it ran zero times)."""
    fn, pre = b.function, b.block
    loop, after = fn.append_basic_block("loop"), fn.append_basic_block("after")
    b.cbranch(b.icmp_signed("<", lo, hi), loop, after)
    b.position_at_end(loop)
    i = b.phi(I64)
    i.add_incoming(lo, pre)
    phis = []
    for v in init:
        phis.append(b.phi(v.type))
        phis[-1].add_incoming(v, pre)
    out = body(i, phis)
    nxt = b.add(i, I64(step))
    end = b.block
    i.add_incoming(nxt, end)
    for phi, v in zip(phis, out):
        phi.add_incoming(v, end)
    b.cbranch(b.icmp_signed("<", nxt, hi), loop, after)
    b.position_at_end(after)
    final = []
    for v, o in zip(init, out):
        final.append(b.phi(v.type))
        final[-1].add_incoming(v, pre)
        final[-1].add_incoming(o, end)
    return final


BLOCK_ARGS = [PTR, I64, PTR, I64, I64, PTR, I64, I64, PTR, I64, PTR, I64, PTR]
BLOCKS = "braze_gemm_block"  # the block kernels the GEMM kernels share: braze_gemm_block_{mr}


def block_kernel(module: ll.Module, prefix: str, mr: int, exported: bool = False, unroll: int = 1) -> ll.Function:
    """(x, lda, panel, ldp, K, out, ldo, ncols, init, ldi, seed, per_row, ahead): out[r, :ncols] =
    init[r ldi : +ncols] + sum_k x[r, k] panel[k ldp : +32] for r < mr, the sum one FMA chain in
    the order of k from the seed: seed[r] (per_row), seed[:ncols] (each row), 0 (seed null);
    init null: the sum alone. ncols <= 32; the panel's 32 columns are read whole. Where `ahead`
    is not null, each step also prefetches into L2 the two lines at ahead + k ldp (the next
    panel a driver reads: its weight streams from memory while this one is computed). `unroll`
    steps of k a turn of the loop (6 rows by a panel, one thread, K 256 / 1024, interleaved: 1
    step 154 / 139 GFLOP/s, 2 steps 164 / 152; the real kernel with 4 spilled the loads LLVM
    hoisted)."""
    f = ll.Function(module, ll.FunctionType(VOID, BLOCK_ARGS), f"{prefix}_{mr}")
    f.linkage = "external" if exported else "internal"
    f.attributes.add("noinline")  # six inlined copies took the optimiser 4x as long
    x, lda, panel, ldp, k, out, ldo, ncols, init, ldi, seed, per_row, ahead = f.args
    b = ll.IRBuilder(f.append_basic_block("entry"))
    at = lambda p, i: b.gep(p, [i], source_etype=F32)  # noqa: E731
    rows = [at(x, b.mul(lda, I64(r))) for r in range(mr)]
    masks = [lanes_below(b, b.sub(ncols, I64(16 * h))) for h in range(2)]
    # The accumulators' start: 0, or the seed, read only as its form says (a row's value, or the
    # row of columns: read as the other, either could run past the seed's end)
    zero, pre = ll.Constant(LANES16, [0.0] * 16), b.block
    with b.if_then(b.icmp_unsigned("!=", seed, ll.Constant(PTR, None))):
        with b.if_else(b.icmp_signed("!=", per_row, I64(0))) as (rows_, columns_):
            with rows_:
                own = [splat(b, b.load(at(seed, I64(r)), typ=F32), 16) for r in range(mr)]
                from_rows = b.block
            with columns_:
                lanes = [masked_load(b, at(seed, I64(16 * h)), masks[h]) for h in range(2)]
                from_columns = b.block
        seeds = []
        for i in range(2 * mr):
            seeds.append(b.phi(LANES16))
            seeds[-1].add_incoming(own[i // 2], from_rows)
            seeds[-1].add_incoming(lanes[i % 2], from_columns)
        seeded = b.block
    first = []
    for v in seeds:
        first.append(b.phi(LANES16))
        first[-1].add_incoming(zero, pre)
        first[-1].add_incoming(v, seeded)

    prefetch = declared(module, "llvm.prefetch.p0", VOID, [PTR, I32, I32, I32])

    def steps(k0: ll.Value, acc: list[ll.Value], fetching: bool, count: int) -> list[ll.Value]:
        acc = list(acc)
        for s in range(count):
            kk = b.add(k0, I64(s))
            base = b.mul(kk, ldp)
            for h in range(2 * fetching):  # (read, L2, data)
                b.call(prefetch, [at(ahead, b.add(base, I64(16 * h))), I32(0), I32(2), I32(1)])
            w = [b.load(at(panel, b.add(base, I64(16 * h))), typ=LANES16, align=4) for h in range(2)]
            for r in range(mr):
                a = splat(b, b.load(at(rows[r], kk), typ=F32), 16)
                for h in range(2):
                    acc[2 * r + h] = fma(b, a, w[h], acc[2 * r + h])
        return acc

    # UNROLL steps a turn of the loop, the rest one a turn (the same FMAs in the same order)
    whole = b.mul(b.sdiv(k, I64(unroll)), I64(unroll))
    ends = []
    with b.if_else(b.icmp_unsigned("==", ahead, ll.Constant(PTR, None))) as (plain, fetching):
        for branch, fetch in ((plain, False), (fetching, True)):
            with branch:
                acc = carried(b, I64(0), whole, unroll, first, functools.partial(steps, fetching=fetch, count=unroll))
                acc = carried(b, whole, k, 1, acc, functools.partial(steps, fetching=fetch, count=1))
                ends.append((acc, b.block))
    acc = []
    for i in range(2 * mr):
        acc.append(b.phi(LANES16))
        for values, block in ends:
            acc[-1].add_incoming(values[i], block)
    with b.if_else(b.icmp_unsigned("==", init, ll.Constant(PTR, None))) as (alone, added):
        with alone:
            for r in range(mr):
                row = at(out, b.mul(ldo, I64(r)))
                for h in range(2):
                    masked_store(b, acc[2 * r + h], at(row, I64(16 * h)), masks[h])
        with added:  # out may be init itself: each vector read before it is written
            for r in range(mr):
                row, first = at(out, b.mul(ldo, I64(r))), at(init, b.mul(ldi, I64(r)))
                for h in range(2):
                    start = masked_load(b, at(first, I64(16 * h)), masks[h])
                    masked_store(b, b.fadd(start, acc[2 * r + h]), at(row, I64(16 * h)), masks[h])
    b.ret_void()
    return f


def _transposed(b: ll.IRBuilder, rows: list[ll.Value]) -> list[ll.Value]:
    """The 16 x 16 transpose of 16 vectors: the off-diagonal blocks of 8, 4, 2 and 1 swapped."""
    rows = list(rows)
    for s in (8, 4, 2, 1):
        low = ll.Constant(ll.VectorType(I32, 16), [j if j & s == 0 else 16 + j - s for j in range(16)])
        high = ll.Constant(ll.VectorType(I32, 16), [j + s if j & s == 0 else 16 + j for j in range(16)])
        for r in range(16):
            if r & s == 0:
                a, c = rows[r], rows[r + s]
                rows[r], rows[r + s] = b.shuffle_vector(a, c, low), b.shuffle_vector(a, c, high)
    return rows


def _panel_kn(
    b: ll.IRBuilder,
    w: ll.Value,
    ldw: ll.Value,
    k0: ll.Value,
    j0: ll.Value,
    depth: ll.Value,
    ncols: ll.Value,
    buf: ll.Value,
) -> tuple[ll.Value, ll.Value]:
    """W [K, N] (rows ldw apart): the panel read in place where it has 32 columns, else copied
    into `buf` zero-padded. (panel, its row stride)."""
    source = b.gep(w, [b.add(b.mul(k0, ldw), j0)], source_etype=F32)
    whole = b.icmp_signed("==", ncols, I64(NR))
    with b.if_then(b.not_(whole)):
        masks = [lanes_below(b, b.sub(ncols, I64(16 * h))) for h in range(2)]
        with counted_loop(b, I64(0), depth) as kk:
            for h in range(2):
                at = b.gep(source, [b.add(b.mul(kk, ldw), I64(16 * h))], source_etype=F32)
                b.store(
                    masked_load(b, at, masks[h]), b.gep(buf, [b.add(b.mul(kk, I64(2)), I64(h))], source_etype=LANES16)
                )
    return b.select(whole, source, buf), b.select(whole, ldw, I64(NR))


def _panel_nk(
    b: ll.IRBuilder,
    w: ll.Value,
    ldw: ll.Value,
    k0: ll.Value,
    j0: ll.Value,
    depth: ll.Value,
    ncols: ll.Value,
    buf: ll.Value,
) -> tuple[ll.Value, ll.Value]:
    """W [N, K] (linear's weight, rows ldw apart): the panel packed into `buf`, 16 x 16 blocks
    loaded along K and transposed in registers (columns past N are zeros)."""
    with counted_loop(b, I64(0), depth, 16) as kk:
        lanes = lanes_below(b, b.sub(depth, kk))
        with counted_loop(b, I64(0), I64(2)) as h:  # (a loop, not unrolled: half the code to compile)
            rows = []
            for r in range(16):
                j = b.add(b.mul(h, I64(16)), I64(r))
                mask = b.and_(lanes, splat(b, b.icmp_signed(">", ncols, j), 16))
                at = b.gep(w, [b.add(b.mul(b.add(j0, j), ldw), b.add(k0, kk))], source_etype=F32)
                rows.append(masked_load(b, at, mask))
            for q, v in enumerate(_transposed(b, rows)):
                b.store(v, b.gep(buf, [b.add(b.mul(b.add(kk, I64(q)), I64(2)), h)], source_etype=LANES16))
    return buf, I64(NR)


def packed_depth(k: int) -> int:
    """The rows of each panel `pack` lays out: K rounded up to the 16 x 16 steps of _panel_nk."""
    return -(-k // 16) * 16


def packed_numel(n: int, k: int) -> int:
    return -(-n // NR) * NR * packed_depth(k)


def pack(w: torch.Tensor, out: torch.Tensor) -> None:
    """Linear's weight w [N, K] (or a stack of them, [..., N, K], one after another) into `out`
    (packed_numel floats each) as _panel_nk packs a panel per call: 32-column panels one after
    another, each packed_depth(K) rows of 32, zero-padded."""
    *lead, n, k = w.shape
    rows, kp = -(-n // NR) * NR, packed_depth(k)
    if (rows, kp) != (n, k):
        w = torch.nn.functional.pad(w, (0, kp - k, 0, rows - n))
    out.view(*lead, rows // NR, kp, NR).copy_(w.reshape(*lead, rows // NR, NR, kp).transpose(-1, -2))


def _panel_plain(
    b: ll.IRBuilder,
    w: ll.Value,
    ldw: ll.Value,
    k0: ll.Value,
    j0: ll.Value,
    depth: ll.Value,
    ncols: ll.Value,
    buf: ll.Value,
    by_rows: bool,
) -> tuple[ll.Value, ll.Value]:
    """The panel of W [K, N] (`by_rows`) or [N, K] copied into `buf` a value at a time, zeros past
    N: for the path where the heap refuses a long panel (slow, and little code: a second copy
    of _panel_nk and _panel_kn made the drivers' builds take 15-40 ms longer)."""
    floats = b.bitcast(buf, F32.as_pointer())  # (the stack's panel is typed as vectors)
    with counted_loop(b, I64(0), depth) as kk:
        with counted_loop(b, I64(0), I64(NR)) as jj:
            inside = b.icmp_signed("<", jj, ncols)
            k, j = b.add(k0, kk), b.add(j0, b.select(inside, jj, I64(0)))
            at = b.add(b.mul(k, ldw), j) if by_rows else b.add(b.mul(j, ldw), k)
            value = b.select(inside, b.load(b.gep(w, [at], source_etype=F32), typ=F32), F32(0.0))
            b.store(value, b.gep(floats, [b.add(b.mul(kk, I64(NR)), jj)], source_etype=F32))
    return buf, I64(NR)


def _panel_packed(
    b: ll.IRBuilder,
    w: ll.Value,
    ldw: ll.Value,
    k0: ll.Value,
    j0: ll.Value,
    depth: ll.Value,
    ncols: ll.Value,
    buf: ll.Value,
) -> tuple[ll.Value, ll.Value]:
    """W packed by `pack` (ldw: each panel's rows): the panel read in place."""
    return b.gep(w, [b.add(b.mul(j0, ldw), b.mul(k0, I64(NR)))], source_etype=F32), I64(NR)


def _rows(module: ll.Module, name: str, panel_of: Callable, seeded: bool) -> None:
    """The driver `name`, and the path it takes where the heap refuses a long block's panel."""
    _driver(module, name, panel_of, seeded, _driver(module, f"{name}_pieces", panel_of, seeded, None))


def _driver(module: ll.Module, name: str, panel_of: Callable, seeded: bool, pieces: ll.Function | None) -> ll.Function:
    """With `pieces`: the driver, which packs a block longer than KC on the heap and calls
    `pieces` where the heap refuses. None: that path, each row's block in pieces of KC packed on
    the stack, each piece's sums carried into the next as its seed (a row of columns): the same
    chain of FMAs, so the same bits, slower (internal, and not optimised: it has to work, not to
    be fast, and the drivers' builds took 10-40 ms longer with it optimised)."""
    kernels = {mr: declared(module, f"{BLOCKS}_{mr}", VOID, BLOCK_ARGS) for mr in range(1, MR + 1)}
    f = ll.Function(module, ll.FunctionType(VOID, ARGS), name)
    if pieces is None:
        f.linkage = "internal"
        f.attributes.add("noinline")
        f.attributes.add("optnone")
    x, ldx, w, ldw, c, ldc, init, ldi, n, k, lo, hi, chunk = f.args
    b = ll.IRBuilder(f.append_basic_block("entry"))
    at = lambda p, i: b.gep(p, [i], source_etype=F32)  # noqa: E731
    null = ll.Constant(PTR, None)
    with b.goto_entry_block():  # a packed panel (16 rows of room past the block, for 16 x 16 steps)
        stack = b.alloca(LANES16, size=I64((KC + 16) * NR // 16))
    mkl = b.select(b.icmp_signed("<=", k, I64(KC)), k, smaller(b, I64(KC), b.sdiv(k, I64(2))))
    kc = b.select(b.icmp_signed(">", chunk, I64(0)), chunk, mkl)
    per_row = panel_of is _panel_kn  # [K, N]: an NCHW image's product, whose rows are channels

    def ends(i: ll.Value, j0: ll.Value, first: ll.Value, out: ll.Value) -> list[ll.Value]:
        """The block kernel's (init, ldi, seed, per_row) for the block of rows from i: the first
        block's sums from the seed (or 0) onto the initial values, later blocks' added to c."""
        if seeded:
            seed = b.select(b.icmp_unsigned("==", init, null), init, at(init, i if per_row else j0))
            return [b.select(first, null, out), ldc, b.select(first, seed, null), I64(int(per_row))]
        start = b.select(b.icmp_unsigned("==", init, null), init, at(init, b.add(b.mul(i, ldi), j0)))
        return [b.select(first, start, out), b.select(first, ldi, ldc), null, I64(0)]

    def blocks() -> Iterator[tuple[ll.Value, ll.Value, ll.Value, ll.Value, ll.Value]]:
        """For each block of K and panel of 32 columns: (k0, depth, j0, ncols, whether the first block)."""
        with counted_loop(b, I64(0), b.sdiv(b.add(k, b.sub(kc, I64(1))), kc)) as p:
            k0 = b.mul(p, kc)
            with counted_loop(b, I64(0), n, NR) as j0:
                first = b.icmp_signed("==", p, I64(0))
                yield k0, smaller(b, b.sub(k, k0), kc), j0, smaller(b, b.sub(n, j0), I64(NR)), first

    if pieces is None:
        with b.goto_entry_block():
            partial = b.alloca(LANES16, size=I64(NR // 16))  # a row's sums between the pieces
        by_rows = panel_of is _panel_kn
        plain = functools.partial(_panel_plain, by_rows=by_rows) if panel_of in (_panel_kn, _panel_nk) else panel_of
        for k0, depth, j0, ncols, first in blocks():
            with counted_loop(b, lo, hi) as i:
                out = at(c, b.add(b.mul(i, ldc), j0))
                start, ld, seed, seeds_rows = ends(i, j0, first, out)
                with counted_loop(b, I64(0), depth, KC) as q:
                    s0, part = b.add(k0, q), smaller(b, b.sub(depth, q), I64(KC))
                    firstq, lastq = b.icmp_signed("==", q, I64(0)), b.icmp_signed(">=", b.add(q, I64(KC)), depth)
                    panel, ldp = plain(b, w, ldw, s0, j0, part, ncols, stack)
                    chain = [b.select(firstq, seed, partial), b.select(firstq, seeds_rows, I64(0))]
                    args = [at(x, b.add(b.mul(i, ldx), s0)), ldx, panel, ldp, part, b.select(lastq, out, partial)]
                    b.call(kernels[1], [*args, ldc, ncols, b.select(lastq, start, null), ld, *chain, null])
        b.ret_void()
        return f
    packed = panel_of is _panel_packed  # (panels read in place: no block needs room of its own)
    # a longer block's panel on the heap (aligned as vectors)
    long = ll.Constant(ll.IntType(1), 0) if packed else b.icmp_signed(">", kc, I64(KC))
    pre = b.block
    with b.if_then(long):
        heap = b.call(
            declared(module, "aligned_alloc", PTR, [I64, I64]), [I64(64), b.mul(b.add(kc, I64(16)), I64(NR * 4))]
        )
        with b.if_then(b.icmp_unsigned("==", heap, null)):
            b.call(pieces, f.args)
            b.ret_void()
        allocated = b.block
    buf = b.phi(PTR)
    buf.add_incoming(stack, pre)
    buf.add_incoming(heap, allocated)
    for k0, depth, j0, ncols, first in blocks():
        panel, ldp = panel_of(b, w, ldw, k0, j0, depth, ncols, buf)
        in_place = panel_of is _panel_kn  # (a [K, N] weight's panel read where it is)
        following = _following(b, w, ldw, k, n, kc, k0, j0, packed) if packed or in_place else null
        nk_next = _next_panel(b, k, n, kc, k0, j0) if panel_of is _panel_nk else None
        # rows lo..hi in blocks of as even heights as MR allows (64 rows: 11 blocks of 5 and 6,
        # not 10 of 6 and one of 4; one row's block is latency-bound, 4 cycles a step)
        rows = b.sub(hi, lo)
        count = b.sdiv(b.add(rows, I64(MR - 1)), I64(MR))
        with counted_loop(b, I64(0), count) as q:
            i = b.add(lo, b.sdiv(b.mul(q, rows), count))
            height = b.sub(b.add(lo, b.sdiv(b.mul(b.add(q, I64(1)), rows), count)), i)
            out = at(c, b.add(b.mul(i, ldc), j0))
            args = [at(x, b.add(b.mul(i, ldx), k0)), ldx, panel, ldp, depth, out, ldc, ncols, *ends(i, j0, first, out)]
            args.append(b.select(b.icmp_signed("==", q, I64(0)), following, null))  # (the first rows prefetch it)
            if nk_next is not None:
                _prefetch_rows(b, w, ldw, n, nk_next, q, count)
            for mr in range(1, MR + 1):
                with b.if_then(b.icmp_signed("==", height, I64(mr))):
                    b.call(kernels[mr], args)
    with b.if_then(long):
        b.call(declared(module, "free", VOID, [PTR]), [buf])
    b.ret_void()
    return f


def _next_panel(
    b: ll.IRBuilder, k: ll.Value, n: ll.Value, kc: ll.Value, k0: ll.Value, j0: ll.Value
) -> tuple[ll.Value, ll.Value, ll.Value]:
    """(k1, j1, depth) of the panel after (k0, j0): the next 32 columns of this block of K, or the
    next block's first (depth 0 after the last)."""
    nxt = b.add(j0, I64(NR))
    wrap = b.icmp_signed(">=", nxt, n)
    k1, j1 = b.select(wrap, b.add(k0, kc), k0), b.select(wrap, I64(0), nxt)
    return k1, j1, b.select(b.icmp_signed("<", k1, k), smaller(b, b.sub(k, k1), kc), I64(0))


def _prefetch_rows(
    b: ll.IRBuilder,
    w: ll.Value,
    ldw: ll.Value,
    n: ll.Value,
    panel: tuple[ll.Value, ll.Value, ll.Value],
    q: ll.Value,
    count: ll.Value,
) -> None:
    """Before the q-th of `count` blocks of rows, prefetch into L2 its share of the rows of W
    [N, K] the next panel packs (`panel`: _next_panel's), 16 floats a line: each block of
    rows a few of its 32 rows, so that the reads spread over the panel's work. (Linear's
    weights stream through the cache as the model runs, and the 32 rows a panel packs are
    32 streams, more than the hardware's prefetchers follow: the kernel alone on 128 rows
    by cold [768, 768] and [1024, 256] weights ran 16-19% slower than by warm ones, 10-14%
    faster with this; in exact mode BERT, DistilBERT, Llama and the T5 encoder 1.10-1.16x
    as fast, the HF ViT 1.07-1.09x, bert-tiny, whose weights stay in L2, 1.02x.)"""
    k1, j1, depth = panel
    prefetch = declared(b.module, "llvm.prefetch.p0", VOID, [PTR, I32, I32, I32])
    first, last = (b.sdiv(b.mul(v, I64(NR)), count) for v in (q, b.add(q, I64(1))))
    with counted_loop(b, first, smaller(b, last, b.sub(n, j1))) as r:
        row = b.gep(w, [b.add(b.mul(b.add(j1, r), ldw), k1)], source_etype=F32)
        with counted_loop(b, I64(0), depth, 16) as c:  # (read, L2, data)
            b.call(prefetch, [b.gep(row, [c], source_etype=F32), I32(0), I32(2), I32(1)])


def _following(
    b: ll.IRBuilder,
    w: ll.Value,
    ldw: ll.Value,
    k: ll.Value,
    n: ll.Value,
    kc: ll.Value,
    k0: ll.Value,
    j0: ll.Value,
    packed: bool,
) -> ll.Value:
    """Where the panel a driver reads after (k0, j0) starts, packed or (W [K, N]) in place: the
    next 32 columns of this block of K, or the next block's first; null after the last. (A
    model's weights stream through the cache, one panel after another, and the first rows'
    steps prefetch the next one: 49 rows by a packed 4608 x 512 weight read from memory ran
    1.19 ms, 0.87 ms from L2. In place, a panel's rows lie a row of W apart (3 KB at 768
    columns), where the hardware's prefetchers, which stay within a page, do not follow: 128
    rows by weights of GPT-2's shapes, [256 or 768, 768 to 3072] from memory, one thread, ran
    8-15% faster; gpt2-tiny and GPT-2 in exact mode 1.03-1.09x as fast.)"""
    k1, j1, depth = _next_panel(b, k, n, kc, k0, j0)
    null = ll.Constant(PTR, None)
    if packed:
        start, _ = _panel_packed(b, w, ldw, k1, j1, kc, I64(NR), null)
    else:
        start = b.gep(w, [b.add(b.mul(k1, ldw), j1)], source_etype=F32)
    return b.select(b.icmp_signed(">", depth, I64(0)), start, null)


# name: (how a panel is made, whether the sums start from a seed)
_BUILDERS = {
    NAME: (_panel_kn, False),
    NAME_NK: (_panel_nk, False),
    NAME_PACKED: (_panel_packed, False),
    NAME_SEEDED: (_panel_kn, True),
    NAME_NK_SEEDED: (_panel_nk, True),
}


def library(kernel: str) -> int:
    """The kernel's address (jit.kernel: built alone when first needed, on the block kernels,
    built once for all of them: they are most of the compile time; light: their code is vector
    code already, and runs as fast without -O2's passes)."""
    blocks = tuple(f"{BLOCKS}_{mr}" for mr in range(1, MR + 1))
    jit.kernel(
        blocks[0],
        lambda module: [
            block_kernel(module, BLOCKS, mr, True, UNROLL if mr >= MR - 1 else 1) for mr in range(1, MR + 1)
        ],
        blocks,
        light=True,
    )
    return jit.kernel(kernel, lambda module: _rows(module, kernel, *_BUILDERS[kernel]), light=True)


def gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    linear: bool = False,
    packed: bool = False,
    chunk: int = 0,
    seeded: bool = False,
) -> torch.Tensor:
    """The native kernel, on one thread (for the probes): x [M, K] @ w [K, N] (+ bias [N]), or
    with `linear` x @ w.T of w [N, K] (`packed`: read from `pack`'s panels of it); K in blocks of
    `chunk` (0: MKL's); `seeded`: the sums start from the bias, a value per row of [M] for w
    [K, N], a row [N] for linear's. x and w with unit column stride."""
    (m, k), n = x.shape, w.shape[0 if linear else 1]
    c = torch.empty(m, n)
    name = NAME_PACKED if packed else NAME_NK if linear else NAME
    address = library((NAME_NK_SEEDED if linear else NAME_SEEDED) if seeded else name)
    kernel = ctypes.CFUNCTYPE(None, *[ctypes.c_void_p, ctypes.c_int64] * 4, *[ctypes.c_int64] * 5)(address)
    init = (bias.data_ptr(), 0) if bias is not None else (None, 0)
    ldw = w.stride(0)
    if packed:
        panels = torch.empty(packed_numel(n, k))
        pack(w, panels)
        w, ldw = panels, packed_depth(k)
    kernel(x.data_ptr(), x.stride(0), w.data_ptr(), ldw, c.data_ptr(), n, *init, n, k, 0, m, chunk)
    return c


def order_of(
    eager: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, linear: bool
) -> tuple[bool, int] | None:
    """(seeded, chunk): how `eager`, oneDNN's 1 x 1 convolution as the product of x [M, K] and w
    [K, N] (an NCHW image's: weight by pixels, bias a value per row) or w [N, K] (`linear`:
    channels-last pixels by the weight, bias a row), is the kernel's result (gemm); None where
    no order gives its bits. Its brgemm kernels add K in blocks (all of it, MKL's, 256, or
    others by their heuristics, per shape and thread count), the first from the bias or the
    bias added: each candidate is tried on the first rows and columns, the one that fits then
    on the whole product."""
    k = x.shape[1]
    rows, cols = min(x.shape[0], MR), min(w.shape[0 if linear else 1], NR)
    tile = x[:rows], w[:cols] if linear else w[:, :cols]
    mkl = k if k <= KC else k // 2 if k < 2 * KC else KC
    kinds = [True] if bias is None or not linear else [False, True]  # (a value per row is only a seed)
    for chunk in dict.fromkeys([k, mkl, *range(16 * (k // 16), 0, -16)]):
        for seeded in kinds:
            part = None if bias is None else bias[:rows] if seeded and not linear else bias[:cols]
            got = gemm(*tile, part, linear, chunk=chunk, seeded=seeded)
            if not jit.same_bits(got, eager[:rows, :cols], nan_payloads=False):
                continue
            if jit.same_bits(gemm(x, w, bias, linear, chunk=chunk, seeded=seeded), eager, nan_payloads=False):
                return seeded, chunk
    return None


def same(shapes: tuple[tuple[int, int, int], ...], linear: bool = False) -> bool:
    """Whether the kernel (`linear`: the one for a [N, K] weight) gives ATen's bits here, with
    the bias and without: on rows of random values and of special values (NaN, infinities,
    signed zeros, denormals) at K around each boundary of MKL's blocks, and at each (M, K, N) of
    `shapes` (a program's own GEMMs). Once per process, thread count and shape."""
    threads = jit.mkl_threads()  # what MKL's split, so its bits, depend on (the entry checks it)
    return _same((), linear, threads) and all(_same((s,), linear, threads) for s in sorted(set(shapes)))


@functools.cache
def _same(shapes: tuple[tuple[int, int, int], ...], linear: bool, threads: int) -> bool:  # threads: in the key
    gen = torch.Generator().manual_seed(0)
    if not shapes:
        shapes = tuple((MIN_ROWS * threads + extra, k, n) for extra, k, n in _PROBE)
    for m, k, n in shapes:
        x, w = _varied(m, k, gen), _varied(n, k, gen) * 0.1  # w: [N, K], read along K
        bias = torch.randn(n, generator=gen)
        x[0, : min(k, len(SPECIAL))] = torch.tensor(SPECIAL[: min(k, len(SPECIAL))])
        x[1] = -0.0
        if linear:
            eager = torch.nn.functional.linear(x, w, bias), torch.nn.functional.linear(x, w)
        else:
            w = w.t().contiguous()
            eager = torch.addmm(bias, x, w), x @ w
        ours = gemm(x, w, bias, linear), gemm(x, w, None, linear)
        if not all(jit.same_bits(a, e, nan_payloads=False) for a, e in zip(ours, eager)):
            return False
    return True


Layout = tuple[tuple[int, ...], tuple[int, ...]]  # a tensor's sizes and strides


def same_batched(b1: Layout, b2: Layout) -> bool:
    """Whether the kernel, matrix by matrix, gives torch.bmm's bits for operands of these layouts
    (b1's matrices row-major; b2's [K, N] row-major, or [N, K]'s transpose: the `linear` kernel):
    random values and special ones (as `same`) at the program's own sizes. Once per process,
    thread count and layouts."""
    return _same_batched(b1, b2, jit.mkl_threads())


@functools.cache
def _same_batched(b1: Layout, b2: Layout, threads: int) -> bool:  # threads: in the key
    gen = torch.Generator().manual_seed(0)
    (batch, m, k), n = b1[0], b2[0][2]
    x, w = torch.empty_strided(*b1), torch.empty_strided(*b2)
    x.copy_(_varied(batch * m, k, gen).view(batch, m, k))
    w.copy_(_varied(batch * k, n, gen).view(batch, k, n) * 0.1)
    x[0, 0, : min(k, len(SPECIAL))] = torch.tensor(SPECIAL[: min(k, len(SPECIAL))])
    x[0, 1] = -0.0
    linear = w.stride(1) == 1  # each matrix the transpose of a row-major [N, K]
    ours = torch.stack([gemm(x[i], w[i].t() if linear else w[i], None, linear) for i in range(batch)])
    return jit.same_bits(ours, torch.bmm(x, w), nan_payloads=False)


def _varied(rows: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Random [rows, k] whose rows repeat after PERIOD: each sum over K still meets random
    values in its own order, which is what a probe tells apart, and a program's large GEMMs
    (mlp-wide's 4096 x 1024 weight) cost no 4M draws from the generator (25 of its 76 ms)."""
    return torch.randn(min(rows, PERIOD), k, generator=gen).repeat(-(-rows // PERIOD), 1)[:rows]


PERIOD = 97  # (prime: no panel or block width divides it)

# (rows beyond the minimum, K, N): K across MKL's block boundaries, N across the 32-column panels
_PROBE = (
    (0, 2, 17),
    (1, 7, 32),
    (5, 33, 33),
    (17, 128, 64),
    (0, 192, 31),
    (3, 193, 40),
    (9, 383, 16),
    (0, 384, 65),
    (2, 385, 16),
    (40, 768, 96),
    (1, 1000, 33),
)
