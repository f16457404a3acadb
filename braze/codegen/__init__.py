"""Stage 4, codegen: native kernels of a planned graph become one LLVM module.

Each run of consecutive native kernels (FUSED loops, GEMMs with their bias prologue and fused
epilogue) is one function `void segN(ptr table)`; `table` holds the base address of every
buffer the segment touches, filled by the runtime. Shapes and strides are constants, so LLVM
sees fixed trip counts and vectorises the innermost loop; in a shape-generic program some are
polynomials of the symbols (dims.Expr), whose values the table holds too, and the code computes
them once per kernel. No fast-math flags: every float op is the IEEE op ATen performs, in the
same order, so results are bit-identical to eager.

    __init__.py   ModuleBuilder: a segment's kernels, in order: elementwise loops (their nest
                  and threads), calls of the kernel libraries (rows.py, sleef.py, pool.py),
                  MKL's vector math, embedding row copies
    gemms.py      its GEMMs and batched GEMMs: MKL's calls as ATen makes them, or braze's own
                  kernel (gemmkernel.py) with the epilogue on each thread's rows
    loops.py      the elementwise loop nest and each element's arithmetic; LLVM types and the
                  helpers every kernel writer shares
"""

from __future__ import annotations

import contextlib
import ctypes
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import llvmlite.ir as ll
import torch

from .. import jit
from ..dims import Dim, Expr
from ..ir import Node, Op, TensorMeta
from .gemms import GemmEmitter
from .loops import (
    F32,
    I1,
    I8,
    I32,
    I64,
    LANES16,
    PTR,
    VOID,
    WIDTH,
    Access,
    Element,
    _BodyEmitter,
    _bstrides,
    _loop_dims,
    _nest,
    combine_lanes,
    counted_loop,
    declared,
    float32,
    fma,
    gather,
    gelu_erf,
    lanes_below,
    masked_load,
    masked_store,
    maximum,
    mkl_tanh,
    per_width,
    pieces,
    smaller,
    splat,
    split_between_threads,
    to_lanes,
)

# The bits of a program's error word (its table's, runtime.Layout.error): an embedding's index out
# of range (the call raises IndexError), a kernel without the scratch memory it allocates for
# itself (attention.py; torch.OutOfMemoryError)
BAD_INDEX, OUT_OF_MEMORY = 1, 2

__all__ = [
    "BAD_INDEX",
    "OUT_OF_MEMORY",
    "F32",
    "I1",
    "I8",
    "I32",
    "I64",
    "LANES16",
    "PTR",
    "VOID",
    "WIDTH",
    "Access",
    "ModuleBuilder",
    "Segment",
    "combine_lanes",
    "counted_loop",
    "declared",
    "float32",
    "fma",
    "gather",
    "gelu_erf",
    "lanes_below",
    "masked_load",
    "masked_store",
    "maximum",
    "mkl_tanh",
    "per_width",
    "pieces",
    "run_elementwise",
    "smaller",
    "splat",
    "split_between_threads",
    "to_lanes",
]


@dataclass
class Segment:
    name: str
    kernels: list[Node]


def _width(body: list[Node], inner: int | ll.Value) -> int:
    """A vectorised loop's lanes: 16 for a body with oneDNN's GELU, fast mode's tanh or Sleef's
    16-lane functions, whose table lookups or calls 8-lane vectors widen and narrow again (the
    GELU alone 0.53 vs 0.31 ns an element; each lane's bits are the same at any width), where the
    inner loop has 16 elements (and no MKL tanh, whose double-precision lookups take 8 lanes at
    most); else WIDTH."""
    if not any(n.op in (Op.GELU_ERF, Op.FAST_TANH, Op.SLEEF) for n in body) or any(n.op is Op.TANH for n in body):
        return WIDTH
    return 2 * WIDTH if not isinstance(inner, int) or inner >= 2 * WIDTH else WIDTH


