"""Elementwise loop nests: the loop order and vector width for a kernel's accesses, and each
element's arithmetic with ATen's exact semantics (NaN, signed zero, FMAs where ATen's build has
them); the LLVM types and small helpers every kernel writer shares (rows.py, sleef.py, pool.py,
entry.py)."""

from __future__ import annotations

import ctypes
import math
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import llvmlite.ir as ll
import torch

from .. import dims, jit
from ..dims import Dim
from ..ir import COMPARE, INTEGERS, Node, Op, TensorMeta

F32, I64, I32, I8, I1 = ll.FloatType(), ll.IntType(64), ll.IntType(32), ll.IntType(8), ll.IntType(1)
PTR = ll.PointerType()
VOID = ll.VoidType()


@dataclass(frozen=True)
class Access:
    """Where a value's elements are: slot in the table + layout (element units)."""

    slot: int
    meta: TensorMeta


# How each of ir.LOOP_DTYPES is laid out in memory.
STORED = {torch.float32: F32, torch.bool: I8, torch.int32: I32, torch.int64: I64}
_ALIGN = {F32: 4, I8: 1, I32: 4, I64: 8}


def _bstrides(meta: TensorMeta, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Strides of `meta` broadcast to `shape` (0 on broadcast dimensions)."""
    pad = len(shape) - len(meta.shape)
    out = []
    for d, size in enumerate(shape):
        j = d - pad
        out.append(0 if j < 0 or (meta.shape[j] == 1 and size != 1) else meta.stride[j])
    return tuple(out)


@dataclass(frozen=True)
class _Dim:
    size: Dim
    axis: int  # innermost original axis folded into this loop; its strides step the index


def _loop_dims(shape: tuple[Dim, ...], metas: list[TensorMeta], out: TensorMeta) -> list[_Dim]:
    """Loop order (outer to inner) following the output's strides; merge dims every access
    walks contiguously, so a dense tensor is one flat loop."""
    strides = [_bstrides(m, shape) for m in metas]
    order = sorted((d for d in range(len(shape)) if shape[d] != 1), key=lambda d: -dims.typical(out.stride[d]))
    loops: list[_Dim] = []
    for d in order:
        if loops and all(s[loops[-1].axis] == s[d] * shape[d] for s in strides):
            loops[-1] = _Dim(loops[-1].size * shape[d], d)  # every access walks both as one run
            continue
        loops.append(_Dim(shape[d], d))
    return loops


def _nest(
    b: ll.IRBuilder,
    sizes: list[int | ll.Value],
    lo: ll.Value,
    hi: ll.Value,
    inner: Callable[..., None],
    width: int,
) -> None:
    """Loop nest over `sizes` (constants, or values computed per call); the outermost runs
    [lo, hi). With width > 1 the innermost loop steps `width` elements at a time, then finishes
    the remainder one element at a time."""
    if not sizes:
        inner(b, [], 1)
        return
    idx: list[ll.Value] = []

    def level(depth: int) -> None:
        size = sizes[depth]
        start, stop = (lo, hi) if depth == 0 else (I64(0), I64(size) if isinstance(size, int) else size)
        if depth + 1 < len(sizes):
            with counted_loop(b, start, stop) as i:
                idx.append(i)
                level(depth + 1)
                idx.pop()
            return
        if depth > 0 and isinstance(size, int) and size <= FULL_UNROLL:
            # A short row inside a loop nest: straight-line code, no loop of its own (at -O0 the
            # row's counter and bounds checks would cost more than its few vectors).
            whole = size // width * width if width > 1 else 0
            if whole:
                inner(b, idx + [I64(0)], width, tuple(range(0, whole, width)))
            if size > whole:
                inner(b, idx + [I64(whole)], 1, tuple(range(size - whole)))
            return
        if width > 1 and (not isinstance(size, int) or size >= UNROLL * width):
            # Unrolled: without LLVM's optimiser the loop counter lives on the stack, and its
            # store-to-load chain, not the arithmetic, would set the pace of a one-vector loop.
            unrolled = tuple(u * width for u in range(UNROLL))
            start = _strided(b, start, stop, UNROLL * width, lambda i: inner(b, idx + [i], width, unrolled))
        if width > 1:
            start = _strided(b, start, stop, width, lambda i: inner(b, idx + [i], width))
        with counted_loop(b, start, stop) as i:
            inner(b, idx + [i], 1)

    level(0)


def _strided(b: ll.IRBuilder, start: ll.Value, stop: ll.Value, step: int, emit: Callable) -> ll.Value:
    """Loop over the whole steps of `step` (a power of two) in [start, stop); return where the
    rest begins. Bounds known here are folded: at -O0 a division would cost ~40 cycles a row."""
    if isinstance(start, ll.Constant) and isinstance(stop, ll.Constant):
        end: ll.Value = I64(start.constant + (stop.constant - start.constant) // step * step)
    else:
        end = b.add(start, b.and_(b.sub(stop, start), I64(-step)))  # stop >= start: round down
    with counted_loop(b, start, end, step) as i:
        emit(i)
    return end


class counted_loop:  # lower case: it reads as a statement, `with counted_loop(...) as i:`
    """`with counted_loop(b, lo, hi, step) as i:` emits a counted loop (lo < hi is checked first);
    the step is a constant or a value known at run time (positive)."""

    def __init__(self, b: ll.IRBuilder, lo: ll.Value, hi: ll.Value, step: int | ll.Value = 1) -> None:
        self.b, self.lo, self.hi, self.step = b, lo, hi, step

    def __enter__(self) -> ll.Value:
        b = self.b
        fn = b.function
        self.pre = b.block
        self.head = fn.append_basic_block("loop")
        self.exit = fn.append_basic_block("after")
        b.cbranch(b.icmp_signed("<", self.lo, self.hi), self.head, self.exit)
        b.position_at_end(self.head)
        self.i = b.phi(I64)
        self.i.add_incoming(self.lo, self.pre)
        return self.i

    def __exit__(self, *exc: object) -> None:
        b = self.b
        nxt = b.add(self.i, I64(self.step) if isinstance(self.step, int) else self.step)
        self.i.add_incoming(nxt, b.block)
        b.cbranch(b.icmp_signed("<", nxt, self.hi), self.head, self.exit)
        b.position_at_end(self.exit)


@contextmanager
def pieces(b: ll.IRBuilder, lo: ll.Value, hi: ll.Value, size: ll.Value) -> Iterator[tuple[ll.Value, ...]]:
    """A loop over the pieces of `size` rows (> 0) one after another that rows [lo, hi) reach (a
    thread's share of images, or of attention's (batch, head) pairs): each piece's index, its
    first row, and the rows [first, end) of it inside [lo, hi), counted from that first row."""
    with counted_loop(b, b.sdiv(lo, size), b.sdiv(b.add(hi, b.sub(size, I64(1))), size)) as piece:
        start = b.mul(piece, size)
        first = b.sub(lo, start)
        yield (
            piece,
            start,
            b.select(b.icmp_signed(">", first, I64(0)), first, I64(0)),
            smaller(b, b.sub(hi, start), size),
        )


WIDTH = 8  # float32 lanes of an AVX2 register
UNROLL = 4  # vectors per iteration of the main loop
FULL_UNROLL = 128  # elements: inner rows this short are written out in full


def _nonzero(x: int | ll.Value) -> bool:
    """A stride or offset that may not be 0 (one computed per call is a product of sizes >= 1)."""
    return not isinstance(x, int) or x != 0


def _one(x: int | ll.Value) -> bool:
    return isinstance(x, int) and x == 1


def _value(x: int | ll.Value) -> ll.Value:
    return I64(x) if isinstance(x, int) else x


class _BodyEmitter:
    """Emits one iteration (one element, or WIDTH of them) of a fused elementwise body."""

    def __init__(
        self,
        body: tuple[Node, ...],
        accesses: dict,
        dims: list[_Dim],
        operands: dict[str, Access],
        out_dtype: torch.dtype,
    ) -> None:
        self.body, self.accesses, self.dims, self.operands = body, accesses, dims, operands
        self.out_dtype = out_dtype  # a comparison's i1 values are stored as bytes
        self.dtypes = {n.name: n.meta.dtype for n in body} | {k: a.meta.dtype for k, a in operands.items()}

    def pointer(self, b: ll.IRBuilder, name: str, idx: list[ll.Value]) -> ll.Value:
        base, strides, off = self.accesses[name]
        # Without LLVM's optimiser nothing folds `* 1` or `+ 0`: skip them here.
        steps = [(i, strides[d.axis]) for d, i in zip(self.dims, idx) if _nonzero(strides[d.axis])]
        terms = [i if _one(st) else b.mul(i, _value(st)) for i, st in steps] + ([_value(off)] if _nonzero(off) else [])
        lin = terms[0] if terms else I64(0)
        for t in terms[1:]:
            lin = b.add(lin, t)
        return b.gep(base, [lin], source_etype=self._etype(name))

    def _inner_stride(self, name: str) -> int | ll.Value:
        """How far an access moves per step of the innermost loop (0: broadcast)."""
        return self.accesses[name][1][self.dims[-1].axis] if self.dims else 0

    def _etype(self, name: str) -> ll.Type:
        return STORED[self.out_dtype if name == "__out__" else self.dtypes.get(name, torch.float32)]

    def emit(self, b: ll.IRBuilder, idx: list[ll.Value], width: int, offsets: tuple[int, ...] = (0,)) -> None:
        """The body at `idx`, then at each further element offset along the innermost loop
        (an unrolled iteration): addresses are computed once, then displaced by constants."""
        ty = (lambda t: ll.VectorType(t, width)) if width > 1 else (lambda t: t)
        bases: dict[str, ll.Value] = {}

        def at(name: str, offset: int) -> ll.Value:
            if name not in bases:
                bases[name] = self.pointer(b, name, idx)
            inner = self._inner_stride(name)
            if not offset or not _nonzero(inner):
                return bases[name]
            step = I64(offset * inner) if isinstance(inner, int) else b.mul(I64(offset), inner)
            return b.gep(bases[name], [step], source_etype=self._etype(name))

        def const(v: float, ety: ll.Type = F32) -> ll.Constant:
            return ll.Constant(ty(ety), [v] * width) if width > 1 else ety(v)

        def load(name: str, offset: int) -> ll.Value:
            ety = self._etype(name)
            ptr = at(name, offset)
            if width == 1 or self._inner_stride(name) == 1:
                return b.load(ptr, typ=ty(ety), align=_ALIGN[ety])
            return splat(b, b.load(ptr, typ=ety), width)  # broadcast along the vector

        for offset in offsets:
            vals: dict[str, ll.Value] = {}

            def get(x: object, ety: ll.Type = F32, vals: dict = vals, offset: int = offset) -> ll.Value:
                if isinstance(x, str):
                    if x not in vals:
                        vals[x] = load(x, offset)
                    return vals[x]
                return const(x, ety)

            for n in self.body:
                vals[n.name] = _scalar_op(b, n, get, const, self.dtypes)
            result = vals[self.body[-1].name]
            if result.type == ty(I1):  # a comparison's: bool bytes
                result = b.zext(result, ty(I8))
            b.store(result, at("__out__", offset), align=_ALIGN[self._etype("__out__")])


def _scalar_op(
    b: ll.IRBuilder,
    n: Node,
    get: Callable[..., ll.Value],
    const: Callable[..., ll.Value],
    dtypes: dict[str, torch.dtype] | None = None,
) -> ll.Value:
    """One element (or vector of elements) of an elementwise node, with ATen's exact semantics
    for NaN and signed zero; `dtypes`: the loop's values' dtypes, where any is not float32."""
    dtypes = dtypes or {}
    whole = next((dtypes[i] for i in n.inputs if dtypes.get(i) in INTEGERS), None)
    if n.op is Op.COPY:
        return _convert(b, get(n.inputs[0]), dtypes.get(n.inputs[0], torch.float32), n.meta.dtype)
    if whole is not None:  # integers: two's complement arithmetic and comparisons, as ATen's
        x = [get(i, STORED[whole]) for i in n.inputs]
        if n.op in COMPARE:
            return b.icmp_signed(_COMPARE.get(n.op, "!="), x[0], x[1])
        return {Op.ADD: b.add, Op.SUB: b.sub, Op.MUL: b.mul}[n.op](x[0], x[1])
    x = [get(i) for i in n.inputs]
    op = n.op
    if op in _ARITH:
        return _ARITH[op](b, x[0], x[1])
    if op is Op.FMA:
        return fma(b, *x)
    if op is Op.NEG:
        return b.fneg(x[0])
    if op is Op.ABS:  # clears the sign bit, as ATen's abs does
        return _intrinsic(b, "fabs", x[0])
    if op is Op.GELU_ERF:
        return gelu_erf(b, x[0])
    if op is Op.TANH:
        return mkl_tanh(b, x[0])
    if op is Op.FAST_TANH:
        from .fastmath import fast_tanh  # (it builds on this module's helpers)

        return fast_tanh(b, x[0])
    if op is Op.SLEEF:
        from .. import sleef  # (it builds on this module's helpers)

        return sleef.element(b, x[0], n.attrs["fn"])
    if op is Op.RSQRT:  # ATen's rsqrt: an IEEE square root, then an IEEE division (no fast-math)
        return b.fdiv(const(1.0), _intrinsic(b, "sqrt", x[0]))
    if op is Op.RELU:  # clamp_min(x, 0): max_ps(0, x) keeps x when x is NaN or -0.0
        return b.select(b.fcmp_ordered("<", x[0], const(0.0)), const(0.0), x[0])
    if op is Op.LEAKY_RELU:
        return b.select(b.fcmp_ordered(">", x[0], const(0.0)), x[0], b.fmul(x[0], const(n.attrs["slope"])))
    if op is Op.CLAMP:  # min_ps(hi, max_ps(lo, x)): NaN passes through
        v = x[0]
        if n.attrs["lo"] is not None:
            lo = const(n.attrs["lo"])
            v = b.select(b.fcmp_ordered(">", lo, v), lo, v)
        if n.attrs["hi"] is not None:
            hi = const(n.attrs["hi"])
            v = b.select(b.fcmp_ordered("<", hi, v), hi, v)
        return v
    if op in (Op.MAXIMUM, Op.MINIMUM):  # NaN if either is NaN, else max_ps/min_ps
        cmp = ">" if op is Op.MAXIMUM else "<"
        pick = b.select(b.fcmp_ordered(cmp, x[0], x[1]), x[0], x[1])
        nan = b.fcmp_unordered("uno", x[0], x[1])
        return b.select(nan, const(float("nan")), pick)
    if op in COMPARE:  # IEEE: false when either is NaN, except != (true)
        if op is Op.NE:
            return b.fcmp_unordered("!=", x[0], x[1])
        return b.fcmp_ordered(_COMPARE[op], x[0], x[1])
    if op is Op.WHERE:
        cond = x[0]  # a comparison's i1 values, or bool bytes loaded from memory
        element = cond.type.element if isinstance(cond.type, ll.VectorType) else cond.type
        if element != I1:
            zero = ll.Constant(cond.type, [0] * cond.type.count) if isinstance(cond.type, ll.VectorType) else I8(0)
            cond = b.icmp_unsigned("!=", cond, zero)
        return b.select(cond, x[1], x[2])
    raise NotImplementedError(op)


def _convert(b: ll.IRBuilder, x: ll.Value, src: torch.dtype, dst: torch.dtype) -> ll.Value:
    """x of dtype src as dst, as ATen's copy converts (bool, int32, int64 to any of them or to
    float32; float32 only to itself: lowering makes float32 to bool a comparison)."""
    if src == dst:
        return x
    element = x.type.element if isinstance(x.type, ll.VectorType) else x.type
    shaped = (lambda t: ll.VectorType(t, x.type.count)) if isinstance(x.type, ll.VectorType) else (lambda t: t)
    if src == torch.bool and element != I1:  # bytes loaded from memory
        zero = ll.Constant(x.type, [0] * x.type.count) if isinstance(x.type, ll.VectorType) else ll.Constant(x.type, 0)
        x = b.icmp_unsigned("!=", x, zero)
    if dst == torch.float32:
        return b.uitofp(x, shaped(F32)) if src == torch.bool else b.sitofp(x, shaped(F32))
    to = shaped(STORED[dst])
    if src == torch.bool:
        return b.zext(x, to)
    return b.sext(x, to) if src.itemsize < dst.itemsize else b.trunc(x, to)


def declared(module: ll.Module, name: str, ret: ll.Type, args: list[ll.Type]) -> ll.Function:
    """The function `name` of `module` (an intrinsic, or one linked by name), declared once."""
    return module.globals.get(name) or ll.Function(module, ll.FunctionType(ret, args), name)


def _intrinsic(b: ll.IRBuilder, name: str, *xs: ll.Value) -> ll.Value:
    """LLVM's `llvm.<name>` on floats or vectors of floats (fabs, sqrt, fma: exact IEEE operations)."""
    ty = xs[0].type
    full = f"llvm.{name}.v{ty.count}f32" if isinstance(ty, ll.VectorType) else f"llvm.{name}.f32"
    return b.call(declared(b.module, full, ty, [ty] * len(xs)), list(xs))


