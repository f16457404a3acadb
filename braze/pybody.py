"""Stage 7, runtime: a program's generated Python body, where it makes ATen calls that native code
does not (see runtime.py), and a native body's memoized results' function.

`BodyWriter` writes their source: per call only what must be done per call (allocate the
outputs, write data pointers into the slot table, call the native segments and the ATen ops,
rebuild the output structure), intermediates dropped after their last use as eager drops them.
Beside it: the helpers that source calls (relaid, remember, scratch_view), what the writer and
runtime.py both ask of a program (native_reads, memo_read), and a Python body's per-thread
slot table and scratch buffers (`Workspace`).
"""

from __future__ import annotations

import ctypes
import re
from typing import TYPE_CHECKING, Any

import torch

from . import entry
from .codegen import OUT_OF_MEMORY, Segment
from .dims import Expr
from .ir import Node, Op, TensorMeta
from .lowering import Lowered, Sym

if TYPE_CHECKING:
    from .runtime import Layout, Program


class Workspace:
    """Per-thread state of a Python body: the slot table and the scratch buffers."""

    def __init__(self, prog: Program) -> None:
        n = max(len(prog.layout.slot) + len(prog.symbol_slots), 1)
        self.table = (ctypes.c_void_p * n)()
        self.addr = ctypes.addressof(self.table)
        if prog.family is not None:  # sizes change per call: see buffer()
            self.scratch: dict[int, torch.Tensor] = {}
            self.view: dict[str, torch.Tensor] = {}
            return
        self.scratch = _scratch_buffers(prog.layout)
        for b, t in self.scratch.items():
            self.table[prog.layout.tmp_slot[b]] = t.data_ptr()
        # Tensor views of scratch values that EXTERN ops or outputs need, made once.
        self.view = {name: self._tensor(prog, name) for name in prog.scratch_views}

    def buffer(self, k: int, nbytes: int, slot: int) -> torch.Tensor:
        """A generic program's scratch buffer k, grown to hold nbytes, its address in the table."""
        t = self.scratch.get(k)
        if t is None or t.numel() * 4 < nbytes:
            t = self.scratch[k] = torch.empty(max(-(-nbytes // 4), 1), dtype=torch.float32)
        self.table[slot] = t.data_ptr()
        return t

    def _tensor(self, prog: Program, name: str) -> torch.Tensor:
        node = prog.nodes[name]
        owner = prog.nodes[prog.layout.owner[name]]
        m = node.meta
        return scratch_view(
            self.scratch[owner.attrs["store"][1]], m.dtype, m.shape, m.stride, m.offset - owner.meta.offset
        )


def scratch_view(raw: torch.Tensor, dtype: torch.dtype, shape: Any, stride: Any, offset: int) -> torch.Tensor:
    """A value living in scratch buffer `raw` (float32 words), as a tensor of its dtype and layout."""
    typed = raw.view(torch.uint8).view(dtype) if dtype != torch.float32 else raw
    return typed.as_strided(shape, stride, offset)


def _scratch_buffers(layout: Layout) -> dict[int, torch.Tensor]:
    # float32 words, rounded up: a bool value takes any number of bytes
    return {b: torch.empty(max(-(-nb // 4), 1), dtype=torch.float32) for b, nb in layout.scratch_bytes.items()}


MEMO_ENTRIES = 8  # sizes whose memoized results a program keeps (the oldest go first)


MEMO_BYTES = 16 << 20  # results larger than this together are made at every call


def remember(memo: dict, key: tuple, values: tuple | None) -> tuple | None:
    """Keep `values` (a program's memoized ATen results at sizes `key`; None: one came back laid
    out otherwise than when compiled) if they are small enough."""
    if values is not None and sum(v.nbytes for v in values if isinstance(v, torch.Tensor)) <= MEMO_BYTES:
        memo[key] = values
        while len(memo) > MEMO_ENTRIES:
            memo.pop(next(iter(memo)), None)  # another thread may be at it too
    return values


def native_reads(prog: Program, segments: list[Segment] | None = None) -> set[str]:
    """The owners of every value native code (of `segments`, default all) reads or writes."""
    names = set()
    for seg in prog.segments if segments is None else segments:
        for k in seg.kernels:
            names |= {k.name, *k.value_inputs()} | {i for b in k.body for i in b.value_inputs()}
    return {prog.layout.owner[n] for n in names if n in prog.layout.owner}


def memo_read(prog: Program) -> list[str]:
    """The memoized ATen results that the program's other nodes, or its native code, read."""
    owner, g = prog.layout.owner, prog.graph
    used = {owner[v] for n in g.nodes if n.op is not Op.VIEW and not n.attrs.get("memo") for v in n.value_inputs()}
    return [n.name for n in g.nodes if n.attrs.get("memo") and (n.name in used or n.name in prog.reads)]


FLAGGING = (Op.EMBEDDING, Op.ATTENTION)  # kernels that may set the program's error word


def raise_flagged(word: int | None) -> None:
    """Raise what the bits a segment's kernels set in the program's error word call for (the
    table's words are pointers: None where 0)."""
    if word and word & OUT_OF_MEMORY:
        raise torch.OutOfMemoryError(entry.OOM_ERROR)
    if word:
        raise IndexError(entry.INDEX_ERROR)


def relaid(t: Any, shape: tuple, stride: tuple, dtype: torch.dtype) -> bool:
    """An ATen result that native code is about to read is not laid out as when compiled."""
    return not isinstance(t, torch.Tensor) or t.shape != shape or t.stride() != stride or t.dtype != dtype


def _free_dead(lines: list[str]) -> list[str]:
    """`del` each local tensor after the line that last names it (a native segment's line names
    the tensors it works on), as eager drops an intermediate once used: ATen's later
    allocations then reuse its memory instead of faulting in new pages."""
    defined = [m.group(1) for m in (re.match(r"    ([a-z]\d+) = ", ln) for ln in lines) if m]
    last = {v: max(i for i, ln in enumerate(lines) if re.search(rf"\b{v}\b", ln)) for v in defined}
    out = []
    for i, ln in enumerate(lines):
        out.append(ln)
        dead = [v for v in defined if last[v] == i and not ln.lstrip().startswith("return")]
        if dead:
            out.append(f"    del {', '.join(dead)}")
    return out


class BodyWriter:
    """Writes the Python source of a program's Python body."""

    def __init__(self, prog: Program, lowered: Lowered) -> None:
        self.prog = prog
        self.lowered = lowered
        self.reads = prog.reads
        self.args = ", ".join(f"a{i}" for i in range(lowered.n_args))  # the body's parameters
        self.lines: list[str] = []
        self.consts: dict[str, Any] = {}
        self.expr: dict[str, str] = {}
        self.base: dict[str, tuple[str, TensorMeta]] = {}  # owner -> (variable, its layout)

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
        store = prog.nodes[owner].attrs["store"]
        if isinstance(store, tuple) and prog.family is None:
            prog.scratch_views.append(name)
            return f"ws.view[{name!r}]"
        if isinstance(store, tuple):  # a generic program's scratch: viewed per call
            m, dtype = prog.nodes[name].meta, self.const(prog.nodes[name].meta.dtype)
            rel = m.offset - prog.nodes[owner].meta.offset
            self.lines.append(f"    {name} = _scratch_view(_b{store[1]}, {dtype}, {m.shape}, {m.stride}, {rel})")
            self.expr[name] = name
            return name
        var, meta = self.base[owner]
        m = prog.nodes[name].meta
        if (m.shape, m.stride, m.offset) == (meta.shape, meta.stride, meta.offset):
            self.expr[name] = var
            return var
        rel = m.offset - meta.offset
        self.lines.append(f"    {name} = {var}.as_strided({m.shape}, {m.stride}, {var}.storage_offset() + {rel})")
        self.expr[name] = name
        return name

    def _own(self, name: str, var: str, meta: TensorMeta) -> None:
        self.base[name] = (var, meta)

    def source(self) -> str:
        prog, g = self.prog, self.prog.graph
        slot = prog.layout.slot
        self.lines += ["    try:", "        ws = _local.ws", "    except AttributeError:", "        ws = _ws()"]
        self.lines.append("    t = ws.table")
        self._symbols()
        for n in g.nodes:
            if n.op is Op.INPUT:
                self._own(n.name, f"a{n.attrs['index']}", n.meta)
        for i, name in enumerate(prog.param_names):
            self._own(name, f"_p{i}", self.prog.nodes[name].meta)
        for name in [*prog.param_names, *(n.name for n in g.nodes if n.op is Op.INPUT)]:
            if name in self.reads:
                self.lines.append(f"    t[{slot[name]}] = {self.base[name][0]}.data_ptr()")
        memo = [n for n in g.nodes if n.attrs.get("memo")]
        memo_source = self._memoized(memo) if memo else ""
        seg_of = {s.kernels[-1].name: i for i, s in enumerate(prog.segments)}
        for n in g.nodes:
            if n.name in seg_of:
                self._segment(seg_of[n.name])
            elif n.op is Op.EXTERN and not n.attrs.get("memo"):
                self._extern(n)
        self.lines.append(f"    return {self._outputs()}")
        return memo_source + "\n".join([f"def body({self.args}):", *_free_dead(self.lines)]) + "\n"

    def _memoized(self, memo: list[Node]) -> str:
        """The source of `_memo_fn`, which makes the memoized ATen results (passes.memoize) at the
        sizes it is given; the body takes them from `_memo`, or from it and keeps them."""
        source = self._memo_fn(memo)
        names = "".join(f"{n}, " for n in memo_read(self.prog))
        self.lines.append(f"    if _m is None: return _stale({self.args})")
        if names:  # (none: results nobody reads, kept for the errors they would raise)
            self.lines.append(f"    {names}= _m")
        for n in memo_read(self.prog):
            self._bind(self.prog.nodes[n])
            self._to_table(self.prog.nodes[n])
        return source

    def _memo_fn(self, memo: list[Node]) -> str:
        """`_memo_fn`'s source; and the lines that set `_m` to its results at the call's sizes."""
        syms = "".join(f"s{j}, " for j in range(len(self.prog.family.lo))) if self.prog.family else ""
        outer, expr, base = self.lines, dict(self.expr), dict(self.base)
        self.lines = []
        for n in memo:
            self._extern(n, stale="None")
        names = "".join(f"{n}, " for n in memo_read(self.prog))
        source = "\n".join([f"def _memo_fn({syms}):", *_free_dead([*self.lines, f"    return ({names})"])]) + "\n"
        self.lines, self.expr, self.base = outer, expr, base
        key = f"({syms})"
        self.lines.append(f"    _m = _memo.get({key}, _memo)")  # (one lookup: other threads may drop the entry)
        self.lines.append(f"    if _m is _memo: _m = _remember(_memo, {key}, _memo_fn({syms}))")
        return source

    def memo_source(self) -> str:
        """The source of `memo(*args)`, a native body's memoized results (Program._memo_function)."""
        self._symbols(table=False)
        source = self._memo_fn([n for n in self.prog.graph.nodes if n.attrs.get("memo")])
        return (
            source + "\n".join([f"def memo({self.args}):", *self.lines, "    return () if _m is None else _m"]) + "\n"
        )

    def _symbols(self, table: bool = True) -> None:
        """A generic program's symbols, read from the arguments, into s0, s1, ... and (`table`)
        the table; its scratch buffers, sized for them."""
        prog = self.prog
        if prog.family is None:
            return
        for j, ((i, d), *_) in enumerate(prog.family.places):
            self.lines.append(f"    s{j} = a{i}" + (f".shape[{d}]" if d >= 0 else ""))
            if table:
                self.lines.append(f"    t[{prog.symbol_slots[j]}] = s{j}")
        for b, nbytes in prog.layout.scratch_bytes.items() if table else ():
            self.lines.append(f"    _b{b} = ws.buffer({b}, {nbytes}, {prog.layout.tmp_slot[b]})")

    def _segment(self, i: int) -> None:
        """Allocate the outputs segment i writes (as late as this, so ATen's allocations before
        it find the memory eager's would), then run it."""
        for k in self.prog.segments[i].kernels:
            if k.name in self.prog.alloc:
                m = self.prog.alloc[k.name]
                self.lines.append(f"    {k.name} = _empty({m.shape}, {m.stride}, dtype={self.const(m.dtype)})")
                self.lines.append(f"    t[{self.prog.layout.slot[k.name]}] = {k.name}.data_ptr()")
                self._own(k.name, k.name, m)
        memory = sorted(v for v in native_reads(self.prog, [self.prog.segments[i]]) if self.base.get(v, ("",))[0] == v)
        checked = any(k.op in FLAGGING for k in self.prog.segments[i].kernels)
        if checked:
            self.lines.append(f"    t[{self.prog.layout.error}] = 0")
        self.lines.append(f"    _seg{i}(ws.addr)" + (f"  # on {', '.join(memory)}" if memory else ""))
        if checked:
            self.lines.append(f"    _raise_flagged(t[{self.prog.layout.error}])")

    def _py(self, x: Any) -> str:
        if isinstance(x, Sym):
            return self.tensor(x.name)
        if isinstance(x, tuple):
            return "(" + "".join(self._py(v) + ", " for v in x) + ")"
        if isinstance(x, list):
            return "[" + ", ".join(self._py(v) for v in x) + "]"
        if isinstance(x, dict):
            return "{" + ", ".join(f"{k!r}: {self._py(v)}" for k, v in x.items()) + "}"
        if isinstance(x, slice):
            return f"slice({self._py(x.start)}, {self._py(x.stop)}, {self._py(x.step)})"
        if x is None or isinstance(x, (bool, int, str)):
            return repr(x)
        if isinstance(x, Expr):
            return f"({x!r})"
        return self.const(x)

    def _extern(self, n: Node, stale: str = "") -> None:
        """The ATen call; if its result's layout was relied on, a check (failing, the line returns
        `stale`: by default what the call gives once compiled again)."""
        fn = self.const(n.attrs["fn"])
        args = ", ".join(self._py(a) for a in n.attrs["args"])
        kwargs = ", ".join(f"{k}={self._py(v)}" for k, v in n.attrs["kwargs"].items())
        call = f"{fn}({args}{', ' if args and kwargs else ''}{kwargs})"
        self.lines.append(f"    {n.name} = {call}")
        self._bind(n)
        if n.meta is not None and (n.name in self.reads or n.name in self.lowered.layout_read):
            # compiled for the layout this call returned then (its result's shape may depend on
            # values: nonzero, repeat_interleave)
            m = n.meta
            dtype = self.const(m.dtype)
            stale = stale or f"_stale({self.args})"
            self.lines.append(f"    if _relaid({n.name}, {m.shape}, {m.stride}, {dtype}): return {stale}")
        if not n.attrs.get("memo"):  # a memoized one's goes in where the body has it
            self._to_table(n)

    def _bind(self, n: Node) -> None:
        """An ATen result named in the source: views are made from it (when it owns its memory)."""
        if n.meta is not None and n.attrs["store"] == "extern":
            self._own(n.name, n.name, n.meta)
        else:
            self.expr[n.name] = n.name

    def _to_table(self, n: Node) -> None:
        if n.name in self.reads:
            self.lines.append(f"    t[{self.prog.layout.slot[n.name]}] = {n.name}.data_ptr()")

    def _outputs(self) -> str:
        leaves = [self.tensor(v) if isinstance(v, str) else self.const(v[1]) for v in self.lowered.out_leaves]
        spec = self.lowered.out_spec
        if spec.is_leaf():
            return leaves[0]
        if spec.type is tuple and all(c.is_leaf() for c in spec.children()):  # TorchDynamo's graphs
            return "(" + "".join(f"{v}, " for v in leaves) + ")"
        return f"_unflatten([{', '.join(leaves)}], _spec)"