def run_elementwise(name: str, element: Element, x: torch.Tensor, wide: bool = False) -> torch.Tensor:
    """element (a per-lane function: gelu_erf, mkl_tanh) over a contiguous float32 tensor, (with
    `wide`) 2 WIDTH lanes at a time, then WIDTH, then one at a time (the widths braze's loops
    compute it at: _width), by the kernel `name`, built once per process: for the probes and
    tests of such functions."""

    def write(module: ll.Module) -> None:
        f = ll.Function(module, ll.FunctionType(VOID, [PTR, PTR, I64]), name)
        src, dst, n = f.args
        b = ll.IRBuilder(f.append_basic_block("entry"))
        at = lambda p, i: b.gep(p, [i], source_etype=F32)  # noqa: E731
        start = I64(0)
        for width in (2 * WIDTH, WIDTH, 1) if wide else (WIDTH, 1):
            end = b.and_(n, I64(-width))
            with counted_loop(b, start, end, width) as i:
                ty = ll.VectorType(F32, width) if width > 1 else F32
                b.store(element(b, b.load(at(src, i), typ=ty, align=4)), at(dst, i), align=4)
            start = end
        b.ret_void()

    address = jit.kernel(name, write, light=True)  # (probes' and tests' code: its speed matters little)
    kernel = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)(address)
    y = torch.empty_like(x)
    kernel(x.data_ptr(), y.data_ptr(), x.numel())
    return y