def fma(b: ll.IRBuilder, x: ll.Value, y: ll.Value, z: ll.Value) -> ll.Value:
    """x * y + z rounded once, where ATen's build has an FMA (GCC contracted it)."""
    return _intrinsic(b, "fma", x, y, z)


LANES16 = ll.VectorType(F32, 16)  # an AVX-512 register of float32, for the library kernels


def splat(b: ll.IRBuilder, x: ll.Value, lanes: int) -> ll.Value:
    """x (a scalar of any type) in each of `lanes` lanes."""
    one = b.insert_element(ll.Constant(ll.VectorType(x.type, 1), ll.Undefined), x, I32(0))
    return b.shuffle_vector(one, one, ll.Constant(ll.VectorType(I32, lanes), [0] * lanes))


def lanes_below(b: ll.IRBuilder, count: ll.Value) -> ll.Value:
    """The 16 lanes' mask: lane i < count."""
    lanes = ll.Constant(ll.VectorType(I32, 16), list(range(16)))
    return b.icmp_signed("<", lanes, splat(b, b.trunc(count, I32), 16))


def masked_load(b: ll.IRBuilder, ptr: ll.Value, mask: ll.Value) -> ll.Value:
    """16 floats from ptr, lanes outside mask not read (and 0)."""
    load = declared(b.module, "llvm.masked.load.v16f32.p0", LANES16, [PTR, I32, mask.type, LANES16])
    return b.call(load, [ptr, I32(4), mask, ll.Constant(LANES16, [0.0] * 16)])


