"""Row kernels: native functions over the rows of a tensor that reproduce ATen's float32 CPU
kernels bit for bit (layer_norm, softmax, log_softmax, sum, mean), built once per process into
the JIT and called by programs.

Their arithmetic follows ATen's as this wheel compiled it (../shared/notes/aten-bits.md): the
order of every operation, which products GCC fused into FMAs, the vector width of the kernel
ATen dispatches to (its layer_norm and sum exist only as AVX2 builds: 8 lanes; its softmax runs
the AVX512 build: 16). A probe compares each with ATen before any program uses it
(`layer_norm_same`, `softmax_same`, `sum_same`); a kernel that disagrees is never called and the
op stays an ATen call, saying why.

    braze_layer_norm_rows(x, weight, bias, y, n, lo, hi, eps)
        rows lo..hi of a contiguous [rows, n] x: y = (x - mean) * rstd * weight + bias, with
        mean and variance from ATen's RowwiseMoments (a Welford cascade), rstd = 1/sqrt(var+eps)
    braze_softmax_rows(x, y, n, lo, hi)
        ATen's AVX512 softmax over each row: its 16-lane max, Sleef's exp of x - max on every
        element, its 16-lane sum, then y = e * (1 / sum)
    braze_log_softmax_rows(x, y, n, lo, hi)
        the same max and sum, then y = (x - max) - Sleef's log of the sum
    braze_sum_rows(x, y, n, lo, hi, rows, mean)
        ATen's AVX2 cascade_sum of each row (four interleaved 8-lane cascades, the scalar tail,
        then the lanes in order), added to 0 as into ATen's zero-filled output; / n for a mean;
        one long row split between threads as ATen's two-pass reduction splits it

Fast mode's own (no probe: its accuracy is the contract's, tests/test_rms_norm.py):

    braze_rms_norm_rows(x, w, y, n, lo, hi, eps)
        the RMSNorm that Llama's and T5's layers write op by op: r = 1 / sqrt(sum(x * x) / n +
        eps), y = w * (x * r) (w null: x * r), each step as eager's ops round it but the sum of
        squares, which is four 16-lane FMA chains added at the end
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import llvmlite.ir as ll
import torch

from . import jit
from .codegen import (
    F32,
    I32,
    I64,
    PTR,
    VOID,
    combine_lanes,
    counted_loop,
    declared,
    fma,
    lanes_below,
    masked_load,
    masked_store,
    maximum,
    splat,
)
from .sleef import GRAIN

LANES = 8  # ATen's layer_norm kernel is an AVX2 build here: Vectorized<float> has 8 lanes
CHUNK = 16  # vectors per Welford chunk (kChunkSize)
MAX_DEPTH = 64  # levels of the chunk cascade: enough for any int64 length
V8 = ll.VectorType(F32, LANES)
LAYER_NORM = "braze_layer_norm_rows"


class _Moments:
    """(m0, m1, m2): a count, a mean and a sum of squared deviations, in allocas (promoted to
    registers by LLVM's optimiser); vector lanes or a scalar."""

    def __init__(self, b: ll.IRBuilder, ty: ll.Type, count: int = 1) -> None:
        with b.goto_entry_block():
            self.m0 = b.alloca(I64, size=I64(count))
            self.m1 = b.alloca(ty, size=I64(count))
            self.m2 = b.alloca(ty, size=I64(count))
        self.ty = ty

    def at(self, b: ll.IRBuilder, i: ll.Value) -> tuple[ll.Value, ll.Value, ll.Value]:
        return tuple(b.gep(p, [i], source_etype=t) for p, t in ((self.m0, I64), (self.m1, self.ty), (self.m2, self.ty)))

    def clear(self, b: ll.IRBuilder, i: ll.Value) -> None:
        p0, p1, p2 = self.at(b, i)
        zero = ll.Constant(self.ty, None)
        b.store(I64(0), p0)
        b.store(zero, p1)
        b.store(zero, p2)


def _add_moments(
    b: ll.IRBuilder, add: tuple[ll.Value, ll.Value, ll.Value], into: tuple[ll.Value, ll.Value, ll.Value], vector: bool
) -> None:
    """ATen's AddMomentsVec (vector) or AddMoments (scalar): merge the moments `add` (values)
    into `into` (pointers), with the FMAs GCC placed in each."""
    m0_add, m1_add, m2_add = add
    p0, p1, p2 = into
    ty = m1_add.type
    m0 = b.load(p0, typ=I64)
    m1 = b.load(p1, typ=ty)
    m2 = b.load(p2, typ=ty)
    n = b.add(m0, m0_add)
    ratio = b.fdiv(b.sitofp(m0_add, F32), b.sitofp(n, F32))
    c = b.select(b.icmp_signed("==", n, I64(0)), F32(0.0), ratio)
    m0f = b.sitofp(m0, F32)
    if vector:
        c, m0f = splat(b, c, LANES), splat(b, m0f, LANES)
        delta = b.fsub(m1_add, m1)
        b.store(b.fadd(m1, b.fmul(c, delta)), p1)
        b.store(fma(b, b.fmul(delta, m0f), b.fmul(c, delta), b.fadd(m2, m2_add)), p2)
    else:
        delta = b.fsub(m1_add, m1)
        b.store(fma(b, c, delta, m1), p1)
        b.store(b.fadd(m2, fma(b, b.fmul(b.fmul(delta, delta), c), m0f, m2_add)), p2)
    b.store(n, p0)


def _row_moments(b: ll.IRBuilder, x: ll.Value, n_total: ll.Value) -> tuple[ll.Value, ll.Value]:
    """ATen's RowwiseMoments of the n_total floats at x: (mean, variance)."""
    n = b.sdiv(n_total, I64(LANES))
    m = b.sdiv(b.add(n, I64(CHUNK - 1)), I64(CHUNK))
    depth = _ceil_log2(b, m)
    stack = _Moments(b, V8, MAX_DEPTH)
    with counted_loop(b, I64(0), depth) as d:
        stack.clear(b, d)
    run = _Moments(b, V8)
    recips = ll.GlobalVariable(b.module, ll.ArrayType(F32, CHUNK), b.module.get_unique_name("recip"))
    recips.initializer = ll.Constant(ll.ArrayType(F32, CHUNK), [_f32_recip(j + 1) for j in range(CHUNK)])
    recips.global_constant = True
    with counted_loop(b, I64(0), m) as i:
        base = b.gep(x, [b.mul(i, I64(CHUNK * LANES))], source_etype=F32)
        left = b.sub(n, b.mul(i, I64(CHUNK)))
        count = b.select(b.icmp_signed("<", left, I64(CHUNK)), left, I64(CHUNK))
        run.clear(b, I64(0))
        _, p1, p2 = run.at(b, I64(0))
        with counted_loop(b, I64(0), count) as j:
            xv = b.load(b.gep(base, [b.mul(j, I64(LANES))], source_etype=F32), typ=V8, align=4)
            m1 = b.load(p1, typ=V8)
            delta = b.fsub(xv, m1)
            c = splat(b, b.load(b.gep(recips, [I64(0), j], source_etype=recips.value_type), typ=F32), LANES)
            # Both updates of the chunk loop are fused (found by trying each placement against ATen:
            # 0 of 10^5 outputs differ this way, hundreds any other way).
            m1 = fma(b, delta, c, m1)
            b.store(m1, p1)
            b.store(fma(b, delta, b.fsub(xv, m1), b.load(p2, typ=V8)), p2)
        _add_moments(b, (count, b.load(p1, typ=V8), b.load(p2, typ=V8)), stack.at(b, I64(0)), True)
        _cascade(b, stack, b.add(i, I64(1)), depth)
    with counted_loop(b, I64(1), depth) as d:
        p0, p1, p2 = stack.at(b, d)
        add = (b.load(p0, typ=I64), b.load(p1, typ=V8), b.load(p2, typ=V8))
        _add_moments(b, add, stack.at(b, I64(0)), True)
    _, v1, v2 = stack.at(b, I64(0))
    lanes1, lanes2 = b.load(v1, typ=V8), b.load(v2, typ=V8)
    tail = _Moments(b, F32)
    tail.clear(b, I64(0))
    t0, t1, t2 = tail.at(b, I64(0))
    with counted_loop(b, b.mul(n, I64(LANES)), n_total) as k:  # the scalar Welford: no FMA
        xs = b.load(b.gep(x, [k], source_etype=F32), typ=F32)
        m1 = b.load(t1, typ=F32)
        delta = b.fsub(xs, m1)
        m0 = b.add(b.load(t0, typ=I64), I64(1))
        b.store(m0, t0)
        m1 = b.fadd(m1, b.fdiv(delta, b.sitofp(m0, F32)))
        b.store(m1, t1)
        b.store(b.fadd(b.load(t2, typ=F32), b.fmul(delta, b.fsub(xs, m1))), t2)
    for lane in range(LANES):
        add = (n, b.extract_element(lanes1, I64(lane)), b.extract_element(lanes2, I64(lane)))
        _add_moments(b, add, (t0, t1, t2), False)
    mean = b.load(t1, typ=F32)
    return mean, b.fdiv(b.load(t2, typ=F32), b.sitofp(n_total, F32))


def _ceil_log2(b: ll.IRBuilder, x: ll.Value) -> ll.Value:
    """ATen's utils::CeilLog2: 1 up to 2, else the bits of x - 1."""
    ctlz = declared(b.module, "llvm.ctlz.i64", I64, [I64, ll.IntType(1)])
    log = b.sub(I64(64), b.call(ctlz, [b.sub(x, I64(1)), ll.IntType(1)(0)]))
    return b.select(b.icmp_signed("<=", x, I64(2)), I64(1), log)


def _f32_recip(k: int) -> float:
    return torch.tensor(1.0, dtype=torch.float32).div(k).item()


def _cascade(b: ll.IRBuilder, stack: _Moments, mask0: ll.Value, depth: ll.Value) -> None:
    """After chunk i: while bit j-1 of i+1 is clear (j < depth), merge level j-1 into level j."""
    fn = b.function
    head, body, done = (fn.append_basic_block(s) for s in ("cascade", "merge", "cascaded"))
    pre = b.block
    b.branch(head)
    b.position_at_end(head)
    j = b.phi(I64)
    mask = b.phi(I64)
    j.add_incoming(I64(1), pre)
    mask.add_incoming(mask0, pre)
    go = b.and_(b.icmp_signed("<", j, depth), b.icmp_signed("==", b.and_(mask, I64(1)), I64(0)))
    b.cbranch(go, body, done)
    b.position_at_end(body)
    below = b.sub(j, I64(1))
    p0, p1, p2 = stack.at(b, below)
    add = (b.load(p0, typ=I64), b.load(p1, typ=V8), b.load(p2, typ=V8))
    _add_moments(b, add, stack.at(b, j), True)
    stack.clear(b, below)
    j.add_incoming(b.add(j, I64(1)), body)
    mask.add_incoming(b.ashr(mask, I64(1)), body)
    b.branch(head)
    b.position_at_end(done)


def _layer_norm(module: ll.Module) -> None:
    fn = ll.Function(module, ll.FunctionType(VOID, [PTR, PTR, PTR, PTR, I64, I64, I64, F32]), LAYER_NORM)
    x, w, bias, y, n, lo, hi, eps = fn.args
    b = ll.IRBuilder(fn.append_basic_block("entry"))
    sqrt = ll.Function(module, ll.FunctionType(F32, [F32]), "llvm.sqrt.f32")
    with counted_loop(b, lo, hi) as r:
        xr = b.gep(x, [b.mul(r, n)], source_etype=F32)
        yr = b.gep(y, [b.mul(r, n)], source_etype=F32)
        mean, var = _row_moments(b, xr, n)
        rstd = b.fdiv(F32(1.0), b.call(sqrt, [b.fadd(var, eps)]))
        shift = b.fneg(mean)

        def norm(j: ll.Value, ty: ll.Type, width: int) -> None:
            at = lambda p: b.gep(p, [j], source_etype=F32)  # noqa: E731
            s, m = (splat(b, shift, LANES), splat(b, rstd, LANES)) if width > 1 else (shift, rstd)
            xv, wv, bv = (b.load(at(p), typ=ty, align=4) for p in (xr, w, bias))
            b.store(fma(b, b.fmul(b.fadd(xv, s), m), wv, bv), at(yr), align=4)

        body_end = b.and_(n, I64(-LANES))
        with counted_loop(b, I64(0), body_end, LANES) as j:
            norm(j, V8, LANES)
        with counted_loop(b, body_end, n) as j:  # ATen's partial vector: the same arithmetic per lane
            norm(j, F32, 1)
    b.ret_void()


# --- softmax over the last dimension (ATen's AVX512 _vec_softmax_lastdim: 16 lanes) -----------
WIDE = 16
V16 = ll.VectorType(F32, WIDE)
SOFTMAX = "braze_softmax_rows"
LOG_SOFTMAX = "braze_log_softmax_rows"


def _partial(b: ll.IRBuilder, ptr: ll.Value, count: ll.Value, store: ll.Value | None = None) -> ll.Value | None:
    """Vectorized::loadu(ptr, count) (lanes past count are 0) or store(ptr, count)."""
    mask = lanes_below(b, count)
    if store is None:
        return masked_load(b, ptr, mask)
    masked_store(b, store, ptr, mask)
    return None


def _reduce_all(b: ll.IRBuilder, op: Callable, x: ll.Value, n: ll.Value) -> ll.Value:
    """vec::reduce_all(op, x, n): under 16 elements, op over them in order; else a 16-lane
    accumulator over whole vectors, the partial last one merged into its first lanes, then
    lanes i and i^8, i^4, i^2, i^1 combined (op(v, shuffled v) each time)."""
    result = b.alloca(F32)
    with b.if_else(b.icmp_signed("<", n, I64(WIDE))) as (short, long):
        with short:
            b.store(b.load(x, typ=F32), result)
            with counted_loop(b, I64(1), n) as i:
                b.store(op(b, b.load(result, typ=F32), b.load(b.gep(x, [i], source_etype=F32), typ=F32)), result)
        with long:
            acc = b.alloca(V16)
            b.store(b.load(x, typ=V16, align=4), acc)
            whole = b.sub(n, b.srem(n, I64(WIDE)))
            with counted_loop(b, I64(WIDE), whole, WIDE) as d:
                v = b.load(b.gep(x, [d], source_etype=F32), typ=V16, align=4)
                b.store(op(b, b.load(acc, typ=V16), v), acc)
            rest = b.sub(n, whole)
            with b.if_then(b.icmp_signed(">", rest, I64(0))):
                tail = _partial(b, b.gep(x, [whole], source_etype=F32), rest)
                a = b.load(acc, typ=V16)
                b.store(b.select(lanes_below(b, rest), op(b, a, tail), a), acc)
            b.store(combine_lanes(b, b.load(acc, typ=V16), lambda x, y: op(b, x, y)), result)
    return b.load(result, typ=F32)


def _map(b: ll.IRBuilder, n: ll.Value, dst: ll.Value, srcs: list[ll.Value], f: Callable[..., ll.Value]) -> None:
    """vec::map over n floats: dst = f(a vector of each src), whole vectors, then the partial
    last one (its lanes past n are zeros)."""
    whole = b.sub(n, b.srem(n, I64(WIDE)))
    with counted_loop(b, I64(0), whole, WIDE) as d:
        vs = [b.load(b.gep(src, [d], source_etype=F32), typ=V16, align=4) for src in srcs]
        b.store(f(*vs), b.gep(dst, [d], source_etype=F32), align=4)
    rest = b.sub(n, whole)
    with b.if_then(b.icmp_signed(">", rest, I64(0))):
        last = [_partial(b, b.gep(src, [whole], source_etype=F32), rest) for src in srcs]
        _partial(b, b.gep(dst, [whole], source_etype=F32), rest, f(*last))


def _softmax(module: ll.Module, log: bool) -> None:
    fn = ll.Function(module, ll.FunctionType(VOID, [PTR, PTR, I64, I64, I64]), LOG_SOFTMAX if log else SOFTMAX)
    x, y, n, lo, hi = fn.args
    b = ll.IRBuilder(fn.append_basic_block("entry"))
    sleef = lambda name: declared(module, name, V16, [V16])  # noqa: E731
    exp = sleef("Sleef_expf16_u10")
    vmap = lambda src, dst, f: _map(b, n, dst, [src], f)  # noqa: E731

    with counted_loop(b, lo, hi) as r:
        xr = b.gep(x, [b.mul(r, n)], source_etype=F32)
        yr = b.gep(y, [b.mul(r, n)], source_etype=F32)
        top = splat(b, _reduce_all(b, maximum, xr, n), WIDE)
        vmap(xr, yr, lambda v: b.call(exp, [b.fsub(v, top)]))  # log_softmax: map_reduce_all's map
        total = _reduce_all(b, lambda b, p, q: b.fadd(p, q), yr, n)
        if log:  # y = (x - max) - log(sum), the log Sleef's (vec::map over the rows' sums)
            logsum = splat(
                b, b.extract_element(b.call(sleef("Sleef_logf16_u10"), [splat(b, total, WIDE)]), I64(0)), WIDE
            )
            vmap(xr, yr, lambda v: b.fsub(b.fsub(v, top), logsum))
        else:
            scale = splat(b, b.fdiv(F32(1.0), total), WIDE)
            vmap(yr, yr, lambda v: b.fmul(v, scale))
    b.ret_void()


# --- sum and mean over the last dimension (ATen's AVX2 cascade_sum: 8 lanes) ------------------
SUM = "braze_sum_rows"
ILP = 4  # row_sum's independent accumulators
LEVELS = 4  # multi_row_sum's cascade levels


def _multi_row_sum(b: ll.IRBuilder, ty: ll.Type, load: Callable[[ll.Value, int], ll.Value], size: ll.Value) -> list:
    """ATen's multi_row_sum of ILP rows over `size` steps (load(i, k): step i of row k): level 0
    sums level_step steps, then carries into the levels above while the step count's next bits
    are zero; the rest of the steps into level 0; then level 0 += levels 1, 2, 3. Its ILP sums."""
    zero = ll.Constant(ty, None)
    with b.goto_entry_block():
        acc = [[b.alloca(ty) for _ in range(ILP)] for _ in range(LEVELS)]
        i_ptr = b.alloca(I64)
    for level in acc:
        for p in level:
            b.store(zero, p)
    power = b.sdiv(_ceil_log2(b, size), I64(LEVELS))
    power = b.select(b.icmp_signed("<", power, I64(4)), I64(4), power)
    step = b.shl(I64(1), power)
    mask = b.sub(step, I64(1))
    b.store(I64(0), i_ptr)
    fn = b.function
    head, body, rest = (fn.append_basic_block(n) for n in ("levels", "level0", "rest"))
    b.branch(head)
    b.position_at_end(head)
    i = b.load(i_ptr, typ=I64)
    b.cbranch(b.icmp_signed("<=", b.add(i, step), size), body, rest)
    b.position_at_end(body)
    with counted_loop(b, i, b.add(i, step)) as j:
        for k in range(ILP):
            b.store(b.fadd(b.load(acc[0][k], typ=ty), load(j, k)), acc[0][k])
    i = b.add(i, step)
    b.store(i, i_ptr)
    for j in range(1, LEVELS):
        for k in range(ILP):
            b.store(b.fadd(b.load(acc[j][k], typ=ty), b.load(acc[j - 1][k], typ=ty)), acc[j][k])
            b.store(zero, acc[j - 1][k])
        if j < LEVELS - 1:
            carry = fn.append_basic_block("carry")
            b.cbranch(b.icmp_signed("!=", b.and_(i, b.shl(mask, b.mul(I64(j), power))), I64(0)), head, carry)
            b.position_at_end(carry)
    b.branch(head)
    b.position_at_end(rest)
    with counted_loop(b, b.load(i_ptr, typ=I64), size) as j:
        for k in range(ILP):
            b.store(b.fadd(b.load(acc[0][k], typ=ty), load(j, k)), acc[0][k])
    for j in range(1, LEVELS):
        for k in range(ILP):
            b.store(b.fadd(b.load(acc[0][k], typ=ty), b.load(acc[j][k], typ=ty)), acc[0][k])
    return [b.load(acc[0][k], typ=ty) for k in range(ILP)]


def _row_sum(b: ll.IRBuilder, ty: ll.Type, at: Callable[[ll.Value], ll.Value], size: ll.Value) -> ll.Value:
    """ATen's row_sum of `size` items (at(i): item i): ILP interleaved cascades, the items past
    the last whole group into the first, then the first += the others in order."""
    groups = b.sdiv(size, I64(ILP))
    sums = _multi_row_sum(b, ty, lambda i, k: at(b.add(b.mul(i, I64(ILP)), I64(k))), groups)
    with b.goto_entry_block():
        first = b.alloca(ty)
    b.store(sums[0], first)
    with counted_loop(b, b.mul(groups, I64(ILP)), size) as i:
        b.store(b.fadd(b.load(first, typ=ty), at(i)), first)
    total = b.load(first, typ=ty)
    for k in range(1, ILP):
        total = b.fadd(total, sums[k])
    return total


def _cascade_sum(module: ll.Module) -> ll.Function:
    """float braze_cascade_sum(x, n): what ATen's cascade_sum stores for n contiguous floats into a
    zero-filled output: 0 + (scalar_inner_sum under 8 of them, else vectorized_inner_sum: the
    8-lane row_sum, then the scalar tail in order, then the lanes in order)."""
    fn = ll.Function(module, ll.FunctionType(F32, [PTR, I64]), "braze_cascade_sum")
    fn.linkage = "internal"
    x, n = fn.args
    b = ll.IRBuilder(fn.append_basic_block("entry"))
    with b.goto_entry_block():
        out = b.alloca(F32)
    element = lambda i: b.load(b.gep(x, [i], source_etype=F32), typ=F32)  # noqa: E731
    with b.if_else(b.icmp_signed("<", n, I64(LANES))) as (short, long):
        with short:
            b.store(_row_sum(b, F32, element, n), out)
        with long:
            vectors = b.sdiv(n, I64(LANES))
            vec = lambda i: b.load(b.gep(x, [b.mul(i, I64(LANES))], source_etype=F32), typ=V8, align=4)  # noqa: E731
            lanes = _row_sum(b, V8, vec, vectors)
            b.store(F32(0.0), out)
            with counted_loop(b, b.mul(vectors, I64(LANES)), n) as k:
                b.store(b.fadd(b.load(out, typ=F32), element(k)), out)
            total = b.load(out, typ=F32)
            for lane in range(LANES):
                total = b.fadd(total, b.extract_element(lanes, I64(lane)))
            b.store(total, out)
    b.ret(b.fadd(F32(0.0), b.load(out, typ=F32)))
    return fn


def _sum(module: ll.Module) -> None:
    """braze_sum_rows(x, y, n, lo, hi, rows, mean): y[r] = the cascade sum of row r (/ n for a
    mean). One row of GRAIN or more on several threads is ATen's two_pass_reduction: the row cut
    into min(threads, n / GRAIN) chunks, each one's sum into a slot of a zeroed buffer of one
    per thread, then the buffer summed the same way (computed here on one thread: same bits)."""
    cascade = _cascade_sum(module)
    fn = ll.Function(module, ll.FunctionType(VOID, [PTR, PTR, I64, I64, I64, I64, ll.IntType(1)]), SUM)
    x, y, n, lo, hi, rows, mean = fn.args
    b = ll.IRBuilder(fn.append_basic_block("entry"))
    max_threads = declared(module, "omp_get_max_threads", I32, [])
    threads = b.sext(b.call(max_threads, []), I64)
    with b.goto_entry_block():
        out = b.alloca(F32)

    def finish(r: ll.Value) -> None:
        total = b.load(out, typ=F32)
        b.store(b.select(mean, b.fdiv(total, b.sitofp(n, F32)), total), b.gep(y, [r], source_etype=F32))

    two_pass = b.and_(b.icmp_signed("==", rows, I64(1)), b.icmp_signed(">=", n, I64(GRAIN)))
    two_pass = b.and_(two_pass, b.icmp_signed(">", threads, I64(1)))
    with b.if_else(two_pass) as (split, plain):
        with split:
            slots = b.alloca(F32, size=threads)
            with counted_loop(b, I64(0), threads) as t:
                b.store(F32(0.0), b.gep(slots, [t], source_etype=F32))
            parts = b.sdiv(b.add(n, I64(GRAIN - 1)), I64(GRAIN))
            parts = b.select(b.icmp_signed("<", threads, parts), threads, parts)
            size = b.sdiv(b.add(n, b.sub(parts, I64(1))), parts)
            with counted_loop(b, I64(0), parts) as t:
                begin = b.mul(t, size)
                with b.if_then(b.icmp_signed("<", begin, n)):
                    left = b.sub(n, begin)
                    count = b.select(b.icmp_signed("<", size, left), size, left)
                    part = b.call(cascade, [b.gep(x, [begin], source_etype=F32), count])
                    b.store(part, b.gep(slots, [t], source_etype=F32))
            b.store(b.call(cascade, [slots, threads]), out)
            finish(I64(0))
        with plain:
            with counted_loop(b, lo, hi) as r:
                b.store(b.call(cascade, [b.gep(x, [b.mul(r, n)], source_etype=F32), n]), out)
                finish(r)
    b.ret_void()


# --- fast mode's RMSNorm ------------------------------------------------------------------------
RMS_NORM = "braze_rms_norm_rows"
CHAINS = 4  # its independent FMA chains of squares


def _rms_norm(module: ll.Module) -> None:
    fn = ll.Function(module, ll.FunctionType(VOID, [PTR, PTR, PTR, I64, I64, I64, F32]), RMS_NORM)
    x, w, y, n, lo, hi, eps = fn.args
    b = ll.IRBuilder(fn.append_basic_block("entry"))
    with b.goto_entry_block():
        acc = [b.alloca(V16) for _ in range(CHAINS)]
    sqrt = declared(module, "llvm.sqrt.f32", F32, [F32])
    weighted = b.icmp_unsigned("!=", b.ptrtoint(w, I64), I64(0))  # (null: no weight)
    whole = b.sub(n, b.srem(n, I64(WIDE)))
    rest = b.sub(n, whole)
    load = lambda p, i: b.load(b.gep(p, [i], source_etype=F32), typ=V16, align=4)  # noqa: E731
    with counted_loop(b, lo, hi) as r:
        xr, yr = (b.gep(p, [b.mul(r, n)], source_etype=F32) for p in (x, y))
        for a in acc:
            b.store(ll.Constant(V16, [0.0] * WIDE), a)
        quads = b.sub(n, b.srem(n, I64(WIDE * CHAINS)))
        with counted_loop(b, I64(0), quads, WIDE * CHAINS) as d:
            for u, a in enumerate(acc):
                v = load(xr, b.add(d, I64(WIDE * u)))
                b.store(fma(b, v, v, b.load(a, typ=V16)), a)
        with counted_loop(b, quads, whole, WIDE) as d:
            v = load(xr, d)
            b.store(fma(b, v, v, b.load(acc[0], typ=V16)), acc[0])
        with b.if_then(b.icmp_signed(">", rest, I64(0))):
            v = _partial(b, b.gep(xr, [whole], source_etype=F32), rest)
            b.store(fma(b, v, v, b.load(acc[0], typ=V16)), acc[0])
        total = functools.reduce(b.fadd, [b.load(a, typ=V16) for a in acc])
        mean = b.fdiv(combine_lanes(b, total, b.fadd), b.sitofp(n, F32))
        scale = splat(b, b.fdiv(F32(1.0), b.call(sqrt, [b.fadd(mean, eps)])), WIDE)
        with b.if_else(weighted) as (given, none):
            with given:
                _map(b, n, yr, [xr, w], lambda v, u: b.fmul(u, b.fmul(v, scale)))
            with none:
                _map(b, n, yr, [xr], lambda v: b.fmul(v, scale))
    b.ret_void()


_BUILDERS: dict[str, Callable[[ll.Module], None]] = {
    LAYER_NORM: _layer_norm,
    SOFTMAX: lambda module: _softmax(module, log=False),
    LOG_SOFTMAX: lambda module: _softmax(module, log=True),
    SUM: _sum,
    RMS_NORM: _rms_norm,
}


def library(kernel: str) -> int:
    """The address of row kernel `kernel` (jit.kernel: built alone when first needed, 30-60 ms
    each at -O2; all four together took ~170 ms)."""
    return jit.kernel(kernel, _BUILDERS[kernel])


def layer_norm_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """The native kernel on a contiguous float32 x normalised over its last dimension (for the probe)."""
    kernel = ctypes.CFUNCTYPE(None, *[ctypes.c_void_p] * 4, *[ctypes.c_int64] * 3, ctypes.c_float)(library(LAYER_NORM))
    n = x.shape[-1]
    y = torch.empty_like(x)
    kernel(x.data_ptr(), weight.data_ptr(), bias.data_ptr(), y.data_ptr(), n, 0, x.numel() // max(n, 1), eps)
    return y


def layer_norm_same() -> bool:
    """Whether the native layer_norm gives ATen's bits here: row lengths around every boundary
    of its vector body, chunks and cascade, values of many scales, special values. Once per
    process (rows never split between threads in either, so the thread count cannot matter)."""
    return _layer_norm_same()


@functools.cache
def _layer_norm_same() -> bool:
    gen = torch.Generator().manual_seed(0)
    for n in (1, 2, 7, 8, 9, 15, 16, 17, 31, 33, 127, 128, 129, 255, 257, 384, 768, 1000, 2049, 4100, 9000):
        rows = 3
        x = (torch.rand(rows, n, generator=gen) - 0.3) * torch.logspace(-3, 3, rows).unsqueeze(1)
        if n > 4:
            x[1, :4] = torch.tensor([0.0, -0.0, 1e-40, -3.0e38 / n])
        w, bias = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
        for eps in (1e-5, 1e-12):
            want = torch.nn.functional.layer_norm(x, (n,), w, bias, eps)
            if not jit.same_bits(layer_norm_rows(x, w, bias, eps), want):
                return False
    specials = torch.tensor([[1.0, float("nan"), 2.0], [float("inf"), 1.0, 0.0], [-float("inf"), 3.0, 1.0]])
    w, bias = torch.ones(3), torch.zeros(3)
    return jit.same_bits(
        layer_norm_rows(specials, w, bias, 1e-5),
        torch.nn.functional.layer_norm(specials, (3,), w, bias),
        nan_payloads=False,
    )


def softmax_rows(x: torch.Tensor, log: bool = False) -> torch.Tensor:
    """The native (log_)softmax over the last dimension of a contiguous float32 x (for the probe)."""
    address = library(LOG_SOFTMAX if log else SOFTMAX)
    kernel = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, *[ctypes.c_int64] * 3)(address)
    n = x.shape[-1]
    y = torch.empty_like(x)
    kernel(x.data_ptr(), y.data_ptr(), n, 0, x.numel() // max(n, 1))
    return y


def softmax_same(log: bool = False) -> bool:
    """Whether the native softmax (log_softmax) gives ATen's bits here: row lengths around its
    16-lane vectors, values of many scales, rows with NaN, infinities and signed zeros. Once per
    process (rows never split between threads in either)."""
    return _softmax_same(log)


@functools.cache
def _softmax_same(log: bool) -> bool:
    aten = torch.log_softmax if log else torch.softmax
    gen = torch.Generator().manual_seed(0)
    for n in (1, 2, 15, 16, 17, 31, 32, 33, 100, 128, 257, 1000, 4099):
        x = torch.randn(4, n, generator=gen) * torch.tensor([0.01, 1.0, 30.0, 1e3]).unsqueeze(1)
        if not jit.same_bits(softmax_rows(x, log), aten(x, -1), nan_payloads=False):
            return False
    inf, nan = float("inf"), float("nan")
    special = torch.tensor(
        [[1.0, nan, 2.0], [inf, 1.0, 0.0], [-inf, -inf, -inf], [-0.0, 0.0, -0.0], [88.0, 0.0, -90.0]]
    )
    special = special.repeat(1, 7)
    return jit.same_bits(softmax_rows(special, log), aten(special, -1), nan_payloads=False)


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Fast mode's kernel on a contiguous float32 x over its last dimension (for tests)."""
    kernel = ctypes.CFUNCTYPE(None, *[ctypes.c_void_p] * 3, *[ctypes.c_int64] * 3, ctypes.c_float)(library(RMS_NORM))
    y, n = torch.empty_like(x), x.shape[-1]
    w = None if weight is None else weight.data_ptr()
    kernel(x.data_ptr(), w, y.data_ptr(), n, 0, x.numel() // max(n, 1), eps)
    return y


def sum_rows(x: torch.Tensor, mean: bool = False) -> torch.Tensor:
    """The native sum (mean) over the last dimension of a contiguous float32 x (for the probe)."""
    kernel = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, *[ctypes.c_int64] * 4, ctypes.c_bool)
    n = x.shape[-1]
    y = torch.empty(x.shape[:-1])
    kernel(library(SUM))(x.data_ptr(), y.data_ptr(), n, 0, y.numel(), y.numel(), mean)
    return y


def sum_same() -> bool:
    """Whether the native sum and mean give ATen's bits here: lengths around the 8-lane vectors,
    the 4 interleaved accumulators and each level of the cascade, one long row (which both
    split between threads), values of several scales and offsets, special values. Once per
    process and thread count."""
    return _sum_same(torch.get_num_threads())


@functools.cache
def _sum_same(threads: int) -> bool:  # threads: in the cache key
    gen = torch.Generator().manual_seed(0)
    for n in (1, 3, 7, 8, 9, 31, 32, 33, 127, 128, 129, 511, 513, 4097, 40000, 70001):
        x = torch.randn(3, n, generator=gen) * torch.tensor([[0.1], [1.0], [1e3]]) + torch.tensor([[0.0], [3.0], [0.0]])
        if not (jit.same_bits(sum_rows(x), x.sum(-1)) and jit.same_bits(sum_rows(x, True), x.mean(-1))):
            return False
        row = x[1:2] * 1e3  # one long row: split between threads from 32768 on, as ATen's two passes
        if not (jit.same_bits(sum_rows(row), row.sum(-1)) and jit.same_bits(sum_rows(row, True), row.mean(-1))):
            return False
    inf, nan = float("inf"), float("nan")
    special = torch.tensor([[1.0, nan, 2.0], [inf, 1.0, 0.0], [-inf, inf, 1.0], [-0.0, -0.0, -0.0]]).repeat(1, 11)
    return jit.same_bits(sum_rows(special), special.sum(-1), nan_payloads=False)
