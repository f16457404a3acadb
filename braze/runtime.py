"""Stage 7, runtime: one compiled program per input signature.

A Program owns the machine code for a planned graph and two callables:

- `entry(*args, **kwargs)`: native; checks the call against the specialisation, then runs the
  body, or passes the call to `on_miss` (the wrapper's slow path; by default it returns MISS);
- `body(*args)`: runs the program unchecked. It is native when every node is (see entry.py);
  else it is a generated Python function (pybody.py writes it) that does, per call, only what
  must be done per call.

Scratch buffers live across calls (no page faults from re-allocating large activations): a
native body uses the program's own (or a fresh allocation while another thread runs it); a
Python body uses a per-thread Workspace (pybody.py).
"""

from __future__ import annotations

import ctypes
import itertools
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from . import config, entry, fast, pybody
from .codegen import Access, ModuleBuilder, Segment
from .codegen.calls import Call, CallEmitter, Step, plan
from .dims import Dim, Expr, value
from .ir import KERNELS, Graph, Node, Op, TensorMeta
from .jit import compile_module, dict_version, matmul_precision, mkl_threads, pyfunction, realigned, shim_constant
from .lowering import Lowered
from .lowering.generic import Family, NotGeneric

MISS = object()  # what an entry returns for a call it was not compiled for, unless told otherwise

_VOID_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_CYCLES_FN = ctypes.CFUNCTYPE(ctypes.c_uint64)
_serial = itertools.count()


def _return_miss(*args: Any, **kwargs: Any) -> Any:
    return MISS


@dataclass
class Layout:
    """Where each value lives: slot numbers, scratch buffers, owners (for views)."""

    slot: dict[str, int] = field(default_factory=dict)
    owner: dict[str, str] = field(default_factory=dict)
    scratch_bytes: dict[int, int] = field(default_factory=dict)  # tmp buffer id -> bytes
    tmp_slot: dict[int, int] = field(default_factory=dict)
    error: int | None = None  # the word kernels set (codegen.BAD_INDEX, OUT_OF_MEMORY): the call raises


def _layout(graph: Graph) -> Layout:
    lay = Layout()
    for n in graph.nodes:
        store = n.attrs["store"]
        if store == "alias":
            src = n.inputs[0]
            lay.owner[n.name] = lay.owner.get(src, src)
            continue
        lay.owner[n.name] = n.name
        if isinstance(store, tuple):
            buf = store[1]
            lay.scratch_bytes[buf] = max(lay.scratch_bytes.get(buf, 0), max(n.meta.span, 1) * n.meta.dtype.itemsize)
            if buf not in lay.tmp_slot:
                lay.tmp_slot[buf] = len(lay.slot)
                lay.slot[f"#buf{buf}"] = lay.tmp_slot[buf]
            lay.slot[n.name] = lay.tmp_slot[buf]
        else:
            lay.slot[n.name] = len(lay.slot)
    if any(n.op in pybody.FLAGGING or n.attrs.get("exact_per_call") for n in graph.nodes):
        lay.error = lay.slot["#error"] = len(lay.slot)
    return lay


def _segments(graph: Graph) -> list[Segment]:
    segs: list[Segment] = []
    current: list[Node] = []
    for n in graph.nodes:
        if n.op in KERNELS:
            current.append(n)
        elif n.op is Op.EXTERN and current:
            segs.append(Segment(f"seg{len(segs)}", current))
            current = []
    if current:
        segs.append(Segment(f"seg{len(segs)}", current))
    return segs


def _allocations(graph: Graph, lowered: Lowered, layout: Layout) -> tuple[dict[str, TensorMeta], dict[str, str]]:
    """The layout each returned buffer is allocated with, and which output leaves are such buffers.

    A buffer returned only as one leaf that views all of it is allocated with the leaf's layout:
    a linear on a 3-D input returns one 3-D tensor (as eager does under inference_mode), which a
    native body can allocate, rather than a view of a 2-D buffer.
    """
    nodes = graph.node_map()
    metas = {n.name: n.meta for n in graph.nodes if n.attrs["store"] == "out"}
    leaves = [v for v in lowered.out_leaves if isinstance(v, str)]
    uses = Counter(layout.owner[v] for v in leaves)
    fresh: dict[str, str] = {}
    for v in leaves:
        o = layout.owner[v]
        if o not in metas or uses[o] != 1:
            continue
        if _all_of(nodes[v].meta, nodes[o].meta):
            metas[o] = nodes[v].meta
            fresh[v] = o
    return metas, fresh