def masked_store(b: ll.IRBuilder, value: ll.Value, ptr: ll.Value, mask: ll.Value) -> None:
    """value's lanes inside mask stored from ptr on."""
    store = declared(b.module, "llvm.masked.store.v16f32.p0", VOID, [LANES16, PTR, I32, mask.type])
    b.call(store, [value, ptr, I32(4), mask])


_COMPARE = {Op.LT: "<", Op.LE: "<=", Op.GT: ">", Op.GE: ">=", Op.EQ: "=="}

_ARITH = {
    Op.ADD: lambda b, x, y: b.fadd(x, y),
    Op.SUB: lambda b, x, y: b.fsub(x, y),
    Op.MUL: lambda b, x, y: b.fmul(x, y),
    Op.DIV: lambda b, x, y: b.fdiv(x, y),
}


def pick(b: ll.IRBuilder, table: list[float], index: ll.Value) -> ll.Value:
    """table[index] per lane: a 32-entry float table, a vector of i32 indices in [0, 32) (or one
    i32), through one AVX-512 two-register permute (narrower values widened to 16 lanes)."""
    v16i = ll.VectorType(I32, 16)
    permute = declared(b.module, "llvm.x86.avx512.vpermi2var.ps.512", LANES16, [LANES16, v16i, LANES16])
    width = index.type.count if isinstance(index.type, ll.VectorType) else 1
    wide = splat(b, index, 16) if width == 1 else to_lanes(b, index, 16)
    picked = b.call(permute, [ll.Constant(LANES16, table[:16]), wide, ll.Constant(LANES16, table[16:])])
    return b.extract_element(picked, I32(0)) if width == 1 else to_lanes(b, picked, width)


