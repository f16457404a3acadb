"""Stage 6, runtime: one compiled program per input signature.

A Program owns the native code for a planned graph and a generated Python function `run` that
does, per call, only what must be done per call: check the parameters' addresses, allocate the
outputs, write data pointers into the slot table, call the native segments, call the EXTERN ops,
and rebuild the output structure. Scratch buffers live in a per-thread Workspace, kept across
calls (no page faults from re-allocating large activations), so two threads never share one.
"""

from __future__ import annotations

import ctypes
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._C._dynamo.guards import TensorGuards
from torch.utils import _pytree as pytree

from . import config
from .codegen import Access, ModuleBuilder, Segment
from .ir import KERNELS, Graph, Node, Op, TensorMeta
from .jit import compile_module
from .lowering import Lowered, Sym

MISS = object()  # returned by run() when a parameter moved: the caller recompiles

_VOID_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


@dataclass
class Layout:
    """Where each value lives: slot numbers, scratch buffers, owners (for views)."""

    slot: dict[str, int] = field(default_factory=dict)
    owner: dict[str, str] = field(default_factory=dict)
    scratch_bytes: dict[int, int] = field(default_factory=dict)  # tmp buffer id -> bytes
    tmp_slot: dict[int, int] = field(default_factory=dict)


def _layout(graph: Graph) -> Layout:
    lay = Layout()
    for n in graph.nodes:
        store = n.attrs["store"]
        if store == "alias":
            src = n.inputs[0] if n.op is Op.VIEW else n.attrs["alias_of"]
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