class Program:
    """Machine code, entry points and (when needed) a generated Python body for one signature."""

    _want_text = False  # keep LLVM IR and assembly text (braze.explain sets it)

    def __init__(
        self,
        lowered: Lowered,
        graph: Graph,
        timings: list[tuple[str, float]],
        guard: Guard,
        family: Family | None = None,
    ) -> None:
        self.graph = graph
        self.lowered = lowered  # (explain's IR after lowering; a native body's Python body, made if needed)
        self.nodes = graph.node_map()
        self.layout = _layout(graph)
        # A shape-generic program (see lowering/generic.py): its symbols' slots follow the
        # values', then those of the sizes its entry computes from them (`derived`).
        self.family = family
        # The sizes its heuristics (flops, loop work) are judged at: the call's, or the smallest
        # the family admits where the call is outside it (it is then compiled for on its own)
        self.point = (family.values(guard.args) or family.lo) if family is not None else ()
        n_symbols = len(family.lo) if family is not None else 0
        self.symbol_slots = tuple(range(len(self.layout.slot), len(self.layout.slot) + n_symbols))
        self.derived: dict[Expr, int] = {}
        # From the planned graph, not from lowering: DCE drops parameters nothing reads.
        self.param_names = [n.name for n in graph.nodes if n.op is Op.PARAM]
        self.params = [self.nodes[n].attrs["tensor"] for n in self.param_names]
        self._param_layouts = [_param_layout(p) for p in self.params]
        # The parameters and arguments whose requires_grad it is for (of those it still reads)
        present = {n.name for n in graph.nodes if n.op in (Op.PARAM, Op.INPUT)}
        self.grad_read = {n: want for n, want in lowered.grad_read if n in present}
        self._owners = [guard.owners.get(id(p), ()) for p in self.params]  # (module's table, name)
        self._hooks = guard.hooks
        watched = [m.__dict__ for m in guard.layers if dict_version(m.__dict__) is not None]
        self._attributes = [(d, _attributes(d)) for d in watched]
        self.stale = False  # an ATen call returned a layout other than compiled: compile again
        self.flag_modules = guard.modules  # whose `training` flags the entry checks
        # Each ATen call, as native code would make it (codegen/calls.py), or why it would not;
        # but the memoized ones, made from Python once per sizes (see _memo_function)
        given = frozenset(v for v, o in self.layout.owner.items() if self.nodes[o].op in (Op.INPUT, Op.PARAM))
        self.calls = {n.name: plan(n, given) for n in graph.nodes if n.op is Op.EXTERN and not n.attrs.get("memo")}
        self.timings = list(timings)
        self.scratch_views: list[str] = []
        self.segments = _segments(graph)
        self.kernel_count = sum(len(s.kernels) for s in self.segments)
        self.alloc, fresh = _allocations(graph, lowered, self.layout)
        self.python_body_why = _python_body_why(self, lowered, fresh)  # ("": the body is native)
        self.native = not self.python_body_why
        self.externs = [(n.attrs["label"], _why(n, self.native)) for n in graph.nodes if n.op is Op.EXTERN]
        if family is not None and any(isinstance(v[1], Expr) for v in lowered.out_leaves if not isinstance(v, str)):
            raise NotGeneric("it returns a size as a number")
        self.reads = pybody.native_reads(self)  # owners of the memory native code works on
        if self.native:
            self.reads |= {
                self.layout.owner[t] for c in self.calls.values() if isinstance(c, Call) for t in c.tensors()
            }
        self.llvm_ir = self.optimized_ir = self.asm = ""
        self.blas_clock: tuple[Any, Any] | None = None  # see config.blas_clock
        self._local = threading.local()
        self._body_globals: dict[str, Any] | None = None  # a Python body's namespace
        self.memo: dict[tuple, tuple] = {}  # the results of ATen calls that follow from the sizes, per sizes
        # Fast mode's weights packed once (fast.GemmPack), each with the node it is packed from
        kept = [n for n in graph.nodes if n.op is Op.GEMM and n.attrs.get("pack") and n.attrs["own_kernel"]]
        self.packs = [(n.attrs["pack"], n.attrs["pack_source"]) for n in kept]
        for pack, _ in self.packs:
            pack.address()  # packed now, before the entry reads what it was packed from
        spec = self._spec(lowered, guard, fresh)
        self.entry, self.body = self._build(spec, lowered)

    # --- per call state ----------------------------------------------------------------------
    def rearm(self, args: tuple[Any, ...]) -> str:
        """Let `entry` accept these arguments (which match this signature) under the thread's
        dispatch state now; or say why the program no longer holds (it compiles again).

        The entry compares the thread's dispatch state and each tensor's dispatch keys with those
        it expects: a program compiled under no_grad and then called under inference_mode misses
        once, the caller (having matched the full signature) rearms it, and later calls take the
        fast path again.
        """
        if [_param_layout(p) for p in self.params] != self._param_layouts:
            return "a parameter changed dtype or layout"
        if any(table.get(name) is not p for p, where in zip(self.params, self._owners) for table, name in where):
            return "a parameter is no longer registered where it was"  # set to None, or a tied one replaced
        if any(len(table) != n for table, n in self._hooks):
            return "a forward hook was added or removed"
        given = self._named(args)
        if any(given[n].requires_grad != want for n, want in self.grad_read.items()):
            return "a weight's requires_grad changed (ATen's matmul folds a batch where it is set)"
        if any(_attributes(d) != was for d, was in self._attributes):
            return ATTRIBUTE_CHANGED
        unpacked = self._repack(given)
        if unpacked:
            return unpacked
        self._descriptor.refresh_versions()  # (another training flag: the entry checks those it needs)
        self._descriptor.set_dispatch_state([a for a in args if isinstance(a, torch.Tensor)] + self.params)
        return ""

    @property
    def repacks(self) -> int:
        """How often its packed weights were packed again (they changed)."""
        return sum(pack.repacks for pack, _ in self.packs)

    def _named(self, args: tuple[Any, ...]) -> dict[str, Any]:
        """The program's arguments (`args`) and parameters as they are now, by their nodes' names."""
        named = {n.name: args[n.attrs["index"]] for n in self.graph.nodes if n.op is Op.INPUT}
        return named | dict(zip(self.param_names, self.params))

    def _repack(self, given: dict[str, Any]) -> str:
        """Pack again each weight that changed since it was packed (another tensor, moved, or
        changed in place; `given`: _named's); or say why the program compiles again: a weight no
        longer fits its pack, or one keeps changing (packed again more than fast.REPACKS times: a
        training loop between calls, weight sets taking turns), which the program then reads in
        place."""
        for pack, source in self.packs:
            t = given[source]
            if not pack.stale(t):
                continue
            if not pack.fits(t):
                return "a packed weight changed layout, or has no version counter"
            if pack.repacks >= fast.REPACKS:
                fast.unsteady(t)
                return "a packed weight keeps changing: it is read in place"
            pack.repack(t)
        self._descriptor.refresh_packs()
        return ""

    def rebind(self, old: torch.Tensor, new: torch.Tensor) -> None:
        """Read `new` where the program read `old`: a parameter or buffer of the model replaced
        by another tensor (Hugging Face models re-register buffers in forward). The entry checks
        the new tensor's layout on every call, as it checked the old one's; a different one
        misses, and `rearm` then refuses it (the program compiles again)."""
        for i, p in enumerate(self.params):
            if p is old:
                self.params[i] = new
                if self._body_globals is not None:
                    self._body_globals[f"_p{i}"] = new
        self._descriptor.rebind(old, new)

    def _went_stale(self, *args: Any) -> Any:
        """An ATen call inside returned another layout than when compiled (a module's setting
        changed, or the op's output shape depends on the data): hand the call back to the
        wrapper, which compiles again or runs eagerly."""
        self.stale = True
        return self._descriptor.on_miss(*args)

    def _in_python(self, *args: Any) -> Any:
        """An ATen call of the native body failed (it raised, or returned another layout than
        compiled): run this call through the program's Python body (made the first time), which
        makes the same calls from Python: it raises what eager raises, or goes stale."""
        if self._body_globals is None:
            self._python_body(self.lowered)
        assert self._body_globals is not None
        return self._body_globals["body"](*args)

    def bind(self, on_miss: Any) -> None:
        """Where `entry` sends the calls it was not compiled for."""
        self._descriptor.set_object("on_miss", on_miss)

    def workspace(self) -> pybody.Workspace:
        ws = getattr(self._local, "ws", None)
        if ws is None:
            ws = self._local.ws = pybody.Workspace(self)
        return ws

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.entry(*args, **kwargs)

    # --- building ----------------------------------------------------------------------------
    def word(self, x: Dim) -> int:
        """A size, stride or byte count as a descriptor word: itself, or where the table holds it."""
        if isinstance(x, int):
            return x
        symbol = next((j for j in x.symbols()), 0)
        if x == Expr.symbol(symbol, x.n):
            return entry.ref(self.symbol_slots[symbol])
        if x not in self.derived:
            self.derived[x] = len(self.layout.slot) + len(self.symbol_slots) + len(self.derived)
        return entry.ref(self.derived[x])

    def _words(self, meta: TensorMeta) -> TensorMeta:
        return TensorMeta(tuple(map(self.word, meta.shape)), tuple(map(self.word, meta.stride)), 0, meta.dtype)

    def _spec(self, lowered: Lowered, guard: Guard, fresh: dict[str, str]) -> entry.EntrySpec:
        slot, reads = self.layout.slot, self.reads
        inputs = {n.attrs["index"]: n for n in self.graph.nodes if n.op is Op.INPUT}
        read = {i: slot[n.name] for i, n in inputs.items() if n.name in reads}
        tensors, record = [], {}  # (record: each tensor argument's or parameter's record)
        for i, a in enumerate(guard.args):
            if isinstance(a, torch.Tensor):
                words = self._words(inputs[i].meta) if self.family is not None and i in inputs else None
                layout = (words.shape, words.stride) if words is not None else None
                record[inputs[i].name if i in inputs else None] = len(tensors)
                grad = int(self.grad_read.get(inputs[i].name, -1)) if i in inputs else -1
                tensors.append(entry.TensorCheck(a, i, read.get(i, -1), True, layout, grad))
        first = len(tensors)  # the parameters' records follow the arguments'
        record |= {name: first + j for j, name in enumerate(self.param_names)}
        owners = tuple((table, name, first + i) for i, where in enumerate(self._owners) for table, name in where)
        for name, p in zip(self.param_names, self.params):
            natively = name in reads  # a parameter only ATen reads may change layout: ATen copes
            grad = int(self.grad_read.get(name, -1))
            tensors.append(entry.TensorCheck(p, -1, slot[name] if natively else -1, natively, grad=grad))
        ours = {id(p) for p in self.params}  # the rest, read by ATen calls: only requires_grad
        tensors += [entry.TensorCheck(p, -1, -1, False) for p in guard.params if id(p) not in ours]
        scratch = tuple((self.layout.tmp_slot[b], self.word(nb)) for b, nb in self.layout.scratch_bytes.items())
        bounds = tuple(zip(self.family.lo, self.family.hi)) if self.family is not None else ()
        places = self.family.places if self.family is not None else ()
        int_symbols = tuple((i, self.symbol_slots[j]) for j, ps in enumerate(places) for i, d in ps if d < 0)
        symbolic = {i for i, _ in int_symbols}
        # (before the table's size: a generic program's output sizes may need words of their own)
        outputs = [(v, *self._output(v, fresh)) for v in lowered.out_leaves] if self.native else []
        n_slots = len(slot) + len(self.symbol_slots) + len(self.derived)
        # A native body's ATen calls: a word per result's handle, and one the run sets on failing
        calls = list(self.calls) if self.native else []
        # A native body's memoized ATen results: where it reads each (see _memo_function)
        self.memo_slots = tuple(slot[n] for n in pybody.memo_read(self)) if self.native else ()
        self.handle_slots = {name: n_slots + i for i, name in enumerate(calls)}
        self.failed_slot = n_slots + len(calls) if calls else -1
        outputs = tuple(
            (s, words, -1 if s >= 0 else self.handle_slots[self.layout.owner[v]]) for v, s, words in outputs
        )
        return entry.EntrySpec(
            n_args=lowered.n_args,
            tensors=tuple(tensors),
            const_args=tuple(
                (i, a) for i, a in enumerate(guard.args) if not isinstance(a, torch.Tensor) and i not in symbolic
            ),
            modules=guard.modules,
            epoch=guard.epoch,
            epoch_value=guard.epoch_value,
            matmul_precision=matmul_precision() if self._gemms() else -1,
            mkl_threads=mkl_threads() if self._probed_gemms() else -1,
            mkldnn=int(torch.backends.mkldnn.enabled) if self._onednn() else -1,
            flash=1 if self._flash() else -1,
            outputs=outputs,
            tuple_output=not lowered.out_spec.is_leaf(),
            scratch=scratch if self.native else (),
            n_slots=max(n_slots + len(calls) + bool(calls), 1),
            release_gil=self._flops() >= config.release_gil_flops,
            symbols=tuple((slot, lo, hi) for slot, (lo, hi) in zip(self.symbol_slots, bounds)),
            int_symbols=int_symbols,
            names=guard.names if len(guard.names) == lowered.n_args else (),
            error_slot=-1 if self.layout.error is None else self.layout.error,
            failed_slot=self.failed_slot,
            memo_slots=self.memo_slots,
            owners=owners,
            hooks=self._hooks,
            versions=tuple((d, dict_version(d)) for d, _ in self._attributes),
            huge_scratch=config.huge_scratch,
            packs=tuple((record[source], pack) for pack, source in self.packs),
        )

    def _output(self, v: str, fresh: dict[str, str]) -> tuple[int, TensorMeta]:
        """A native body's output: the slot of its fresh buffer (-1 where an ATen call returns
        it, or a view of all of that) and its layout as words."""
        if v in fresh:
            return self.layout.slot[fresh[v]], self._words(self.alloc[fresh[v]])
        meta = self.nodes[v].meta
        assert meta is not None
        return -1, self._words(meta)

    def _build(self, spec: entry.EntrySpec, lowered: Lowered) -> tuple[Any, Any]:
        t0 = time.perf_counter()
        if entry.ensure_runtime():
            self.timings.append(("entry runtime (once)", (time.perf_counter() - t0) * 1e3))
            t0 = time.perf_counter()
        prefix = f"braze{next(_serial)}"
        mb = ModuleBuilder(
            prefix, self._access, config.parallel_threshold, config.blas_clock, self.symbol_slots, self.layout.error
        )
        segs = [mb.segment(s) for s in self.segments]
        # (memoized calls split segments too: a native body of several runs them in turn)
        runs = [self._run(mb, segs)] if self.native and len(segs) > 1 or self.handle_slots else []
        desc_name = entry.emit_trampolines(mb)
        dims = [mb.emit_dims(list(self.derived.items()))] if self.family is not None else []
        clock = [f"{prefix}_blas_cycles", f"{prefix}_cycles"] if mb.clock is not None else []
        text = str(realigned(mb.module))
        self.timings.append(("codegen", (time.perf_counter() - t0) * 1e3))
        want = config.debug >= 4 or bool(config.debug_dir) or self._want_text
        # LLVM's optimiser only for loops codegen left scalar (strided): it gave the vector loops
        # codegen writes nothing (cnn-small, mlp-wide, ResNet-18, GPT-2 ran 0.99-1.00x as fast
        # with it) and cost 0.3-1.1 s of their first calls. A generic program compiles while a
        # stream of calls waits on it: never.
        scalar = sum(value(n, self.point) for n in mb.scalar_work)
        big = scalar >= config.optimize_threshold and self.family is None
        level = config.opt_level if big else 0
        names = [f"{prefix}_entry", f"{prefix}_body", desc_name] + [f.name for f in segs] + runs + clock + dims
        compiled = compile_module(text, names, level, want, only=set(mb.scalar_loops))
        self.timings += compiled.timings
        self.llvm_ir, self.optimized_ir, self.asm = text, compiled.optimized_ir, compiled.asm
        addr = compiled.addresses
        if clock:  # the counter of cycles spent in BLAS calls, and the clock it reads
            self.blas_clock = (ctypes.c_uint64.from_address(addr[clock[0]]), _CYCLES_FN(addr[clock[1]]))
        python_body, run = None, 0
        self._fns = [_VOID_FN(addr[f.name]) for f in segs]
        if self.native:  # one segment, or the segments and ATen calls in turn
            run = addr[runs[0]] if runs else addr[segs[0].name] if segs else 0
        else:
            python_body = self._python_body(lowered)
        self._descriptor = entry.Descriptor(spec, MISS, python_body, run)
        if dims:
            self._descriptor.set("dims", addr[dims[0]])
        self._descriptor.set_object("on_miss", _return_miss)
        self._descriptor.set_object("retry", self._in_python)
        if self.native and any(n.attrs.get("memo") for n in self.graph.nodes):
            self._descriptor.set_object("memo", self._memo_function(lowered))
        ctypes.c_void_p.from_address(addr[desc_name]).value = self._descriptor.address
        run_fn = pyfunction(addr[f"{prefix}_entry"], "entry", True, self)
        body = python_body or pyfunction(addr[f"{prefix}_body"], "body", False, self)
        return run_fn, body

    def _run(self, mb: ModuleBuilder, segs: list[Any]) -> str:
        """A native body with ATen calls, or of several segments (memoized calls split them): its
        segments and calls in graph order, each call's result freed after the last step that
        reads it."""
        seg_of = {s.kernels[-1].name: (i, s) for i, s in enumerate(self.segments)}
        steps: list[Step] = []
        reads: list[set[str]] = []
        made: dict[str, int] = {}  # each call's step
        for n in self.graph.nodes:
            if n.name in seg_of:
                i, seg = seg_of[n.name]
                steps.append(Step(segment=segs[i]))
                reads.append(pybody.native_reads(self, [seg]))
            elif n.name in self.handle_slots:
                call = self.calls[n.name]
                assert isinstance(call, Call)
                made[n.name] = len(steps)
                steps.append(Step(call=(n, call, self.handle_slots[n.name])))
                reads.append({self.layout.owner[t] for t in call.tensors()})
        # (those handed to the outputs)
        returned = {self.layout.owner[v] for v in self.lowered.out_leaves if isinstance(v, str)}
        for name, handle in self.handle_slots.items():
            last = max(i for i in range(made[name], len(steps)) if name in reads[i] or i == made[name])
            if name not in returned:
                steps[last].frees += (handle,)
        emitter = CallEmitter(mb, entry.dtype_code, shim_constant("device_type_cpu"))
        return emitter.run(steps, list(self.handle_slots.values()), self.failed_slot)

    def _memo_function(self, lowered: Lowered) -> Any:
        """For a native body: a Python function of the call's arguments that returns the
        memoized ATen results it reads (_memo_read's), made once per sizes and kept, or () where
        one came back laid out otherwise than compiled (the body then runs the call in Python)."""
        writer = pybody.BodyWriter(self, lowered)
        source = writer.memo_source()
        namespace = self._namespace(lowered, writer.consts)
        exec(compile(source, f"<braze memo {id(self):x}>", "exec"), namespace)
        return namespace["memo"]

    def _python_body(self, lowered: Lowered) -> Any:
        writer = pybody.BodyWriter(self, lowered)
        self.source = writer.source()
        namespace = self._namespace(lowered, writer.consts)
        exec(compile(self.source, f"<braze program {id(self):x}>", "exec"), namespace)
        self._body_globals = namespace
        return namespace["body"]

    def _access(self, name: str) -> Access:
        owner = self.nodes[self.layout.owner[name]]
        node = self.nodes[name]
        meta = node.meta
        rel = meta.offset - owner.meta.offset
        return Access(self.layout.slot[owner.name], TensorMeta(meta.shape, meta.stride, rel, meta.dtype))

    def _gemms(self) -> list[dict[str, Any]]:
        """The BLAS arguments of each native GEMM and batched GEMM."""
        return [k.attrs["blas"] for s in self.segments for k in s.kernels if k.op in (Op.GEMM, Op.BMM)]

    def _probed_gemms(self) -> bool:
        """Whether a GEMM's call was chosen by a probe at MKL's thread count (on another count,
        eager's MKL may add in another order): one on one thread, braze's own kernel, exact
        mode's 1 x 1 convolution as MKL's sgemm_ (on another count ATen may take oneDNN's path)
        or its attention (ATen's flash kernel calls MKL)."""
        probed = ("one_thread", "one_thread_sizes", "own_kernel", "convolution")
        return self._flash() or any(k.attrs.get(a) for s in self.segments for k in s.kernels for a in probed)

    def _flash(self) -> bool:
        """Whether braze's kernel of ATen's flash attention may run: in place of its call, or per
        call in a generic program (eager runs that kernel only while it is enabled)."""
        kernels = [k for s in self.segments for k in s.kernels]
        return any(k.attrs.get("exact") for k in kernels) or any(
            n.attrs.get("exact_per_call") for n in self.graph.nodes
        )

    def _onednn(self) -> bool:
        """Whether the program computes what ATen computes through oneDNN only while
        torch.backends.mkldnn is enabled (gelu's erf form), or whose native convolutions follow the
        path ATen takes with it as it was (exact mode's: oneDNN's order, or MKL's without it)."""
        body = lambda k: k.attrs.get("body", (k,))  # noqa: E731
        kernels = [k for s in self.segments for k in s.kernels]
        convolutions = any(k.attrs.get("convolution") for k in kernels)
        return convolutions or any(n.op is Op.GELU_ERF for k in kernels for n in body(k))

    def _flops(self) -> int:
        """Floating-point operations per call, roughly: GEMMs count 2mnk, loops one per element
        (a generic program's: at the sizes it was built at)."""
        gemms = sum(value(g.get("batch", 1) * g["m"] * g["n"] * g["k"], self.point) for g in self._gemms())
        return 2 * gemms + self._loop_work()

    def _loop_work(self) -> int:
        """Elements the program's kernels write per call (for _flops)."""
        return sum(value(k.meta.numel, self.point) for s in self.segments for k in s.kernels)

    def _namespace(self, lowered: Lowered, consts: dict[str, Any]) -> dict[str, Any]:
        ns: dict[str, Any] = {"_empty": torch.empty_strided, "_ws": self.workspace, **consts}
        ns["_local"] = self._local
        ns.update({f"_seg{i}": f for i, f in enumerate(self._fns)})
        ns.update({f"_p{i}": p for i, p in enumerate(self.params)})
        ns["_spec"] = lowered.out_spec
        ns["_unflatten"] = pytree.tree_unflatten
        ns["_relaid"] = pybody.relaid
        ns["_scratch_view"] = pybody.scratch_view
        ns["_stale"] = self._went_stale
        ns["_memo"] = self.memo
        ns["_remember"] = pybody.remember
        ns["_raise_flagged"] = pybody.raise_flagged
        return ns


