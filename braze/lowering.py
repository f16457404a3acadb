"""Stage 2, lowering: an FX graph plus example inputs becomes a braze IR graph.

Each FX node is first run on meta tensors, which gives eager's exact output layout and raises
eager's errors for bad shapes. Then the lowering registry (one row per op) turns it into IR;
an op without a row, or with arguments a row cannot do bit-exactly, becomes an EXTERN node that
calls the same torch function at run time. In-place ops are rewritten to functional ones when
the value they change is braze's own intermediate; changing an input or a view is `Unsupported`.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree

from . import config, jit
from .capture import Captured
from .ir import COMPARE, Graph, Node, Op, Operand, TensorMeta, broadcast_shape, contiguous_strides


class Unsupported(Exception):
    """The graph as a whole cannot be compiled; braze runs it eagerly and says why."""


class NotNative(Exception):
    """This one op runs through ATen; the message says why."""


@dataclass
class Sym:
    """A value during lowering: its IR name and its meta tensor (or a structure of them)."""

    name: str
    meta: Any

    @property
    def is_tensor(self) -> bool:
        """A strided tensor (a sparse or other result of an ATen call is an opaque value)."""
        return _strided(self.meta)


@dataclass
class Lowered:
    graph: Graph
    out_spec: pytree.TreeSpec
    out_leaves: list[Any]  # per output leaf: an IR value name (str) or a constant ("const", x)
    externs: list[tuple[str, str]]  # (op, why) for every EXTERN node
    n_args: int  # positional arguments the program takes
    reads_training: tuple[torch.nn.Module, ...]  # modules whose flag a lowering decided on
    layout_read: frozenset[str] = frozenset()  # see Lowerer.layout_read


def to_meta(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A meta tensor with t's layout, of t's dtype or `dtype` (built without Python meta kernels,
    the first of which would import sympy: ~0.3 s)."""
    m = TensorMeta.of(t)
    base = torch.empty(max(m.span, 1), dtype=dtype or t.dtype, device="meta")
    return base.as_strided(m.shape, m.stride, m.offset)


LOWERINGS: dict[Any, Callable[..., Sym]] = {}


def register(*keys: Any) -> Callable[[Callable[..., Sym]], Callable[..., Sym]]:
    def deco(fn: Callable[..., Sym]) -> Callable[..., Sym]:
        for k in keys:
            LOWERINGS[k] = fn
        return fn

    return deco