def to_lanes(b: ll.IRBuilder, v: ll.Value, lanes: int) -> ll.Value:
    """Vector v as `lanes` lanes: wider, its lanes repeated; narrower, its first ones."""
    width = v.type.count
    if width == lanes:
        return v
    return b.shuffle_vector(v, v, ll.Constant(ll.VectorType(I32, lanes), [i % width for i in range(lanes)]))


def lane_types(x: ll.Value) -> tuple[Callable[[ll.Type], ll.Type], Callable[[ll.Type, float], ll.Constant]]:
    """For a per-lane function of x (one value or a vector): the type of x's shape with another
    element type, and a constant of that shape (its element type, its value)."""
    width = x.type.count if isinstance(x.type, ll.VectorType) else 1
    shaped = (lambda t: ll.VectorType(t, width)) if width > 1 else (lambda t: t)

    def const(ty: ll.Type, v: float) -> ll.Constant:
        return ll.Constant(shaped(ty), [v] * width) if width > 1 else ll.Constant(ty, v)

    return shaped, const


def _bits(words: str) -> list[float]:
    """float32 values from their bits (hex words), padded with zeros to 32 entries."""
    values = [struct.unpack("<f", struct.pack("<I", int(w, 16)))[0] for w in words.split()]
    return values + [0.0] * (32 - len(values))