class ModuleBuilder(GemmEmitter):
    """One LLVM module; `prefix` starts every global name in it (programs share one JIT)."""

    def __init__(
        self,
        prefix: str,
        slot_of: Callable[[str], Access],
        parallel_threshold: int,
        blas_clock: bool = False,
        symbol_slots: tuple[int, ...] = (),
        error_slot: int | None = None,
    ) -> None:
        self.module = ll.Module(name=prefix)
        self.error_slot = error_slot  # the table's word kernels set (BAD_INDEX, OUT_OF_MEMORY)
        self.symbol_slots = symbol_slots  # the table slot holding each symbol's value
        self.prefix = prefix
        self.slot_of = slot_of
        self.parallel_threshold = parallel_threshold
        self._used: dict[str, int] = {}
        # Elements of the loops codegen could not vectorise itself (strided innermost accesses):
        # what LLVM's optimiser could still speed up (runtime decides whether to run it).
        self.scalar_work: list[Dim] = []  # elements per call of the loops left scalar (strided)
        self.scalar_loops: list[str] = []  # their functions: the only ones LLVM's optimiser gets
        self.clock: ll.GlobalVariable | None = None  # cycles spent in BLAS calls (config.blas_clock)
        if blas_clock:
            self.clock = ll.GlobalVariable(self.module, I64, f"{prefix}_blas_cycles")
            self.clock.initializer = I64(0)
            now = ll.Function(self.module, ll.FunctionType(I64, []), f"{prefix}_cycles")
            nb = ll.IRBuilder(now.append_basic_block("entry"))
            nb.ret(self._cycles(nb))

    def declare(self, name: str, ret: ll.Type, args: list[ll.Type]) -> ll.Function:
        return declared(self.module, name, ret, args)

    def kernel(self, library: Any, name: str, args: list[ll.Type]) -> ll.Function:
        """Kernel `name` of a kernel library (rows.py, sleef.py, pool.py), which builds it into the
        JIT first if no probe or program has needed it yet, declared here to be called by name."""
        library.library(name)
        return self.declare(name, VOID, args)

    def unique(self, base: str) -> str:
        self._used[base] = self._used.get(base, -1) + 1
        return f"{base}{self._used[base]}"

    def _cycles(self, b: ll.IRBuilder) -> ll.Value:
        return b.call(self.declare("llvm.readcyclecounter", I64, []), [])

    @contextlib.contextmanager
    def _clocked(self, b: ll.IRBuilder) -> Iterator[None]:
        """With the clock on (config.blas_clock), add the cycles of the GEMM code emitted inside
        (a BLAS call, braze's GEMM kernel) to the counter."""
        start = self._cycles(b) if self.clock is not None else None
        yield
        if self.clock is not None:
            took = b.sub(self._cycles(b), start)
            b.store(b.add(b.load(self.clock, typ=I64), took), self.clock)

    def _blas(
        self,
        b: ll.IRBuilder,
        name: str,
        types: list[ll.Type],
        args: list[ll.Value],
        one_thread: bool | ll.Value = False,
    ) -> None:
        """Call BLAS routine `name`, on one thread if asked (this thread's MKL setting is set
        around the call and restored; a value: asked per call); with the clock on, add the
        cycles the call itself took to the counter."""
        threads = self.declare(jit.MKL_SET_THREADS, I32, [I32]) if one_thread is not False else None
        before: ll.Value | None = None
        if one_thread is True:
            before = b.call(threads, [I32(1)])
        elif threads is not None:
            with b.goto_entry_block():
                saved = b.alloca(I32)
            with b.if_then(one_thread):
                b.store(b.call(threads, [I32(1)]), saved)
        with self._clocked(b):
            b.call(self.declare(name, VOID, types), args)
        if before is not None:
            b.call(threads, [before])
        elif threads is not None:
            with b.if_then(one_thread):
                b.call(threads, [b.load(saved, typ=I32)])

    def cstring(self, name: str, text: str) -> ll.GlobalVariable:
        """A NUL-terminated string constant (emitted once per name)."""
        if name in self.module.globals:
            return self.module.globals[name]
        data = bytearray(text.encode() + b"\0")
        g = ll.GlobalVariable(self.module, ll.ArrayType(I8, len(data)), name)
        g.initializer = ll.Constant(ll.ArrayType(I8, len(data)), data)
        g.global_constant = True
        return g

    def dim(self, b: ll.IRBuilder, table: ll.Value, x: Dim) -> ll.Value:
        """The value of a size, stride or offset (an Expr: computed from the symbols in the table)."""
        if isinstance(x, int):
            return I64(x)
        syms = {j: b.load(b.gep(table, [I64(self.symbol_slots[j])], source_etype=PTR), typ=I64) for j in x.symbols()}
        total: ll.Value | None = None
        for m, c in x.terms:
            factors = [syms[j] for j, e in enumerate(m) for _ in range(e)]
            term = factors[0] if c == 1 and factors else I64(c)  # (a constant term has no factor)
            for f in factors[1:] if c == 1 and factors else factors:
                term = b.mul(term, f)
            total = term if total is None else b.add(total, term)
        assert total is not None
        return total

    def _i32(self, b: ll.IRBuilder, table: ll.Value, x: Dim) -> ll.Value:
        return I32(x) if isinstance(x, int) else b.trunc(self.dim(b, table, x), I32)

    def pointer(self, b: ll.IRBuilder, table: ll.Value, acc: Access) -> ll.Value:
        """The address of an access's first element."""
        base = b.load(b.gep(table, [I64(acc.slot)], source_etype=PTR), typ=PTR)
        return b.gep(base, [self.dim(b, table, acc.meta.offset)], source_etype=F32)

    def emit_dims(self, derived: list[tuple[Expr, int]]) -> str:
        """`{prefix}_dims(table)`: each derived value's expression into its slot of the table
        (the entry calls it once the symbols are bound)."""
        fn = ll.Function(self.module, ll.FunctionType(VOID, [PTR]), f"{self.prefix}_dims")
        b = ll.IRBuilder(fn.append_basic_block("entry"))
        for expr, slot in derived:
            b.store(self.dim(b, fn.args[0], expr), b.gep(fn.args[0], [I64(slot)], source_etype=PTR))
        b.ret_void()
        return fn.name

    # --- segments ----------------------------------------------------------------------------
    def segment(self, seg: Segment) -> ll.Function:
        fn = ll.Function(self.module, ll.FunctionType(VOID, [PTR]), f"{self.prefix}_{seg.name}")
        b = ll.IRBuilder(fn.append_basic_block("entry"))
        table = fn.args[0]
        for k in seg.kernels:
            emit = _EMITTERS.get(k.op)
            if emit is not None:
                getattr(self, emit)(b, table, k)
            else:  # an elementwise loop (FUSED, or a single elementwise op)
                self._loop_kernel(b, table, k.meta, self.slot_of(k.name), k.body, {})
        b.ret_void()
        return fn

    # --- elementwise loops -------------------------------------------------------------------
    def _loop_kernel(
        self,
        b: ll.IRBuilder,
        table: ll.Value,
        shape_meta: TensorMeta,
        out: Access,
        body: tuple[Node, ...],
        override: dict[str, Access],
    ) -> None:
        """Emit `body` over `shape_meta.shape`, storing the last value at `out`."""
        if shape_meta.numel == 0:
            return
        kern, loops = self._loop_function(shape_meta, out, body, override)
        self._split(b, table, kern, shape_meta.numel, loops[0].size if loops else 1)

    def _loop_function(
        self, shape_meta: TensorMeta, out: Access, body: tuple[Node, ...], override: dict[str, Access]
    ) -> tuple[ll.Function, list]:
        """`body`'s loop nest as a function (table, lo, hi) of its outermost loop's range, and the
        loops (outer to inner)."""
        inner = {n.name for n in body}
        names = dict.fromkeys(i for n in body for i in n.value_inputs() if i not in inner)
        operands = {i: override.get(i) or self.slot_of(i) for i in names}
        loops = _loop_dims(shape_meta.shape, [out.meta] + [a.meta for a in operands.values()], out.meta)
        kern = ll.Function(self.module, ll.FunctionType(VOID, [PTR, I64, I64]), self.unique("loop"))
        kern.linkage = "internal"
        kb = ll.IRBuilder(kern.append_basic_block("entry"))
        tbl, lo, hi = kern.args
        value = lambda x: x if isinstance(x, int) else self.dim(kb, tbl, x)  # noqa: E731
        bases = {k: kb.load(kb.gep(tbl, [I64(a.slot)], source_etype=PTR), typ=PTR) for k, a in operands.items()}
        out_base = kb.load(kb.gep(tbl, [I64(out.slot)], source_etype=PTR), typ=PTR)
        if any(a.slot == out.slot for a in operands.values()):
            out_base = _opaque(kb, out_base)
        accesses = {
            k: (bases[k], tuple(map(value, _bstrides(a.meta, shape_meta.shape))), value(a.meta.offset))
            for k, a in operands.items()
        }
        accesses["__out__"] = (out_base, tuple(map(value, out.meta.stride)), value(out.meta.offset))
        sizes = [value(d.size) for d in loops]

        # Vectorise the innermost loop ourselves when every access walks it contiguously or
        # not at all (broadcast): LLVM then needs no loop optimiser, which is most of its time.
        innermost = loops[-1].axis if loops else None
        vector = innermost is not None and all(acc[1][innermost] in (0, 1) for acc in accesses.values())
        vector = vector and (not isinstance(sizes[-1], int) or sizes[-1] >= WIDTH)
        if not vector:
            self.scalar_work.append(shape_meta.numel)
            self.scalar_loops.append(kern.name)
        emitter = _BodyEmitter(body, accesses, loops, operands, out.meta.dtype)
        _nest(kb, sizes, lo, hi, emitter.emit, _width(body, sizes[-1]) if vector else 1)
        kb.ret_void()
        return kern, loops

    def _split(self, b: ll.IRBuilder, table: ll.Value, kern: ll.Function, numel: Dim, total: Dim) -> None:
        """Run kern(table, lo, hi) over [0, total): on ATen's threads from `numel` elements up,
        where eager's loops split (in a generic program, decided per call)."""
        if isinstance(numel, int) and isinstance(total, int):
            if numel >= self.parallel_threshold and total > 1:
                self._parallel_call(b, table, kern, I64(total))
            else:
                b.call(kern, [table, I64(0), I64(total)])
            return
        count, n = self.dim(b, table, numel), self.dim(b, table, total)
        wide = b.and_(b.icmp_signed(">=", count, I64(self.parallel_threshold)), b.icmp_signed(">", n, I64(1)))
        with b.if_else(wide) as (parallel, serial):
            with parallel:
                self._parallel_call(b, table, kern, n)
            with serial:
                b.call(kern, [table, I64(0), n])

    @contextlib.contextmanager
    def _ranged(
        self, b: ll.IRBuilder, table: ll.Value, base: str, numel: Dim, total: Dim
    ) -> Iterator[tuple[ll.IRBuilder, ll.Value, ll.Value, ll.Value]]:
        """`with self._ranged(...) as (kb, table, lo, hi):` writes, with kb, a kernel that works
        on [lo, hi), which then runs over [0, total) as _split divides it."""
        kern = ll.Function(self.module, ll.FunctionType(VOID, [PTR, I64, I64]), self.unique(base))
        kern.linkage = "internal"
        kb = ll.IRBuilder(kern.append_basic_block("entry"))
        yield (kb, *kern.args)
        kb.ret_void()
        self._split(b, table, kern, numel, total)

    def _parallel_call(self, b: ll.IRBuilder, table: ll.Value, kern: ll.Function, total: ll.Value) -> None:
        """Split the outer loop across the OpenMP team ATen uses (torch.get_num_threads())."""
        wrap = ll.Function(self.module, ll.FunctionType(VOID, [PTR]), self.unique(kern.name + "_omp"))
        wrap.linkage = "internal"
        wb = ll.IRBuilder(wrap.append_basic_block("entry"))
        tid = wb.sext(wb.call(self.declare("omp_get_thread_num", I32, []), []), I64)
        nth = wb.sext(wb.call(self.declare("omp_get_num_threads", I32, []), []), I64)
        # The team's argument: the table and the trip count (a constant, or computed per call).
        tbl = wb.load(wb.gep(wrap.args[0], [I64(0)], source_etype=PTR), typ=PTR)
        count = wb.load(wb.gep(wrap.args[0], [I64(1)], source_etype=PTR), typ=I64)
        chunk = wb.sdiv(wb.add(count, wb.sub(nth, I64(1))), nth)
        lo = wb.mul(tid, chunk)
        hi = wb.select(wb.icmp_signed("<", wb.add(lo, chunk), count), wb.add(lo, chunk), count)
        with wb.if_then(wb.icmp_signed("<", lo, hi)):
            wb.call(kern, [tbl, lo, hi])
        wb.ret_void()
        with b.goto_entry_block():
            team = b.alloca(PTR, size=I64(2))
        b.store(table, team)
        b.store(total, b.gep(team, [I64(1)], source_etype=PTR))
        gomp = self.declare("GOMP_parallel", VOID, [PTR, PTR, I32, I32])
        b.call(gomp, [wrap, team, I32(0), I32(0)])

    def _cat(self, b: ll.IRBuilder, table: ll.Value, k: Node) -> None:
        """One copy loop per input, into its slice of the output (ATen's cat: bits unchanged)."""
        out, dim, start = self.slot_of(k.name), k.attrs["dim"], 0
        for name in k.inputs:
            shape = self.slot_of(name).meta.shape
            where = out.meta.offset + start * out.meta.stride[dim]
            part = TensorMeta(shape, out.meta.stride, where, out.meta.dtype)
            self._loop_kernel(b, table, part, Access(out.slot, part), (Node(k.name, Op.COPY, (name,), part),), {})
            start += shape[dim]

    def _vml(self, b: ll.IRBuilder, table: ll.Value, k: Node) -> None:
        """MKL's vector math function attrs['fn'] over the elements (ATen's exp, tanh, erf): one
        call per thread's share of them, split as loops are. The output is dense, as ATen lays it
        out; an input laid out otherwise is first copied into it, and the call runs in place."""
        out, src = self.slot_of(k.name), self.slot_of(k.inputs[0])
        if k.meta.numel == 0:
            return
        if src.meta.stride != out.meta.stride or not out.meta.dense:
            self._loop_kernel(b, table, out.meta, out, (Node(k.name, Op.COPY, (k.inputs[0],), out.meta),), {})
            src = out
        with self._ranged(b, table, "vml", k.meta.numel, k.meta.numel) as (kb, tbl, lo, hi):
            vml = self.declare(k.attrs["fn"], VOID, [I32, PTR, PTR, I64])
            start = [kb.gep(self.pointer(kb, tbl, a), [lo], source_etype=F32) for a in (src, out)]
            kb.call(vml, [kb.trunc(kb.sub(hi, lo), I32), *start, I64(jit.VML_MODE)])

    def _activation(self, b: ll.IRBuilder, table: ll.Value, k: Node) -> None:
        """sleef.py's kernel over the elements, split between threads as ATen splits them."""
        from .. import sleef  # built on this module's helpers

        fn = self.kernel(sleef, sleef.name(k.attrs["fn"]), [PTR, PTR, I64])
        ptrs = [self.pointer(b, table, self.slot_of(name)) for name in (k.inputs[0], k.name)]
        b.call(fn, [*ptrs, self.dim(b, table, k.meta.numel)])

    def _rows(self, b: ll.IRBuilder, table: ll.Value, k: Node) -> None:
        """rows.py's kernel over the rows, split between ATen's threads as its elementwise loops
        are (each row is computed whole by one thread, as in ATen: the split cannot change bits)."""
        from .. import rows  # built on this module's helpers

        with self._ranged(b, table, k.op.value, k.meta.numel, k.attrs["rows"]) as (kb, tbl, lo, hi):
            null = ll.Constant(PTR, None)  # (an absent weight)
            ptrs = [null if v is None else self.pointer(kb, tbl, self.slot_of(v)) for v in (*k.inputs, k.name)]
            n = self.dim(kb, tbl, k.attrs["n"])
            if k.op is Op.LAYER_NORM:
                fn = self.kernel(rows, rows.LAYER_NORM, [PTR, PTR, PTR, PTR, I64, I64, I64, F32])
                kb.call(fn, [*ptrs, n, lo, hi, F32(k.attrs["eps"])])
            elif k.op is Op.SUM:
                fn = self.kernel(rows, rows.SUM, [PTR, PTR, I64, I64, I64, I64, ll.IntType(1)])
                total = self.dim(kb, tbl, k.attrs["rows"])
                kb.call(fn, [*ptrs, n, lo, hi, total, ll.IntType(1)(int(k.attrs["mean"]))])
            elif k.op is Op.RMS_NORM:
                fn = self.kernel(rows, rows.RMS_NORM, [PTR, PTR, PTR, I64, I64, I64, F32])
                kb.call(fn, [*ptrs, n, lo, hi, F32(k.attrs["eps"])])
            else:
                name = rows.LOG_SOFTMAX if k.attrs["log"] else rows.SOFTMAX
                kb.call(self.kernel(rows, name, [PTR, PTR, I64, I64, I64]), [*ptrs, n, lo, hi])

    def _max_pool(self, b: ll.IRBuilder, table: ll.Value, k: Node) -> None:
        """pool.py's kernel over the [H, W] planes (or the output rows of channels-last pixels),
        split between ATen's threads as loops are (each plane or row is pooled whole by one
        thread: the split cannot change bits)."""
        from .. import pool  # built on this module's helpers

        x, pixels = self.slot_of(k.inputs[0]).meta, k.attrs["pixels"]
        total = math.prod((k.meta.shape[0], k.meta.shape[2]) if pixels else k.meta.shape[:-2])
        with self._ranged(b, table, "max_pool", k.meta.numel, total) as (kb, tbl, lo, hi):
            ptrs = [self.pointer(kb, tbl, self.slot_of(name)) for name in (k.inputs[0], k.name)]
            shape = (*x.shape[-2:], *k.meta.shape[-2:])
            window = [I64(v) for key in ("kernel", "stride", "padding", "dilation") for v in k.attrs[key]]
            sizes = [self.dim(kb, tbl, d) for d in ((x.shape[1],) if pixels else ()) + shape]
            name, n_args = (pool.MAX_POOL_PIXELS, pool.ARGS + 1) if pixels else (pool.MAX_POOL, pool.ARGS)
            fn = self.kernel(pool, name, [PTR, PTR] + [I64] * n_args)
            kb.call(fn, [*ptrs, *sizes, *window, lo, hi])

    def _conv(self, b: ll.IRBuilder, table: ll.Value, k: Node) -> None:
        """directconv.py's kernel over the output rows (of every image), split between threads."""
        from .. import directconv  # built on this module's helpers

        x, out = self.slot_of(k.inputs[0]).meta, k.meta
        rows = math.prod((out.shape[0], out.shape[2]))
        name = directconv.DEPTHWISE if k.attrs["depthwise"] else directconv.FEW
        few = () if k.attrs["depthwise"] else (x.shape[1],)  # its input channels
        # split by multiply-adds, not outputs: ConvNeXt's 7 x 7 depthwise ones of 7 x 7 and 14 x 14
        # pixels (16-31 K outputs, 49 each) ran on one thread while the other waited
        work = out.numel * math.prod(k.attrs["kernel"]) * math.prod(few)
        with self._ranged(b, table, "conv", work, rows) as (kb, tbl, lo, hi):
            ptrs = [self.pointer(kb, tbl, self.slot_of(v)) for v in k.inputs[:2]]
            bias = self.pointer(kb, tbl, self.slot_of(k.inputs[2])) if len(k.inputs) > 2 else ll.Constant(PTR, None)
            y = self.pointer(kb, tbl, self.slot_of(k.name))
            dims_ = [self.dim(kb, tbl, d) for d in (x.shape[2], x.shape[3], out.shape[1], out.shape[2], out.shape[3])]
            window = [I64(v) for key in ("kernel", "stride", "padding") for v in k.attrs[key]]
            fn = self.kernel(directconv, name, [PTR] * 4 + [I64] * (directconv.ARGS + len(few)))
            has_bias = I64(2 if k.attrs.get("bias_last") and len(k.inputs) > 2 else len(k.inputs) - 2)
            kb.call(fn, [*ptrs, bias, y, *dims_, *window, has_bias, lo, hi, *(self.dim(kb, tbl, d) for d in few)])

    def _attention(self, b: ll.IRBuilder, table: ll.Value, k: Node) -> None:
        operands = [self.slot_of(name) for name in (*k.inputs[:3], k.name)]
        mask = self.slot_of(k.inputs[3]) if k.attrs["mask"] else None
        self.attention(b, table, operands, mask, k.attrs)

    def attention(
        self, b: ll.IRBuilder, table: ll.Value, operands: list[Access], mask: Access | None, attrs: dict
    ) -> None:
        """attention.py's kernel (fast mode's, or with attrs["exact"] exact mode's) on q, k, v into
        out (`operands`), over the (batch, head, query) rows, split between threads."""
        from .. import attention  # built on this module's helpers

        (batch, heads, queries, d), (kv_heads, keys) = operands[3].meta.shape, operands[1].meta.shape[1:3]
        numel = operands[3].meta.numel
        with self._ranged(b, table, "attention", numel, batch * heads * queries) as (kb, tbl, lo, hi):
            name = (attention.EXACT_NAMES if attrs.get("exact") else attention.NAMES)[attrs["mask"]]
            fn = self.kernel(attention, name, attention.ARGS)
            dim = lambda x: self.dim(kb, tbl, x)  # noqa: E731
            ptrs = [self.pointer(kb, tbl, a) for a in operands]
            ptrs.append(ll.Constant(PTR, None) if mask is None else self._mask_pointer(kb, tbl, mask))
            strides = [dim(a.meta.stride[i]) for a in operands for i in range(3)]
            strides += [dim(x) for x in _broadcast_strides(mask.meta)[:3]] if mask else [I64(0)] * 3
            group = kb.sdiv(dim(heads), dim(kv_heads))
            sizes = [dim(heads), group, dim(queries), dim(keys), dim(d)]
            flags = [F32(attrs["scale"]), I64(int(attrs["causal"]))]
            assert self.error_slot is not None
            error = kb.gep(tbl, [I64(self.error_slot)], source_etype=PTR)
            kb.call(fn, [*ptrs, *sizes, *strides, *flags, lo, hi, error])

    def _mask_pointer(self, b: ll.IRBuilder, table: ll.Value, mask: Access) -> ll.Value:
        """The address of a mask's first element, boolean (bytes) or float."""
        base = b.load(b.gep(table, [I64(mask.slot)], source_etype=PTR), typ=PTR)
        size = mask.meta.dtype.itemsize
        return b.gep(base, [b.mul(self.dim(b, table, mask.meta.offset), I64(size))], source_etype=I8)

    def _embedding(self, b: ll.IRBuilder, table: ll.Value, k: Node) -> None:
        """Each index's row of the weight copied to the output's next row; an index outside
        [0, rows) sets the table's error word instead (the program raises eager's IndexError)."""
        index, weight = (self.slot_of(name) for name in k.inputs)
        n = math.prod(index.meta.shape)
        assert self.error_slot is not None
        with self._ranged(b, table, "embedding", k.meta.numel, n) as (kb, tbl, lo, hi):
            # Sizes, strides and addresses computed once, before the loop over rows.
            dim = lambda x: self.dim(kb, tbl, x)  # noqa: E731
            base = kb.load(kb.gep(tbl, [I64(index.slot)], source_etype=PTR), typ=PTR)
            ity = I64 if index.meta.dtype == torch.int64 else I32
            src, dst = self.pointer(kb, tbl, weight), self.pointer(kb, tbl, self.slot_of(k.name))
            width, rows, row_stride = dim(k.meta.shape[-1]), dim(k.attrs["rows"]), dim(weight.meta.stride[0])
            row_bytes = kb.mul(width, I64(4))
            layout = [(dim(size), dim(stride)) for size, stride in zip(index.meta.shape, index.meta.stride)]
            offset = dim(index.meta.offset)
            memcpy = self.declare("llvm.memcpy.p0.p0.i64", VOID, [PTR, PTR, I64, I1])
            flag = kb.gep(tbl, [I64(self.error_slot)], source_etype=PTR)
            with counted_loop(kb, lo, hi) as r:
                rest, at = r, offset
                for d in reversed(range(len(layout))):  # position r's element of index
                    size, stride = layout[d]
                    i = kb.urem(rest, size) if d else rest
                    at, rest = kb.add(at, kb.mul(i, stride)), kb.udiv(rest, size) if d else rest
                i = kb.sext(kb.load(kb.gep(base, [at], source_etype=ity), typ=ity), I64)
                with kb.if_else(kb.icmp_unsigned("<", i, rows)) as (ok, bad):
                    with ok:
                        row = kb.gep(src, [kb.mul(i, row_stride)], source_etype=F32)
                        out = kb.gep(dst, [kb.mul(r, width)], source_etype=F32)
                        kb.call(memcpy, [out, row, row_bytes, I1(0)])
                    with bad:
                        kb.atomic_rmw("or", flag, I64(BAD_INDEX), "monotonic")  # threads may race to it