class Lowerer:
    def __init__(self, captured: Captured) -> None:
        self.captured = captured
        self.nodes: list[Node] = []
        self.inputs: list[str] = []
        self.param_syms: dict[int, Sym] = {}
        self.base: dict[str, str] = {}  # view (or aliasing extern result) -> the value owning memory
        self.view_root: dict[str, str] = {}  # VIEW -> the value it is addressed from
        self.viewed: set[str] = set()
        # Values whose layout a compile-time decision rests on (a native op or view reads it, a
        # size query was folded): an EXTERN result among them is checked at run time.
        self.layout_read: set[str] = set()
        self.ops: dict[str, Op] = {}
        self.externs: list[tuple[str, str]] = []
        self.reads_training: list[torch.nn.Module] = []
        self.env: dict[torch.fx.Node, Any] = {}
        self.real: dict[str, Any] = {}  # example value of each Sym (see example())

    # --- building IR -------------------------------------------------------------------------
    def emit(self, op: Op, inputs: tuple[Operand, ...], meta: Any, prefix: str = "v", **attrs: Any) -> Sym:
        name = f"{prefix}{len(self.nodes)}"
        tmeta = TensorMeta.of(meta) if _strided(meta) else None
        self.nodes.append(Node(name, op, inputs, tmeta, attrs))
        self.ops[name] = op
        return Sym(name, meta)

    def param(self, t: torch.Tensor, label: str) -> Sym:
        if id(t) not in self.param_syms:
            self.param_syms[id(t)] = self.emit(Op.PARAM, (), to_meta(t), "p", label=label, tensor=t)
        return self.param_syms[id(t)]

    def owner(self, name: str) -> str:
        return self.base.get(name, name)

    def view(self, src: Sym, fn: Callable[[torch.Tensor], torch.Tensor]) -> Sym:
        """`fn(src)` for a view-like fn, as IR: the same value, a VIEW, or a copy then a VIEW.

        `fn` runs on src's example tensor; whether the result shares its memory decides.
        """
        example = self.example(src)
        res = fn(example)
        if res is example:
            return src
        if _aliased(res, {src.name: example}) is not None:
            # An EXTERN result that aliases memory is addressed from its own data pointer: a
            # value-decided view (narrow with a tensor start) moves from call to call.
            root = self.view_root.get(src.name, src.name)
            self.viewed.update((root, self.owner(root)))
            sym = self.emit(Op.VIEW, (root,), to_meta(res))
            self.base[sym.name] = self.owner(root)
            self.view_root[sym.name] = root
        elif tuple(res.shape) != tuple(example.shape):
            # reshape of a layout no view can express: ATen copies to contiguous, then views.
            copied = self.emit(Op.COPY, (src.name,), torch.empty(example.shape, dtype=res.dtype, device="meta"))
            return self.view(copied, lambda t: t.view(res.shape))
        else:
            sym = self.emit(Op.COPY, (src.name,), to_meta(res))
        self.real[sym.name] = res
        return sym

    def example(self, s: Sym) -> Any:
        """The real value of `s` in the first call (an argument's copy, or what an op gave
        when lowering ran it), else a tensor of zeros laid out like `s`."""
        if s.name not in self.real:
            if not s.is_tensor:
                raise Unsupported(f"{s.name} has no example value")
            m = s.meta
            flat = torch.zeros(max(TensorMeta.of(m).span, 1), dtype=m.dtype)
            self.real[s.name] = flat.as_strided(m.shape, m.stride(), m.storage_offset())
        return self.real[s.name]

    def elementwise(self, op: Op, operands: tuple[Any, ...], out: Any, **attrs: Any) -> Sym:
        want = torch.bool if op in COMPARE else torch.float32
        if not isinstance(out, torch.Tensor) or out.dtype != want:
            raise NotNative(f"result dtype {getattr(out, 'dtype', type(out))} is not {want}")
        ir_ops: list[Operand] = []
        for i, a in enumerate(operands):
            ir_ops.append(self._operand(a, allow_bool=(op is Op.WHERE and i == 0)))
        return self.emit(op, tuple(ir_ops), out, **attrs)

    def _operand(self, a: Any, allow_bool: bool) -> Operand:
        if isinstance(a, Sym):
            want = torch.bool if allow_bool else torch.float32
            if not a.is_tensor or a.meta.dtype != want:
                raise NotNative(f"operand dtype {getattr(a.meta, 'dtype', '?')} is not {want}")
            return a.name
        if isinstance(a, (bool, int, float)) and not allow_bool:
            # ATen casts a Python scalar to the op's float32 compute type before using it.
            return float(torch.tensor(float(a), dtype=torch.float32).item())
        raise NotNative(f"operand of type {type(a).__name__}")

    # --- running FX nodes --------------------------------------------------------------------
    def run(self, example_args: tuple[Any, ...]) -> Lowered:
        out_node = None
        placeholders = 0
        for node in self.captured.graph.nodes:
            if node.op == "placeholder":
                if placeholders < len(example_args):
                    self.env[node] = self._placeholder(node, placeholders, example_args[placeholders])
                elif node.args:  # a parameter the call left at its default
                    self.env[node] = node.args[0]
                else:
                    raise TypeError(f"missing argument {node.target!r}")
                placeholders += 1
            elif node.op == "get_attr":
                self.env[node] = self._get_attr(node.target)
            elif node.op == "output":
                out_node = node
            else:
                self.env[node] = self._call(node)
        return self._finish(out_node, len(example_args))

    def _placeholder(self, node: torch.fx.Node, index: int, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value  # specialised: the runtime guards the exact value
        sym = self.emit(Op.INPUT, (), to_meta(value), "x", label=node.name, index=index)
        self.inputs.append(sym.name)
        # Ops run on the first call's values, as eager runs them: a data-dependent result then
        # has eager's first layout, and an op that rejects zeros (cholesky) still lowers.
        self.real[sym.name] = _copy(value)
        return sym

    def _get_attr(self, target: str) -> Any:
        obj: Any = self.captured.root
        for part in target.split("."):
            obj = getattr(obj, part)
        return self.param(obj, target) if isinstance(obj, torch.Tensor) else obj

    def _load(self, a: Any) -> Any:
        return _map(lambda v: self.env[v] if isinstance(v, torch.fx.Node) else v, a)

    def _call(self, node: torch.fx.Node) -> Any:
        args, kwargs = self._load(node.args), self._load(node.kwargs)
        if node.op == "call_module":
            mod = self.captured.root.get_submodule(node.target)
            return self.call(mod, args, kwargs, key=type(mod), label=f"{node.target} ({type(mod).__name__})")
        if node.op == "call_method":
            fn = getattr(torch.Tensor, node.target)
            return self.call(fn, args, kwargs, key=node.target, label=f".{node.target}")
        return self.call(node.target, args, kwargs, key=node.target, label=_fn_name(node.target))

    def call(self, fn: Any, args: tuple, kwargs: dict, key: Any, label: str) -> Any:
        """Lower one torch-level call: fold constants, else a native row, else EXTERN."""
        rule = META_RULES.get(key)
        out = rule(fn, _metas(args), _metas(kwargs)) if rule is not None else None
        mutated: list[Sym] = []
        aliased = out_real = None
        if out is None:
            out_real, mutated, aliased = self._example_call(fn, args, kwargs)
            out = pytree.tree_map(lambda t: to_meta(t) if _strided(t) else t, out_real, is_leaf=_is_size)
        tensors = any(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(out))
        if not tensors and not isinstance(fn, torch.nn.Module):
            syms = [v for v in _leaves((args, kwargs)) if isinstance(v, Sym)]
            if not syms or (_layout_query(key, args) and all(v.is_tensor for v in syms)):
                self._layout_read(syms)
                return out  # sizes, dtypes, ...: constants of this specialisation
            # .item(), .tolist(), arithmetic on their results: values of the call, read each call
        emitted = len(self.nodes)
        result = self._native_or_extern(fn, args, kwargs, key, label, out)
        fresh = isinstance(result, Sym) and len(self.nodes) > emitted and self.nodes[-1].name == result.name
        if isinstance(result, Sym) and out_real is not None:
            self.real.setdefault(result.name, out_real)
        for m in mutated:
            self._functionalize(m, result, label)
        # Only an EXTERN emitted here can alias: a lowering may also hand back an existing value
        # (contiguous() of a contiguous tensor, dropout in eval), which keeps its own owner.
        if aliased is not None and fresh and self.ops[result.name] is Op.EXTERN:
            owner = self.owner(aliased)
            self.base[result.name] = owner
            self.viewed.add(owner)
            self.nodes[-1].attrs["alias_of"] = owner
        return result

    def _example_call(self, fn: Any, args: tuple, kwargs: dict) -> tuple[Any, list[Sym], str | None]:
        """Run the op on example tensors to learn eager's output layout, errors and aliasing.

        Not meta tensors: many meta kernels are Python, and the first of them imports sympy
        (about 2 s here), while the first call must cost milliseconds.
        """
        syms = [s for s in _leaves((args, kwargs)) if isinstance(s, Sym)]
        real = {s.name: self.example(s) for s in syms}
        versions = {n: t._version for n, t in real.items() if isinstance(t, torch.Tensor)}
        swap = lambda v: real[v.name] if isinstance(v, Sym) else v  # noqa: E731
        out_real = fn(*_map(swap, args), **_map(swap, kwargs))
        mutated = [s for s in syms if s.name in versions and real[s.name]._version != versions[s.name]]
        return out_real, mutated, _aliased(out_real, real)

    def _native_or_extern(self, fn: Any, args: tuple, kwargs: dict, key: Any, label: str, out: Any) -> Any:
        why = "no native lowering"
        if key in LOWERINGS and not config.disable_native:
            try:
                result = LOWERINGS[key](self, fn, args, kwargs, out)
            except NotNative as e:
                why = str(e)
            else:
                self._layout_read(_leaves((args, kwargs)))
                return result
        self.externs.append((label, why))
        inputs = tuple(dict.fromkeys(s.name for s in _leaves((args, kwargs)) if isinstance(s, Sym)))
        return self.emit(Op.EXTERN, inputs, out, "e", fn=fn, label=label, why=why, args=args, kwargs=kwargs)

    def _layout_read(self, leaves: list[Any]) -> None:
        for v in leaves:
            if isinstance(v, Sym) and v.is_tensor:
                self.layout_read.add(self.view_root.get(v.name, v.name))

    def _functionalize(self, mutated: Sym, result: Any, label: str) -> None:
        if self.ops[mutated.name] in (Op.INPUT, Op.PARAM) or mutated.name in self.base:
            raise Unsupported(f"{label} changes a model input, parameter or view in place")
        if mutated.name in self.viewed:
            raise Unsupported(f"{label} changes in place a value that has views")
        if not isinstance(result, Sym):
            raise Unsupported(f"{label} changes a value in place and returns no tensor")
        for k, v in self.env.items():
            if v is mutated:
                self.env[k] = result

    def _finish(self, out_node: torch.fx.Node, n_args: int) -> Lowered:
        leaves, spec = pytree.tree_flatten(_mutable(self._load(out_node.args[0])), _is_size)
        out_leaves = [v.name if isinstance(v, Sym) else ("const", v) for v in leaves]
        outputs = tuple(dict.fromkeys(v for v in out_leaves if isinstance(v, str)))
        graph = Graph(tuple(self.inputs), tuple(self.nodes), outputs)
        reads = frozenset(self.layout_read)
        return Lowered(graph, spec, out_leaves, self.externs, n_args, tuple(self.reads_training), reads)


def lower(captured: Captured, example_args: tuple[Any, ...]) -> Lowered:
    """Lower `captured` for inputs laid out like `example_args`."""
    # fork_rng: example runs of random ops must not move the generator eager will use.
    with torch.inference_mode(False), torch.no_grad(), torch.random.fork_rng(devices=[]):
        return Lowerer(captured).run(example_args)


def _mutable(x: Any) -> Any:
    """FX stores outputs in immutable_dict/immutable_list; the caller gets dict/list, as eager."""
    if isinstance(x, dict):
        return {k: _mutable(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_mutable(v) for v in x]
    if isinstance(x, torch.Size):
        return x
    if isinstance(x, tuple) and type(x) is not tuple and hasattr(x, "_fields"):
        return type(x)(*(_mutable(v) for v in x))
    if isinstance(x, tuple):
        return tuple(_mutable(v) for v in x)
    return x


def _strided(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.layout == torch.strided


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` in memory of its own, with t's sizes, strides and storage offset."""
    m = TensorMeta.of(t)
    buf = torch.empty(max(m.span, 1), dtype=t.dtype)
    if m.span > m.offset:
        buf[m.offset : m.span] = t.as_strided((m.span - m.offset,), (1,), m.offset)
    return buf.as_strided(m.shape, m.stride, m.offset)


# Calls whose result depends on their tensor arguments' layouts only, not on their values.
_LAYOUT_METHODS = frozenset(
    "size dim ndimension stride numel nelement element_size is_contiguous storage_offset "
    "is_floating_point is_complex is_signed get_device __len__ type".split()
)
_LAYOUT_FUNCTIONS = frozenset({len, torch.numel, torch.is_tensor, torch.is_floating_point, torch.is_complex})
_LAYOUT_ATTRS = frozenset("shape dtype device ndim layout is_cuda is_sparse is_meta itemsize nbytes".split())


def _layout_query(key: Any, args: tuple) -> bool:
    if key is getattr:
        return len(args) >= 2 and args[1] in _LAYOUT_ATTRS
    return key in _LAYOUT_METHODS or key in _LAYOUT_FUNCTIONS


def _is_size(x: Any) -> bool:
    """A torch.Size is one value: pytree would take it apart and rebuild it as a plain tuple."""
    return isinstance(x, torch.Size)


def _map(fn: Callable[[Any], Any], tree: Any) -> Any:
    """pytree.tree_map, also inside slices (`x[: n]` with a traced n)."""
    within = lambda v: slice(fn(v.start), fn(v.stop), fn(v.step)) if isinstance(v, slice) else fn(v)  # noqa: E731
    return pytree.tree_map(within, tree, is_leaf=_is_size)


def _leaves(tree: Any) -> list[Any]:
    """pytree.tree_leaves, with a slice's start, stop and step as leaves."""
    out: list[Any] = []
    for v in pytree.tree_leaves(tree, is_leaf=_is_size):
        out.extend((v.start, v.stop, v.step) if isinstance(v, slice) else (v,))
    return out


def _metas(tree: Any) -> Any:
    return _map(lambda v: v.meta if isinstance(v, Sym) else v, tree)


def _aliased(out: Any, inputs: dict[str, Any]) -> str | None:
    """The input (by name) whose memory some tensor of `out` shares, if any."""
    storages = {}
    for name, value in inputs.items():
        for t in pytree.tree_leaves(value):
            if _strided(t):
                storages.setdefault(t.untyped_storage()._cdata, name)
    for t in pytree.tree_leaves(out):
        if _strided(t) and t.untyped_storage()._cdata in storages:
            return storages[t.untyped_storage()._cdata]
    return None


def _fn_name(fn: Any) -> str:
    mod = getattr(fn, "__module__", "") or ""
    return f"{mod.replace('torch.nn.functional', 'F')}.{getattr(fn, '__name__', fn)}".lstrip(".")


# --- the registry ------------------------------------------------------------------------------
# A row takes (lowerer, fn, args, kwargs, meta result) and returns a Sym, or raises NotNative.


def _no_out(kwargs: dict) -> None:
    if kwargs.get("out") is not None:
        raise NotNative("out= argument")


def _binary(op: Op) -> Callable[..., Sym]:
    def row(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
        _no_out(kwargs)
        if kwargs.get("alpha", 1) != 1:
            raise NotNative("alpha != 1 (ATen fuses it into an FMA)")
        if kwargs.get("rounding_mode") is not None:
            raise NotNative("rounding_mode")
        a, b = args[0], args[1] if len(args) > 1 else kwargs["other"]
        if op is Op.DIV and not isinstance(a, Sym):
            # `2 / x` is Tensor.__rtruediv__: reciprocal(x) * 2 in eager, two roundings.
            recip = lw.elementwise(Op.DIV, (1.0, b), out)
            return lw.elementwise(Op.MUL, (recip, a), out)
        return lw.elementwise(op, (a, b), out)

    return row


def _rsub(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
    if kwargs.get("alpha", 1) != 1:
        raise NotNative("alpha != 1")
    return lw.elementwise(Op.SUB, (args[1], args[0]), out)


def _unary(op: Op) -> Callable[..., Sym]:
    def row(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
        _no_out(kwargs)
        return lw.elementwise(op, (args[0],), out)

    return row


def _pow(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
    """ATen's pow with the exponents its CPU kernel computes with IEEE arithmetic instead of
    std::pow: x * x, x * x * x, 1 / x and 1 / (x * x), in that order of operations. (Its
    sqrt, for 0.5, is not correctly rounded: through ATen.)"""
    _no_out(kwargs)
    x, e = args[0], args[1] if len(args) > 1 else kwargs["exponent"]
    if not isinstance(e, (int, float)) or isinstance(e, bool) or e not in (2, 3, -1, -2):
        raise NotNative(f"pow with exponent {e!r}")
    if e == -1:
        return lw.elementwise(Op.DIV, (1.0, x), out)
    square = lw.elementwise(Op.MUL, (x, x), out)
    if e == 2:
        return square
    return lw.elementwise(Op.MUL, (square, x), out) if e == 3 else lw.elementwise(Op.DIV, (1.0, square), out)


def _pow_by(exponent: int) -> Callable[..., Sym]:
    """square (2) and reciprocal (-1): ATen computes them as pow does."""
    return lambda lw, fn, args, kwargs, out: _pow(lw, fn, (args[0], exponent), kwargs, out)


def _cat(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
    """ATen's cat of float32 tensors: a copy of each along `dim` (it skips 1-D empty tensors)."""
    _no_out(kwargs)
    tensors, dim = args[0], args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if not isinstance(out, torch.Tensor) or out.dtype != torch.float32:
        raise NotNative("cat whose result is not float32")
    if not all(isinstance(t, Sym) and t.is_tensor and t.meta.dtype == torch.float32 for t in tensors):
        raise NotNative("cat of tensors that are not all float32")
    if not isinstance(dim, int):
        raise NotNative("cat along a named dimension")
    parts = [t.name for t in tensors if not (t.meta.dim() == 1 and t.meta.numel() == 0)]
    if not parts:
        raise NotNative("cat of empty tensors only")
    return lw.emit(Op.CAT, tuple(parts), out, dim=dim % out.dim())


def _stack(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
    """ATen's stack: cat of the tensors unsqueezed at `dim`."""
    tensors, dim = args[0], args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if not all(isinstance(t, Sym) and t.is_tensor for t in tensors) or not isinstance(dim, int):
        raise NotNative("stack of non-tensors or along a named dimension")
    d = dim % out.dim()
    return _cat(lw, fn, ([lw.view(t, lambda e: e.unsqueeze(d)) for t in tensors], d), kwargs, out)


def _masked_fill(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
    """x.masked_fill(mask, value) with a Python value: where(mask, value, x)."""
    x, mask = args[0], args[1]
    value = args[2] if len(args) > 2 else kwargs.get("value")
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise NotNative("masked_fill with a tensor value")
    return lw.elementwise(Op.WHERE, (mask, value, x), out)


def _leaky_relu(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
    slope = args[1] if len(args) > 1 else kwargs.get("negative_slope", 0.01)
    return lw.elementwise(Op.LEAKY_RELU, (args[0],), out, slope=lw._operand(slope, False))


def _clamp_bounds(lw: Lowerer, lo: Any, hi: Any, x: Any, out: Any) -> Sym:
    if isinstance(lo, Sym) or isinstance(hi, Sym):
        raise NotNative("tensor bounds")
    bound = lambda v: None if v is None else lw._operand(v, False)
    return lw.elementwise(Op.CLAMP, (x,), out, lo=bound(lo), hi=bound(hi))


def _clamp(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
    _no_out(kwargs)
    lo = args[1] if len(args) > 1 else kwargs.get("min")
    hi = args[2] if len(args) > 2 else kwargs.get("max")
    return _clamp_bounds(lw, lo, hi, args[0], out)


def _hardtanh(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
    lo = args[1] if len(args) > 1 else kwargs.get("min_val", -1.0)
    hi = args[2] if len(args) > 2 else kwargs.get("max_val", 1.0)
    return _clamp_bounds(lw, lo, hi, args[0], out)


def _clamp_one(lo: bool) -> Callable[..., Sym]:
    """clamp_min (lo) or clamp_max: clamp with one bound."""

    def row(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
        _no_out(kwargs)
        bound = args[1] if len(args) > 1 else kwargs.get("min" if lo else "max")
        return _clamp_bounds(lw, bound if lo else None, None if lo else bound, args[0], out)

    return row


def _relu6(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
    return _clamp_bounds(lw, 0.0, 6.0, args[0], out)


def _hardsigmoid(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
    """ATen's hardsigmoid: min(max(x + 3, 0), 6) / 6, in that order."""
    return lw.elementwise(Op.DIV, (_shifted_relu6(lw, args[0], out), 6.0), out)


def _hardswish(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
    """ATen's hardswish: x * min(max(x + 3, 0), 6) / 6, in that order."""
    scaled = lw.elementwise(Op.MUL, (args[0], _shifted_relu6(lw, args[0], out)), out)
    return lw.elementwise(Op.DIV, (scaled, 6.0), out)


def _shifted_relu6(lw: Lowerer, x: Any, out: Any) -> Sym:
    return _clamp_bounds(lw, 0.0, 6.0, lw.elementwise(Op.ADD, (x, 3.0), out), out)


def _threshold(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
    """ATen's threshold: x <= threshold ? value : x (NaN stays)."""
    if isinstance(fn, torch.nn.Module):
        threshold, value = fn.threshold, fn.value
    else:
        threshold = args[1] if len(args) > 1 else kwargs["threshold"]
        value = args[2] if len(args) > 2 else kwargs["value"]
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (threshold, value)):
        raise NotNative("threshold with tensor bounds")
    below = lw.elementwise(Op.LE, (args[0], threshold), to_meta(out, torch.bool))
    return lw.elementwise(Op.WHERE, (below, value, args[0]), out)


def _prelu(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
    """ATen's prelu: the weight reshaped to lie along dimension 1, then x > 0 ? x : weight * x."""
    x = args[0]
    if isinstance(fn, torch.nn.PReLU):
        w = lw.param(fn.weight, "weight")
    else:
        w = args[1] if len(args) > 1 else kwargs["weight"]
    if not (isinstance(x, Sym) and isinstance(w, Sym) and x.is_tensor and w.is_tensor):
        raise NotNative("prelu of non-tensors")
    if w.meta.dim() == 1:
        shape = [1] * x.meta.dim()
        if len(shape) > 1:
            shape[1] = w.meta.numel()
        w = lw.view(w, lambda t: t.reshape(shape))
    above = lw.elementwise(Op.GT, (x, 0.0), to_meta(out, torch.bool))
    return lw.elementwise(Op.WHERE, (above, x, lw.elementwise(Op.MUL, (w, x), out)), out)


def _where(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
    _no_out(kwargs)
    if len(args) != 3:
        raise NotNative("where with one argument")
    return lw.elementwise(Op.WHERE, args, out)


def _identity(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Any:
    return args[0]


def _conversion(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Any:
    """x.to(...), .float(), .type_as(y), ...: x itself where ATen returns x unchanged (the dtype,
    device and layout asked for are x's own: Llama's and T5's `.to(float32)` on float32), which
    depends on layouts only; a conversion that copies runs through ATen."""
    src = args[0]
    if not (isinstance(src, Sym) and src.is_tensor):
        raise NotNative("a conversion of a non-tensor")
    example = lw.example(src)
    rest = _map(lambda v: lw.example(v) if isinstance(v, Sym) else v, (args[1:], kwargs))
    if fn(example, *rest[0], **rest[1]) is not example:
        raise NotNative("a conversion that copies")
    return src


def _dropout(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Any:
    if isinstance(fn, torch.nn.Module):
        lw.reads_training.append(fn)  # the program is for this flag: the entry checks it
        training = fn.training
    else:
        training = kwargs.get("training", args[2] if len(args) > 2 else True)
    if training:
        raise NotNative("dropout in training mode is random")
    return args[0]


def _view_op(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
    src = args[0]
    if not isinstance(src, Sym) or not isinstance(out, torch.Tensor):
        raise NotNative("not a tensor view")
    given = [v for v in _leaves((args[1:], kwargs)) if isinstance(v, Sym)]
    if given and getattr(fn, "__name__", None) not in _LAYOUT_OF:
        raise NotNative("a tensor's value decides the view")  # narrow(x, d, start_tensor, n)
    rest = pytree.tree_map(lambda v: lw.example(v) if isinstance(v, Sym) else v, (args[1:], kwargs))
    return lw.view(src, lambda t: fn(t, *rest[0], **rest[1]))


# Views whose other tensor argument only lends its shape.
_LAYOUT_OF = frozenset({"expand_as", "view_as", "reshape_as"})


def _getitem(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Any:
    src, idx = args
    items = idx if type(idx) is tuple else (idx,)  # a list index is advanced indexing: a copy
    basic = all(i is None or i is Ellipsis or isinstance(i, (int, slice)) for i in items)
    if isinstance(src, Sym) and src.is_tensor and basic and not any(isinstance(v, Sym) for v in _leaves(items)):
        return lw.view(src, lambda t: t[idx])
    raise NotNative("indexing that is not a view")


# --- GEMMs: mirror ATen's linear/addmm/mm argument choices, so sgemm_ gets eager's arguments ---


def blas_args(c: TensorMeta, m1: TensorMeta, m2: TensorMeta) -> dict[str, Any] | None:
    """The sgemm_ call ATen's addmm_impl_cpu_ makes for these layouts, or None if it copies."""
    (rows, cols), s = c.shape, c.stride
    if s[0] == 1 and (cols == 1 or s[1] >= max(1, rows)):
        swap = False
    elif s[1] == 1 and (rows == 1 or s[0] >= max(1, cols)):
        swap = True
    else:
        return None
    a, b = (m2, m1) if swap else (m1, m2)
    m, n = (cols, rows) if swap else (rows, cols)
    k = a.shape[0] if swap else a.shape[1]
    r, q = (1, 0) if swap else (0, 1)  # the row/column axes as BLAS sees them

    def cast(t: TensorMeta, lead_n: int, lead_t: int) -> bool | None:
        # transposed for BLAS?  None where ATen would clone the operand first
        if t.stride[r] == 1 and t.stride[q] >= max(1, lead_n):
            return False
        if t.stride[q] == 1 and t.stride[r] >= max(1, lead_t):
            return True
        return None

    ta, tb = cast(a, m, k), cast(b, k, n)
    if ta is None or tb is None:
        return None
    lda = a.stride[1 if ta == swap else 0]
    ldb = b.stride[1 if tb == swap else 0]
    ldc = c.stride[0 if swap else 1]
    args = _blas_call(ta, tb, m, n, k, lda, ldb, ldc)
    return None if args is None else dict(swap=swap, **args)


def _blas_call(ta: bool, tb: bool, m: int, n: int, k: int, lda: int, ldb: int, ldc: int) -> dict[str, Any] | None:
    """cpublas's normalize_last_dims, then its use_blas_gemm test (None: ATen does not call BLAS)."""
    if n == 1:
        ldc = m
    if ta:
        lda = k if m == 1 else lda
    elif k == 1:
        lda = m
    if tb:
        ldb = n if k == 1 else ldb
    elif n == 1:
        ldb = k
    big = 2**31 - 1
    ok = max(m, n, k, lda, ldb, ldc) <= big and lda >= max(1, k if ta else m)
    ok = ok and ldb >= max(1, n if tb else k) and ldc >= max(1, m)
    return dict(ta=ta, tb=tb, m=m, n=n, k=k, lda=lda, ldb=ldb, ldc=ldc) if ok else None


def bmm_blas_args(c: TensorMeta, b1: TensorMeta, b2: TensorMeta) -> dict[str, Any] | None:
    """The cblas_sgemm_batch call ATen's bmm makes for these layouts (LinearAlgebra.cpp:
    bmm_out_or_baddbmm_, baddbmm_with_gemm_), or None where it takes another path: its own loop
    below 400 multiply-adds a matrix, per-matrix addmm for other layouts, sgemm_ for one matrix,
    oneDNN when the float32 matmul precision is reduced (see _full_precision)."""
    (batch, rows, inner), cols = b1.shape, b2.shape[2]
    if batch < 2 or rows * cols == 0 or inner * rows * cols < 400 or c.stride != contiguous_strides(c.shape):
        return None

    def items(t: TensorMeta) -> bool:  # each matrix contiguous or transposed
        (_, r, q), (_, sr, sq) = t.shape, t.stride
        return (sq == 1 and (r == 1 or sr >= q)) or (sr == 1 and (q == 1 or sq >= r))

    def transposed(t: TensorMeta) -> bool:
        return t.stride[1] == 1 and t.stride[2] >= t.shape[1]

    if not (items(b1) and items(b2)):
        return None
    ta, tb = transposed(b2), transposed(b1)  # column-major BLAS: A is batch2, B is batch1
    lda, ldb = b2.stride[2 if ta else 1], b1.stride[2 if tb else 1]
    args = _blas_call(ta, tb, cols, rows, inner, lda, ldb, c.stride[1])
    return None if args is None else dict(batch=batch, stride_a=b2.stride[0], stride_b=b1.stride[0], **args)


def _full_precision() -> None:
    """ATen's float32 matmuls call BLAS only in full precision: under a reduced one (bf16, tf32)
    they may call oneDNN's GEMM instead. Native GEMMs are compiled for the precision of the
    moment, and the entry checks it on every call."""
    if jit.matmul_precision() not in jit.FULL_PRECISION:
        raise NotNative("float32 matmul precision is reduced: ATen may call oneDNN's GEMM")


def _gemm(lw: Lowerer, m1: Sym, m2: Sym, bias: Sym | None, beta: float) -> Sym:
    _full_precision()
    for t in (m1, m2) + ((bias,) if bias is not None else ()):
        if not (isinstance(t, Sym) and t.is_tensor and t.meta.dtype == torch.float32):
            raise NotNative("GEMM operands must be float32 tensors")
    if m1.meta.dim() != 2 or m2.meta.dim() != 2:
        raise NotNative("GEMM on tensors that are not 2-D")
    out = _mm_meta(m1.meta, m2.meta)
    if bias is not None and beta != 0:
        broadcast_shape(bias.meta.shape, out.shape)  # addmm's check: bias expands to (M, N)
    args = blas_args(TensorMeta.of(out), TensorMeta.of(m1.meta), TensorMeta.of(m2.meta))
    if args is None:
        raise NotNative("layout ATen copies before its GEMM")
    inputs = (m1.name, m2.name, bias.name if bias is not None and beta != 0 else None)
    beta = float(beta) if bias is not None else 0.0
    return lw.emit(Op.GEMM, inputs, out, beta=beta, blas=args, one_thread=_one_thread(args, beta))


def _one_thread(blas: dict[str, Any], beta: float) -> bool:
    """Whether this small GEMM may call sgemm_ on one thread: only where MKL gives the bits it
    gives on its own thread count (the entry then checks that count on every call)."""
    flops = 2 * blas["m"] * blas["n"] * blas["k"]
    if not 0 < flops < config.one_thread_gemm_flops or jit.mkl_threads() == 1:
        return False
    return jit.one_thread_same(blas, beta)


# --- output layouts of the GEMM family, without their Python meta kernels (see _example_call) ---


def _mm_meta(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.dim() != 2 or b.dim() != 2:
        raise RuntimeError(f"self must be a matrix (got {a.dim()}-D and {b.dim()}-D)")
    if a.shape[1] != b.shape[0]:
        raise RuntimeError(
            f"mat1 and mat2 shapes cannot be multiplied ({a.shape[0]}x{a.shape[1]} and {b.shape[0]}x{b.shape[1]})"
        )
    if a.dtype != b.dtype:
        raise RuntimeError(f"expected m1 and m2 to have the same dtype, but got: {a.dtype} != {b.dtype}")
    return torch.empty((a.shape[0], b.shape[1]), dtype=a.dtype, device="meta")


def _linear_rule(fn: Any, args: tuple, kwargs: dict) -> torch.Tensor | None:
    x, w, b = _linear_parts(fn, args, kwargs)
    if isinstance(fn, torch.nn.Linear):
        w, b = to_meta(fn.weight), None if fn.bias is None else to_meta(fn.bias)
    if not isinstance(x, torch.Tensor) or x.dim() not in (2, 3) or w.dim() != 2:
        return None
    rows = 1
    for d in x.shape[:-1]:
        rows *= d
    out = _mm_meta(torch.empty((rows, x.shape[-1]), dtype=x.dtype, device="meta"), w.t())
    if b is not None:
        broadcast_shape(b.shape, out.shape)
    return out.view(*x.shape[:-1], w.shape[0])


def _mm_rule(fn: Any, args: tuple, kwargs: dict) -> torch.Tensor | None:
    a, b = args[0], args[1]
    ok = all(isinstance(t, torch.Tensor) and t.dim() == 2 for t in (a, b)) and kwargs.get("out") is None
    return _mm_meta(a, b) if ok else None


def _addmm_rule(fn: Any, args: tuple, kwargs: dict) -> torch.Tensor | None:
    out = _mm_rule(fn, args[1:], kwargs)
    if out is not None and isinstance(args[0], torch.Tensor):
        broadcast_shape(args[0].shape, out.shape)
        return out
    return None


META_RULES: dict[Any, Callable[..., torch.Tensor | None]] = {}
for _k in (F.linear, torch.nn.Linear):
    META_RULES[_k] = _linear_rule
for _k in (torch.mm, "mm", torch.matmul, operator.matmul, "matmul", "__matmul__"):
    META_RULES[_k] = _mm_rule
for _k in (torch.addmm, "addmm"):
    META_RULES[_k] = _addmm_rule


def _bmm(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
    _no_out(kwargs)
    _full_precision()
    b1, b2 = args[0], args[1] if len(args) > 1 else kwargs.get("mat2")
    for t in (b1, b2):
        if not (isinstance(t, Sym) and t.is_tensor and t.meta.dtype == torch.float32 and t.meta.dim() == 3):
            raise NotNative("bmm operands must be 3-D float32 tensors")
    args = bmm_blas_args(TensorMeta.of(out), TensorMeta.of(b1.meta), TensorMeta.of(b2.meta))
    if args is None:
        raise NotNative("a bmm ATen computes without MKL's batched GEMM")
    return lw.emit(Op.BMM, (b1.name, b2.name), out, blas=args)


def _linear_parts(fn: Any, args: tuple, kwargs: dict) -> tuple[Any, Any, Any]:
    if isinstance(fn, torch.nn.Linear):
        return args[0], None, None
    x, w = args[0], args[1] if len(args) > 1 else kwargs["weight"]
    return x, w, args[2] if len(args) > 2 else kwargs.get("bias")


def _linear(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
    """ATen's linear: addmm for a matrix with a bias; the same on the rows of a contiguous
    input of other ranks (_flatten_nd_linear) when the bias is a contiguous vector; else
    matmul(input, weight.t()), then the bias added to it in place."""
    x, w, b = _linear_parts(fn, args, kwargs)
    if isinstance(fn, torch.nn.Linear):
        w = lw.param(fn.weight, "weight")
        b = None if fn.bias is None else lw.param(fn.bias, "bias")
    if not isinstance(x, Sym) or not isinstance(w, Sym) or not x.is_tensor:
        raise NotNative("linear on non-tensors")
    wt = lw.view(w, torch.t)
    if b is not None and x.meta.dim() == 2:
        return _gemm(lw, x, wt, b, 1.0)
    vector = isinstance(b, Sym) and b.is_tensor and b.meta.squeeze().dim() == 1 and b.meta.is_contiguous()
    if vector and x.meta.is_contiguous():
        return _gemm_on_rows(lw, x, wt, b, 1.0, out)
    res = _matmul_of(lw, x, wt, out)
    return res if b is None else lw.elementwise(Op.ADD, (res, b), out)


def _addmm(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
    _no_out(kwargs)
    if kwargs.get("alpha", 1) != 1 or kwargs.get("beta", 1) not in (0, 1):
        raise NotNative("alpha != 1 or beta not in {0, 1}")
    return _gemm(lw, args[1], args[2], args[0], float(kwargs.get("beta", 1)))


def _mm(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
    _no_out(kwargs)
    a, b = args[0], args[1]
    if not (isinstance(a, Sym) and isinstance(b, Sym) and a.is_tensor and b.is_tensor):
        raise NotNative("matmul of non-tensors")
    return _gemm(lw, a, b, None, 0.0)


def _rows() -> None:
    nn = torch.nn
    for op, keys in {
        Op.ADD: (operator.add, operator.iadd, torch.add, "add", "add_", "__add__", "__iadd__", "__radd__"),
        Op.SUB: (operator.sub, operator.isub, torch.sub, torch.subtract, "sub", "sub_", "__sub__", "__isub__"),
        Op.MUL: (
            operator.mul,
            operator.imul,
            torch.mul,
            torch.multiply,
            "mul",
            "mul_",
            "__mul__",
            "__imul__",
            "__rmul__",
        ),
        Op.DIV: (
            operator.truediv,
            operator.itruediv,
            torch.div,
            torch.true_divide,
            "div",
            "div_",
            "__truediv__",
            "__itruediv__",
        ),
        Op.MAXIMUM: (torch.maximum, "maximum"),
        Op.MINIMUM: (torch.minimum, "minimum"),
        Op.LT: (operator.lt, torch.lt, torch.less, "lt", "less", "__lt__"),
        Op.LE: (operator.le, torch.le, torch.less_equal, "le", "less_equal", "__le__"),
        Op.GT: (operator.gt, torch.gt, torch.greater, "gt", "greater", "__gt__"),
        Op.GE: (operator.ge, torch.ge, torch.greater_equal, "ge", "greater_equal", "__ge__"),
        Op.EQ: (operator.eq, torch.eq, "eq", "__eq__"),
        Op.NE: (operator.ne, torch.ne, torch.not_equal, "ne", "not_equal", "__ne__"),
    }.items():
        register(*keys)(_binary(op))
    register(torch.rsub, "rsub", "__rsub__")(_rsub)
    register(operator.neg, torch.neg, torch.negative, "neg", "neg_", "__neg__")(_unary(Op.NEG))
    register(operator.abs, torch.abs, "abs", "abs_", "__abs__")(_unary(Op.ABS))
    register(operator.pow, torch.pow, "pow", "pow_", "__pow__", "__ipow__")(_pow)
    register(torch.square, "square", "square_")(_pow_by(2))
    register(torch.reciprocal, "reciprocal", "reciprocal_")(_pow_by(-1))
    register(torch.masked_fill, "masked_fill", "masked_fill_")(_masked_fill)
    register(torch.cat, torch.concat, torch.concatenate)(_cat)
    register(torch.stack)(_stack)
    register(torch.clamp_min, "clamp_min", "clamp_min_")(_clamp_one(lo=True))
    register(torch.clamp_max, "clamp_max", "clamp_max_")(_clamp_one(lo=False))
    register(torch.relu, torch.relu_, F.relu, F.relu_, "relu", "relu_", nn.ReLU)(_unary(Op.RELU))
    register(F.leaky_relu, F.leaky_relu_, nn.LeakyReLU)(_leaky_relu_any)
    register(torch.clamp, torch.clip, "clamp", "clip", "clamp_", "clip_")(_clamp)
    register(F.hardtanh, F.hardtanh_, nn.Hardtanh)(_hardtanh_any)
    register(F.relu6, nn.ReLU6)(_relu6)
    register(F.hardsigmoid, nn.Hardsigmoid)(_hardsigmoid)
    register(F.hardswish, nn.Hardswish)(_hardswish)
    register(F.threshold, F.threshold_, torch.threshold, nn.Threshold)(_threshold)
    register(F.prelu, torch.prelu, nn.PReLU)(_prelu)
    register(torch.where, "where")(_where)
    register(nn.Identity)(_identity)
    register("to", "type", "type_as", "float", "double", "cpu")(_conversion)
    register(F.dropout, nn.Dropout)(_dropout)
    register(
        torch.reshape,
        torch.flatten,
        torch.transpose,
        torch.permute,
        torch.t,
        torch.unsqueeze,
        torch.squeeze,
        torch.swapaxes,
        torch.movedim,
        torch.narrow,
        "view",
        "reshape",
        "flatten",
        "transpose",
        "permute",
        "t",
        "unsqueeze",
        "squeeze",
        "expand",
        "expand_as",
        "contiguous",
        "view_as",
        "reshape_as",
        "swapaxes",
        "narrow",
        "movedim",
        "unflatten",
    )(_view_op)
    register(nn.Flatten, nn.Unflatten)(_view_op)
    register(operator.getitem, "__getitem__")(_getitem)
    register(F.linear, nn.Linear)(_linear)
    register(torch.bmm, "bmm")(_bmm)
    register(torch.addmm, "addmm")(_addmm)
    register(torch.mm, "mm")(_mm)
    register(torch.matmul, operator.matmul, "matmul", "__matmul__")(_matmul)


def _leaky_relu_any(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
    if isinstance(fn, torch.nn.Module):
        return _leaky_relu(lw, fn, (args[0], fn.negative_slope), {}, out)
    return _leaky_relu(lw, fn, args, kwargs, out)


def _hardtanh_any(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
    if isinstance(fn, torch.nn.Module):
        return _clamp_bounds(lw, fn.min_val, fn.max_val, args[0], out)
    return _hardtanh(lw, fn, args, kwargs, out)


def _matmul(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
    _no_out(kwargs)
    a, b = args[0], args[1]
    if not all(isinstance(t, Sym) and t.is_tensor for t in (a, b)):
        raise NotNative("matmul of non-tensors")
    return _matmul_of(lw, a, b, out)


def _matmul_of(lw: Lowerer, a: Sym, b: Sym, out: Any) -> Sym:
    """ATen's _matmul_impl, where it calls mm or bmm on views of its operands."""
    da, db = a.meta.dim(), b.meta.dim()
    if da == db == 2:
        return _gemm(lw, a, b, None, 0.0)
    if da == 1 and db == 2:  # a.unsqueeze(0).mm(b).squeeze_(0)
        row = lw.view(a, lambda t: t.unsqueeze(0))
        return lw.view(_gemm(lw, row, b, None, 0.0), lambda t: t.squeeze(0))
    if da >= 3 and db == 2 and _folds(a.meta):
        # should_fold: the leading dimensions merge without a copy, so ATen folds them into the
        # rows of one mm (whether or not b requires grad), then views the result
        return _gemm_on_rows(lw, a, b, None, 0.0, out)
    if da == db == 3 and a.meta.shape[0] == b.meta.shape[0]:
        # Equal batches: ATen's matmul calls bmm on t.expand(shape).reshape(shape), which may
        # give size-1 dimensions other strides (and so other BLAS arguments): take its layouts.
        a, b = (lw.view(t, lambda e: e.expand(e.shape).reshape(e.shape)) for t in (a, b))
        return _bmm(lw, torch.bmm, (a, b), {}, out)
    raise NotNative("matmul ATen computes with a matrix-vector product, a copy or a broadcast batch")


def _gemm_on_rows(lw: Lowerer, x: Sym, w: Sym, bias: Sym | None, beta: float, out: Any) -> Sym:
    """A GEMM on x's leading dimensions merged into rows (a view: x is contiguous, or folds),
    its result viewed with `out`'s shape: ATen's _flatten_nd_linear and matmul's fold."""
    rows = lw.view(x, lambda t: t.reshape(math.prod(t.shape[:-1]), t.shape[-1]))
    return lw.view(_gemm(lw, rows, w, bias, beta), lambda t: t.view(out.shape))


def _folds(t: torch.Tensor) -> bool:
    """Whether ATen's matmul folds t @ matrix (t of 3 or more dimensions) into one mm whatever
    requires grad (should_fold): t is empty, or its leading dimensions merge without a copy."""
    return t.numel() == 0 or all(t.stride(i) == t.stride(i + 1) * t.shape[i + 1] for i in range(t.dim() - 2))


_rows()