# oneDNN's table for gelu's erf form (jit_uni_eltwise_injector.cpp, gelu_erf_minimax_pol; oneDNN is
# under the Apache License 2.0): the coefficient of each degree (0 to 5) of 25 polynomials in |x|,
# as float32 bits. Entry 23 is the constant 1 (erf beyond its bound), entry 24 is |x| itself (where
# NaN lands).
GELU_ERF_TABLE = [
    _bits(words)
    for words in (
        "a6f2cb94 32827792 3381cc0c 34523d4a 351ac44d 35f36d88 36ee8229 37b8a3bb 3867a213 3940033b 3a2a5a1d 3ae35863 "
        "3b7828f2 3c08b14b 3c515ed3 bb503236 bd8d8e5e be8abcd9 bf0c19a2 beccb328 3e176ced 3f470d99 3f7abb28 3f800000 0",
        "3f4c422a 3f4c421f 3f4c4207 3f4c41cb 3f4c413b 3f4c3fad 3f4c3a2f 3f4c2d40 3f4c146a 3f4bc341 3f4ad08c 3f48f8cf "
        "3f45fac7 3f404e07 3f3b980f 3f48dff3 3f78b21b 3fbb0704 40019c32 3fe536d6 3f81331e 3e6c8684 3c98f936 0 3f800000",
        "b62173f4 3735e4cf 37f2ff89 388c23be 3917535c 39ab2ab0 3a60fadb 3af9b960 3b6e5491 3c0a4ec5 3ca5aa8c 3d2138d9 "
        "3d8737d4 3ddfb660 3e0f27ab 3d94004b be0efdeb bf1d96c3 bf89db58 bf6d9897 bef69fb8 bdc4f8a8 bbde6422 0 0",
        "be081a19 be084570 be08639b be089837 be08f409 be09ab95 be0b66d0 be0e400a be124df8 be1bde02 be2f19c9 be4931bf "
        "be685fbc be89c95f be96cbca be8044aa be0550f2 3dcfd6a1 3e94c826 3e79345f 3decec91 3ca46568 3aa1e00a 0 0",
        "ba3d61db 39f097a3 3a5845dc 3ab1fa35 3b0cefb8 3b653ab6 3bcae527 3c221712 3c6c5840 3cc0a703 3d1dcc19 3d63656d "
        "3d955907 3dbf9910 3dd53f69 3db7dcef 3d639ebe ba6ede48 bd22be69 bd041cf1 bc64f5ab bb097a32 b8ebf380 0 0",
        "3cb7d80c 3c9b6050 3c978d11 3c92e850 3c8d058b 3c848454 3c6cd623 3c4c824b 3c2a7935 3be0b390 3b0651ac bb232f53 "
        "bbd42fa0 bc2c5366 bc492c9e bc2a7aa6 bbd55d04 ba823a76 3b102aa8 3ae25a7e 3a31f792 38b84375 3689bb5a 0 0",
    )
]
GELU_ERF_BOUND = 0x40B15CEE  # the bits of the |x| beyond which erf(x / sqrt 2) is 1 (entry 23)