class Workspace:
    """Per-thread state of one program: the slot table and the scratch buffers."""

    def __init__(self, prog: Program) -> None:
        n = max(len(prog.layout.slot), 1)
        self.table = (ctypes.c_void_p * n)()
        self.addr = ctypes.addressof(self.table)
        self.scratch = {
            b: torch.empty(max(nb // 4, 1), dtype=torch.float32) for b, nb in prog.layout.scratch_bytes.items()
        }
        for b, t in self.scratch.items():
            self.table[prog.layout.tmp_slot[b]] = t.data_ptr()
        for name, t in zip(prog.param_names, prog.params):
            self.table[prog.layout.slot[name]] = t.data_ptr()
        # Tensor views of scratch values that EXTERN ops or outputs need, made once.
        self.view = {name: self._tensor(prog, name) for name in prog.scratch_views}

    def _tensor(self, prog: Program, name: str) -> torch.Tensor:
        node = prog.nodes[name]
        owner = prog.nodes[prog.layout.owner[name]]
        raw = self.scratch[owner.attrs["store"][1]]
        typed = raw.view(torch.uint8).view(node.meta.dtype) if node.meta.dtype != torch.float32 else raw
        return typed.as_strided(node.meta.shape, node.meta.stride, node.meta.offset - owner.meta.offset)


class Program:
    """Native code + generated Python for one signature.

    `run(*args)` checks the arguments against the signature (and grad mode, the module's
    training flag, the parameters' addresses) and returns MISS on any mismatch; `body(*args)`
    skips the argument checks, for callers that matched the signature themselves.
    """

    def __init__(self, lowered: Lowered, graph: Graph, timings: list[tuple[str, float]], guard: Guard) -> None:
        self.graph = graph
        self.nodes = graph.node_map()
        self.layout = _layout(graph)
        # From the planned graph, not from lowering: DCE drops parameters nothing reads.
        self.param_names = [n.name for n in graph.nodes if n.op is Op.PARAM]
        self.params = [self.nodes[n].attrs["tensor"] for n in self.param_names]
        self.externs = lowered.externs
        self.timings = list(timings)
        self.scratch_views: list[str] = []
        self.segments = _segments(graph)
        self.kernel_count = sum(len(s.kernels) for s in self.segments)
        self.llvm_ir = self.optimized_ir = self.asm = ""
        self._fns = self._build_native()
        self._local = threading.local()
        writer = _RunnerWriter(self, lowered, guard)
        self.source = writer.source()
        namespace = self._namespace(lowered, writer.consts)
        exec(compile(self.source, f"<braze program {id(self):x}>", "exec"), namespace)
        self._globals = namespace
        self.rearm(guard.args)
        self.run = namespace["run"]
        self.body = namespace["body"]

    def rearm(self, args: tuple[Any, ...]) -> None:
        """Rebuild the C++ tensor check of `run` from arguments that match this signature.

        TensorGuards compares each tensor's type, dtype, device, sizes, strides, requires_grad and
        dispatch keys, with the thread's dispatch state applied: a program compiled under no_grad
        and then called under inference_mode misses once, the caller (having matched the full
        signature) rearms it, and later calls take the fast path again.
        """
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        sizes = [list(t.shape) for t in tensors]
        strides = [list(t.stride()) for t in tensors]
        # Explicit per-tensor lists: TensorGuards reads them unchecked.
        tg = TensorGuards(*tensors, dynamic_dims_sizes=sizes, dynamic_dims_strides=strides)
        self._globals["_tg"] = tg.check

    def _access(self, name: str) -> Access:
        owner = self.nodes[self.layout.owner[name]]
        node = self.nodes[name]
        meta = node.meta
        rel = meta.offset - owner.meta.offset
        return Access(self.layout.slot[owner.name], TensorMeta(meta.shape, meta.stride, rel, meta.dtype))

    def _build_native(self) -> list[Any]:
        if not self.segments:
            return []
        t0 = time.perf_counter()
        mb = ModuleBuilder("braze", self._access, config.parallel_threshold)
        for seg in self.segments:
            mb.segment(seg)
        text = str(mb.module)
        self.timings.append(("codegen", (time.perf_counter() - t0) * 1e3))
        want = config.debug >= 4 or bool(config.debug_dir) or getattr(self, "_want_text", False)
        level = config.opt_level if self._loop_work() >= config.optimize_threshold else 0
        compiled = compile_module(text, [s.name for s in self.segments], level, bool(want))
        self.timings += compiled.timings
        self.llvm_ir, self.optimized_ir, self.asm = text, compiled.optimized_ir, compiled.asm
        return [_VOID_FN(compiled.addresses[s.name]) for s in self.segments]

    def _loop_work(self) -> int:
        """Elements the program's loops touch per call: what LLVM's optimiser would speed up."""
        return sum(k.meta.numel for s in self.segments for k in s.kernels)

    def _namespace(self, lowered: Lowered, consts: dict[str, Any]) -> dict[str, Any]:
        ns: dict[str, Any] = {"_empty": torch.empty_strided, "MISS": MISS, "_ws": self.workspace, **consts}
        ns["_local"] = self._local
        ns.update({f"_seg{i}": f for i, f in enumerate(self._fns)})
        ns.update({f"_p{i}": p for i, p in enumerate(self.params)})
        ns["_spec"] = lowered.out_spec
        ns["_unflatten"] = pytree.tree_unflatten
        ns["_check"] = _check_extern_result
        return ns

    def workspace(self) -> Workspace:
        ws = getattr(self._local, "ws", None)
        if ws is None:
            ws = self._local.ws = Workspace(self)
        return ws

    def __call__(self, *args: Any) -> Any:
        return self.run(*args)


def _check_extern_result(t: Any, shape: tuple, stride: tuple, label: str) -> None:
    if not isinstance(t, torch.Tensor) or t.shape != shape or t.stride() != stride:
        raise RuntimeError(f"braze: {label} returned a layout the compiled program did not expect")


@dataclass
class Guard:
    """What a program was specialised for, beyond its parameters' addresses."""

    args: tuple[Any, ...]  # the example arguments
    module: torch.nn.Module | None  # whose `training` flag must stay as it was
    epoch: list[int]  # the global module-change counter (api._epoch) and its value now
    epoch_value: int


class _RunnerWriter:
    """Writes the Python source of Program.run / Program.body for one program."""

    def __init__(self, prog: Program, lowered: Lowered, guard: Guard) -> None:
        self.guard = guard
        self.prog = prog
        self.lowered = lowered
        self.lines: list[str] = []
        self.consts: dict[str, Any] = {}
        self.expr: dict[str, str] = {}

    def const(self, value: Any) -> str:
        name = f"_c{len(self.consts)}"
        self.consts[name] = value
        return name

    def tensor(self, name: str) -> str:
        """A Python expression for value `name` as a torch.Tensor."""
        if name in self.expr:
            return self.expr[name]
        prog = self.prog
        owner = prog.layout.owner[name]
        node, onode = prog.nodes[name], prog.nodes[owner]
        if isinstance(onode.attrs["store"], tuple):
            prog.scratch_views.append(name)
            return f"ws.view[{name!r}]"
        base = self.tensor(owner) if owner != name else self.expr[name]
        if owner == name:
            return base
        m, om = node.meta, onode.meta
        rel = m.offset - om.offset
        self.lines.append(f"    {name} = {base}.as_strided({m.shape}, {m.stride}, {base}.storage_offset() + {rel})")
        self.expr[name] = name
        return name

    def source(self) -> str:
        prog, g = self.prog, self.prog.graph
        args = [f"a{i}" for i in range(self.lowered.n_args)]
        params = [f"_p{i}" for i in range(len(prog.params))]
        moved = [f"{p}.data_ptr() != {t.data_ptr()}" for p, t in zip(params, prog.params)]
        head = [f"    if {' or '.join(moved)}:", "        return MISS"] if moved else []
        head += [
            "    try:",
            "        ws = _local.ws",
            "    except AttributeError:",
            "        ws = _ws()",
            "    t = ws.table",
        ]
        for n in g.nodes:
            if n.op is Op.INPUT:
                self.expr[n.name] = f"a{n.attrs['index']}"
        for i, name in enumerate(prog.param_names):
            self.expr[name] = f"_p{i}"
        for n in g.nodes:
            if n.attrs["store"] == "out":
                m = n.meta
                self.lines.append(f"    {n.name} = _empty({m.shape}, {m.stride}, dtype={self.const(m.dtype)})")
                self.lines.append(f"    t[{prog.layout.slot[n.name]}] = {n.name}.data_ptr()")
                self.expr[n.name] = n.name
        for n in g.nodes:
            if n.op is Op.INPUT and self._native_reads(n.name):
                self.lines.append(f"    t[{prog.layout.slot[n.name]}] = {self.expr[n.name]}.data_ptr()")
        seg_of = {s.kernels[-1].name: i for i, s in enumerate(prog.segments)}
        for n in g.nodes:
            if n.name in seg_of:
                self.lines.append(f"    _seg{seg_of[n.name]}(ws.addr)")
            elif n.op is Op.EXTERN:
                self._extern(n)
        self.lines.append(f"    return {self._outputs()}")
        body = head + self.lines
        guard = self._guard(args, params)
        sig = ", ".join(args)
        run = [
            f"def run({', '.join([a + '=MISS' for a in args] + ['*rest'])}):",
            "    try:",
            f"        if {guard}:",
            "            return MISS",
            "    except Exception:",
            "        return MISS",
        ]
        return "\n".join([f"def body({sig}):", *body, "", *run, *body]) + "\n"

    def _guard(self, args: list[str], params: list[str]) -> str:
        """One boolean expression, true when the call does not match this specialisation."""
        gd = self.guard
        checks = ["rest"]
        grads = [f"{a}.requires_grad" for a, v in zip(args, gd.args) if isinstance(v, torch.Tensor)]
        grads += [f"{p}.requires_grad" for p in params]
        if grads:
            checks.append(f"(_grad_on() and ({' or '.join(grads)}))")
        tensors = [a for a, v in zip(args, gd.args) if isinstance(v, torch.Tensor)]
        if tensors:
            checks.append(f"not _tg({', '.join(tensors)})")
        for a, v in zip(args, gd.args):
            if not isinstance(v, torch.Tensor):
                checks += [f"type({a}) is not {self.const(type(v))}", f"{a} != {self.const(v)}"]
        if gd.module is not None:
            checks.append(f"{self.const(gd.module)}.training is not {gd.module.training}")
        checks.append(f"{self.const(gd.epoch)}[0] != {gd.epoch_value}")
        # A TorchFunctionMode (e.g. `with torch.device(...)`) is invisible to TensorGuards.
        checks.append("_function_mode()")
        self.consts["_grad_on"] = torch.is_grad_enabled
        self.consts["_function_mode"] = torch._C._is_torch_function_mode_enabled
        return " or ".join(checks)

    def _native_reads(self, name: str) -> bool:
        for seg in self.prog.segments:
            for k in seg.kernels:
                reads = set(k.value_inputs()) | {i for b in k.body for i in b.value_inputs()}
                if any(self.prog.layout.owner.get(r) == name for r in reads):
                    return True
        return False

    def _py(self, x: Any) -> str:
        if isinstance(x, Sym):
            return self.tensor(x.name)
        if isinstance(x, tuple):
            return "(" + "".join(self._py(v) + ", " for v in x) + ")"
        if isinstance(x, list):
            return "[" + ", ".join(self._py(v) for v in x) + "]"
        if isinstance(x, dict):
            return "{" + ", ".join(f"{k!r}: {self._py(v)}" for k, v in x.items()) + "}"
        if x is None or isinstance(x, (bool, int, str)):
            return repr(x)
        return self.const(x)

    def _extern(self, n: Node) -> None:
        fn = self.const(n.attrs["fn"])
        args = ", ".join(self._py(a) for a in n.attrs["args"])
        kwargs = ", ".join(f"{k}={self._py(v)}" for k, v in n.attrs["kwargs"].items())
        call = f"{fn}({args}{', ' if args and kwargs else ''}{kwargs})"
        self.lines.append(f"    {n.name} = {call}")
        self.expr[n.name] = n.name
        if n.name in self.prog.layout.slot and self._native_reads(n.name):
            m = n.meta
            self.lines.append(f"    _check({n.name}, {m.shape}, {m.stride}, {n.attrs['label']!r})")
            self.lines.append(f"    t[{self.prog.layout.slot[n.name]}] = {n.name}.data_ptr()")

    def _outputs(self) -> str:
        leaves = [self.tensor(v) if isinstance(v, str) else self.const(v[1]) for v in self.lowered.out_leaves]
        spec = self.lowered.out_spec
        if spec.is_leaf():
            return leaves[0]
        return f"_unflatten([{', '.join(leaves)}], _spec)"