def _why(n: Node, native: bool) -> str:
    if n.attrs.get("memo"):
        return n.attrs["why"] + "; made once per sizes and kept: its result follows from the sizes alone"
    why = n.attrs["why"] + ("; called from native code" if native else "")
    if native and n.attrs.get("exact_per_call"):
        why += ", or braze's kernel of it where a call's sizes are ones it reproduces"
    return why


def _param_layout(p: torch.Tensor) -> tuple:
    return type(p), p.shape, p.stride(), p.dtype, p.device


# What an output that is not a buffer of its own is (a view of), where the native body does not return it
_NOT_RETURNED = {
    Op.INPUT: "an input or parameter",
    Op.PARAM: "an input or parameter",
    Op.EXTERN: "an ATen result kept per sizes",
}


def _python_body_why(prog: Program, lowered: Lowered, fresh: dict[str, str]) -> str:
    """Why the program's body is generated Python ("" where it is native): an ATen call native
    code does not make, or an output the native body does not return. It returns fresh
    buffers and the results of the ATen calls it makes (each once, as itself or a view of all
    of it), alone or in a plain tuple."""
    for name, call in prog.calls.items():
        if not isinstance(call, Call):
            return f"the ATen call {prog.nodes[name].attrs['label']} stays in Python: {call}"
    spec = lowered.out_spec
    if not (spec.is_leaf() or (spec.type is tuple and all(c.is_leaf() for c in spec.children()))):
        return "it returns nested tuples" if spec.type is tuple else f"it returns a {spec.type.__name__}"
    owner, nodes = prog.layout.owner, prog.nodes
    returned: set[str] = set()
    for i, v in enumerate(lowered.out_leaves):
        if not isinstance(v, str):
            return f"output {i} is not a tensor it computes ({type(v).__name__})"
        if v in fresh:
            continue
        base = owner[v]
        if base not in prog.calls:
            what = _NOT_RETURNED.get(nodes[base].op, "part of a buffer it computes")
            return f"output {i} is {what}, or a view of it"
        if base in returned:
            return f"output {i} returns an ATen call's result a second time"
        if not _all_of(nodes[v].meta, nodes[base].meta):
            return f"output {i} is a view of part of an ATen call's result"
        returned.add(base)
    return ""