Element = Callable[[ll.IRBuilder, ll.Value], ll.Value]  # a per-lane function of one float or a vector


def per_width(b: ll.IRBuilder, x: ll.Value, name: str, element: Element) -> ll.Value:
    """A call of the module's function `name`_<x's width> computing element(x), defined on first
    use: a loop written out in full calls it at every step, where the ~40 operations of the
    exact GELU inline made ConvNeXt-atto's code take 0.5 s more to generate."""
    name = f"{name}_{x.type.count if isinstance(x.type, ll.VectorType) else 1}"
    fn = b.module.globals.get(name)
    if fn is None:
        fn = ll.Function(b.module, ll.FunctionType(x.type, [x.type]), name)
        fn.linkage = "internal"
        body = ll.IRBuilder(fn.append_basic_block("entry"))
        body.ret(element(body, fn.args[0]))
    return b.call(fn, [x])


def gelu_erf(b: ll.IRBuilder, x: ll.Value) -> ll.Value:
    """gelu's erf form of x, as oneDNN computes it (_gelu_erf), through per_width."""
    return per_width(b, x, "braze_gelu_erf", _gelu_erf)


def _gelu_erf(b: ll.IRBuilder, x: ll.Value) -> ll.Value:
    """gelu(x) = x (1 + erf(x / sqrt 2)) / 2 (one float or a vector) as oneDNN's avx512_core
    eltwise kernel computes it, the kernel ATen's gelu calls for a contiguous float32 tensor of
    2 or more elements: the polynomial for |x| is picked by |x|'s bits (plus 0xc21fffff, shifted
    right by 21 with the sign: two bits of mantissa per binade, denormals to entry 1), clamped to
    [1, 24], entry 23 beyond the bound; Horner in FMAs on |x|; x's sign on the result p; then
    (x * (1 + p)) * 0.5. Every step is an IEEE operation on one lane: a lane's bits depend on no
    other, so loops may compute it at any width and fuse it anywhere."""
    shaped, const = lane_types(x)
    ity = shaped(I32)
    i32 = lambda v: const(I32, v)  # noqa: E731
    bits = b.bitcast(x, ity)
    abits = b.and_(bits, i32(0x7FFFFFFF))
    a = b.bitcast(abits, x.type)
    index = b.ashr(b.add(abits, i32(0xC21FFFFF - 2**32)), i32(21))
    index = b.select(b.icmp_signed("<", index, i32(1)), i32(1), index)
    index = b.select(b.icmp_signed(">", index, i32(24)), i32(24), index)
    bound = b.bitcast(i32(GELU_ERF_BOUND), x.type)
    index = b.select(b.fcmp_ordered("<", bound, a), i32(23), index)
    p = pick(b, GELU_ERF_TABLE[5], index)
    for degree in range(4, -1, -1):
        p = fma(b, p, a, pick(b, GELU_ERF_TABLE[degree], index))
    p = b.bitcast(b.xor(b.bitcast(p, ity), b.and_(bits, i32(-(2**31)))), x.type)
    return b.fmul(b.fmul(x, b.fadd(p, const(F32, 1.0))), const(F32, 0.5))


F64 = ll.DoubleType()