# The ModuleBuilder method that writes each kind of kernel other than elementwise loops.
_EMITTERS = {
    Op.GEMM: "_gemm",
    Op.BMM: "_bmm",
    Op.CAT: "_cat",
    Op.VML: "_vml",
    Op.LAYER_NORM: "_rows",
    Op.SOFTMAX: "_rows",
    Op.SUM: "_rows",
    Op.RMS_NORM: "_rows",
    Op.ACTIVATION: "_activation",
    Op.MAX_POOL: "_max_pool",
    Op.CONV: "_conv",
    Op.IM2COL: "_im2col",
    Op.EMBEDDING: "_embedding",
    Op.ATTENTION: "_attention",
}


def _broadcast_strides(meta: TensorMeta) -> list[Dim]:
    """A mask's strides as broadcast to [batch, heads, queries, keys]: 0 where it has no such
    dimension or its size is 1."""
    pairs = [(0, 1)] * (4 - len(meta.shape)) + list(zip(meta.stride, meta.shape))
    return [0 if size == 1 else stride for stride, size in pairs]


def _opaque(b: ll.IRBuilder, ptr: ll.Value) -> ll.Value:
    """`ptr`, through an empty asm statement, so LLVM cannot tell it equals the pointer it came
    from. An in-place loop needs it: LLVM 22's instruction selection turns `store(select(c, v,
    load p), p)` (relu, clamp, where, in place) into a masked store, vmaskmovps, which is
    microcoded on AMD CPUs: measured 6.5x slower than the plain loop for an in-place relu
    here (llvm-project PR 214187 turns that fold off for Zen, in a later LLVM)."""
    return b.asm(ll.FunctionType(PTR, [PTR]), "", "=r,0", [ptr], False)