def _all_of(view: TensorMeta | None, base: TensorMeta | None) -> bool:
    """A value laid out as `view` is its buffer's (`base`) value, or a view of all of it from its start."""
    return view is not None and base is not None and view.offset == base.offset and view.span == base.span


ATTRIBUTE_CHANGED = "a layer's attribute changed"  # (the traced graph read it: capture again)


def _attributes(d: dict) -> dict:
    """A layer's own attributes (its __dict__, d) but its training flag (whose reads the entry
    checks itself), each compared by identity, or by value where it is a number, a string or a
    tuple of them."""
    plain = (int, float, str, bool, type(None), tuple)
    return {k: (v if isinstance(v, plain) else id(v)) for k, v in d.items() if k != "training"}


@dataclass
class Guard:
    """What a program was specialised for: its example arguments and the state around them."""

    args: tuple[Any, ...]  # the example arguments
    modules: tuple[torch.nn.Module, ...]  # whose `training` flags must stay as they were
    params: tuple[torch.Tensor, ...]  # the model's parameters: none may require grad in grad mode
    epoch: Any  # the wrapper's module-change counter (a ctypes int64 cell, api.Epoch)
    epoch_value: int  # and its value now
    names: tuple[str, ...] = ()  # the parameters' names, where a call may give them as keywords
    # Where each parameter is registered (api._owners): `linear.bias = None` calls no hook, so
    # the entry checks that each parameter a program reads is still its module's
    owners: dict[int, tuple[tuple[dict, str], ...]] = field(default_factory=dict)
    hooks: tuple[tuple[dict, int], ...] = ()  # forward hook tables and how many hooks each held
    # The layers the program calls or inlines: their attributes (alpha, stride) were read as
    # constants; the entry watches their dictionaries' versions (see Program._attributes); and
    # other objects whose attributes a lowering read (Lowered.watched)
    layers: tuple[Any, ...] = ()