def mkl_tanh(b: ll.IRBuilder, x: ll.Value) -> ll.Value:
    """tanh of x as MKL's generic kernel computes it (_mkl_tanh on MKL's coefficients,
    jit.mkl_tanh_table: used only where they were read), through per_width."""
    return per_width(b, x, "braze_mkl_tanh", lambda body, v: _mkl_tanh(body, v, jit.mkl_tanh_table()))


def _mkl_tanh(b: ll.IRBuilder, x: ll.Value, table: list[float]) -> ll.Value:
    """tanh(x) (one float or a vector) as MKL's generic vmsTanh kernel (`EX`, the one it runs on
    AMD CPUs) computes it with ATen's mode: the degree-7 polynomial for |x| is picked by |x|'s
    bits (masked to two bits of mantissa per binade, from 0x3de00000 on; entry 26 from 0x41200000
    on), evaluated in double by Horner with separate multiplies and adds on |x| widened, rounded
    to float, x's sign bit or-ed in; |x| from 0x7f200000 on: NaN + NaN for NaN, else +-1. Every
    step is an IEEE operation on one lane, so loops may compute it at any width and fuse it."""
    vec, const = lane_types(x)
    i32 = lambda v: const(I32, v)  # noqa: E731
    bits = b.bitcast(x, vec(I32))
    masked = b.and_(bits, i32(0x7FE00000))
    above = b.lshr(b.sub(masked, i32(0x3DE00000)), i32(21))
    index = b.select(b.icmp_signed(">", masked, i32(0x3DE00000)), above, i32(0))
    index = b.select(b.icmp_signed(">", masked, i32(0x41200000)), i32(26), index)
    a = b.fpext(b.bitcast(b.and_(bits, i32(0x7FFFFFFF)), x.type), vec(F64))
    column = lambda k: [table[8 * row + k] for row in range(len(table) // 8)]  # noqa: E731
    # With every degree-7 coefficient 0 (this wheel's table) the first step, 0 * |x| + c6, is c6
    # itself (|x| finite here; where it is not the result is special's) unless c6 is -0.
    top = 6 if not any(column(7)) and not any(math.copysign(1.0, c) < 0 and c == 0 for c in column(6)) else 7
    p = _pick_double(b, column(top), index)
    for k in range(top - 1, -1, -1):
        p = b.fadd(b.fmul(p, a), _pick_double(b, column(k), index))
    p = b.bitcast(b.or_(b.bitcast(b.fptrunc(p, x.type), vec(I32)), b.and_(bits, i32(-(2**31)))), x.type)
    one = b.select(b.icmp_signed("<", bits, i32(0)), const(F32, -1.0), const(F32, 1.0))
    special = b.select(b.fcmp_unordered("uno", x, x), b.fadd(x, x), one)
    return b.select(b.icmp_signed(">", masked, i32(0x7F000000)), special, p)


def _pick_double(b: ll.IRBuilder, column: list[float], index: ll.Value) -> ll.Value:
    """column[index] per lane: a table of up to 32 doubles, a vector of i32 indices (or one i32),
    up to 8 lanes through two AVX-512 two-register permutes and a select (a gather of doubles
    was 2.9x slower on Zen 4); one lane through a load from a constant array."""
    if not isinstance(index.type, ll.VectorType):
        ty = ll.ArrayType(F64, len(column))
        array = ll.GlobalVariable(b.module, ty, b.module.get_unique_name("braze_doubles"))
        array.initializer, array.global_constant, array.linkage = ll.Constant(ty, column), True, "internal"
        return b.load(b.gep(array, [I64(0), b.zext(index, I64)], source_etype=ty), typ=F64)
    width, v8, i8 = index.type.count, ll.VectorType(F64, 8), ll.VectorType(I64, 8)
    if width > 8:
        raise ValueError(f"{width} lanes: _pick_double picks up to 8")
    permute = declared(b.module, "llvm.x86.avx512.vpermi2var.pd.512", v8, [v8, i8, v8])
    padded = column + [0.0] * (32 - len(column))
    quarters = [ll.Constant(v8, padded[i : i + 8]) for i in range(0, 32, 8)]
    idx = b.zext(to_lanes(b, index, 8), i8)
    low, high = (b.call(permute, [quarters[i], idx, quarters[i + 1]]) for i in (0, 2))
    return to_lanes(b, b.select(b.icmp_unsigned("<", idx, ll.Constant(i8, [16] * 8)), low, high), width)


def gather(b: ll.IRBuilder, base: ll.Value, first: ll.Value, step: ll.Value, mask: ll.Value) -> ll.Value:
    """16 floats at base[first + lane * step] (lanes outside mask: not read, and 0)."""
    lanes = ll.Constant(ll.VectorType(I64, 16), list(range(16)))
    offsets = b.mul(b.add(splat(b, first, 16), b.mul(lanes, splat(b, step, 16))), splat(b, I64(4), 16))
    pointers = b.inttoptr(b.add(splat(b, b.ptrtoint(base, I64), 16), offsets), ll.VectorType(PTR, 16))
    load = declared(b.module, "llvm.masked.gather.v16f32.v16p0", LANES16, [pointers.type, I32, mask.type, LANES16])
    return b.call(load, [pointers, I32(4), mask, ll.Constant(LANES16, [0.0] * 16)])


def maximum(b: ll.IRBuilder, x: ll.Value, y: ll.Value) -> ll.Value:
    """ATen's vec::maximum: max_ps(x, y) (y where they compare equal or unordered), all-ones NaN
    where either is NaN."""
    ty = x.type
    n = ty.count if isinstance(ty, ll.VectorType) else None
    ones = b.bitcast(ll.Constant(ll.VectorType(I32, n), [-1] * n) if n else I32(-1), ty)
    return b.select(b.fcmp_unordered("uno", x, y), ones, b.select(b.fcmp_ordered(">", x, y), x, y))


def float32(v: float) -> float:
    """A double rounded to float32, as `static_cast<float>` of a C++ constant."""
    return ctypes.c_float(v).value


def combine_lanes(b: ll.IRBuilder, v: ll.Value, op: Callable[[ll.Value, ll.Value], ll.Value]) -> ll.Value:
    """op over the 16 lanes as ATen's vec::reduce_all ends: lanes i and i^8, then i^4, i^2, i^1
    combined (op(v, shuffled v) each time); lane 0."""
    for step in (8, 4, 2, 1):
        v = op(v, b.shuffle_vector(v, v, ll.Constant(ll.VectorType(I32, 16), [i ^ step for i in range(16)])))
    return b.extract_element(v, I32(0))


def smaller(b: ll.IRBuilder, u: ll.Value, v: ll.Value) -> ll.Value:
    """The smaller of two integers."""
    return b.select(b.icmp_signed("<", u, v), u, v)


def split_between_threads(
    module: ll.Module, name: str, chunk: ll.Function, grain: Callable[[ll.IRBuilder, ll.Value, ll.Value], ll.Value]
) -> None:
    """Define `void name(x, y, n)`: chunk(x, y, n) over n contiguous float32 elements, split
    as ATen's parallel_for splits them: min(threads, ceil(n / grain)) equal chunks, one per
    OpenMP thread, or one call where n < grain or there is one thread. `grain(b, n, threads)`
    gives the grain."""
    max_threads = declared(module, "omp_get_max_threads", I32, [])
    thread_num = declared(module, "omp_get_thread_num", I32, [])
    gomp = declared(module, "GOMP_parallel", VOID, [PTR, PTR, I32, I32])

    team = ll.Function(module, ll.FunctionType(VOID, [PTR]), f"{name}_team")
    team.linkage = "internal"
    tb = ll.IRBuilder(team.append_basic_block("entry"))
    word = lambda i, ty: tb.load(tb.gep(team.args[0], [I64(i)], source_etype=I64), typ=ty)  # noqa: E731
    x, y, n, size = word(0, PTR), word(1, PTR), word(2, I64), word(3, I64)
    start = tb.mul(tb.sext(tb.call(thread_num, []), I64), size)
    with tb.if_then(tb.icmp_signed("<", start, n)):
        stop = tb.add(start, size)
        stop = tb.select(tb.icmp_signed("<", stop, n), stop, n)
        src, dst = (tb.gep(p, [start], source_etype=F32) for p in (x, y))
        tb.call(chunk, [src, dst, tb.sub(stop, start)])
    tb.ret_void()

    f = ll.Function(module, ll.FunctionType(VOID, [PTR, PTR, I64]), name)
    x, y, n = f.args
    b = ll.IRBuilder(f.append_basic_block("entry"))
    threads = b.sext(b.call(max_threads, []), I64)
    g = grain(b, n, threads)
    parts = b.sdiv(b.add(n, b.sub(g, I64(1))), g)
    parts = b.select(b.icmp_signed("<", threads, parts), threads, parts)
    serial = b.or_(b.icmp_signed("<", n, g), b.icmp_signed("==", threads, I64(1)))
    with b.if_else(serial) as (one, many):
        with one:
            b.call(chunk, [x, y, n])
        with many:
            args = b.alloca(I64, size=I64(4))
            size = b.sdiv(b.add(n, b.sub(parts, I64(1))), parts)
            for i, v in enumerate((b.ptrtoint(x, I64), b.ptrtoint(y, I64), n, size)):
                b.store(v, b.gep(args, [I64(i)], source_etype=I64))
            b.call(gomp, [team, args, b.trunc(parts, I32), I32(0)])
    b.ret_void()
