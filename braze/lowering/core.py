"""The lowering machinery: the Lowerer runs an FX graph node by node on example tensors (a copy of
the first call's arguments), learning eager's exact output layouts and errors, and asks the
registry (LOWERINGS, one row per op; the rows live in this package's family modules) for each
op's IR. An op without a row, or with arguments a row cannot do bit-exactly, becomes an EXTERN
node that calls the same torch function at run time."""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .. import config
from ..capture import Captured
from ..codegen import float32
from ..ir import COMPARE, INTEGERS, Graph, Node, Op, Operand, TensorMeta


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


def hook_tables(m: torch.nn.Module | None = None) -> tuple[dict, ...]:
    """The forward hooks a call of layer m runs (None: those every layer's call runs)."""
    if m is None:
        return (torch.nn.modules.module._global_forward_pre_hooks, torch.nn.modules.module._global_forward_hooks)
    return (m._forward_pre_hooks, m._forward_hooks)


def hooked(m: torch.nn.Module) -> bool:
    """Whether calling layer m runs forward hooks (its own, or global ones)."""
    return any(hook_tables(m)) or any(hook_tables())


def is_float32(x: Any) -> bool:
    """Whether x is a float32 tensor value of the graph (what braze's kernels compute on)."""
    return isinstance(x, Sym) and x.is_tensor and x.meta.dtype == torch.float32


@dataclass
class Lowered:
    graph: Graph
    out_spec: pytree.TreeSpec
    out_leaves: list[Any]  # per output leaf: an IR value name (str) or a constant ("const", x)
    n_args: int  # positional arguments the program takes
    reads_training: tuple[torch.nn.Module, ...]  # modules whose flag a lowering decided on
    layout_read: frozenset[str] = frozenset()  # see Lowerer.layout_read
    called: tuple[torch.nn.Module, ...] = ()  # the layers the graph calls (call_module)
    # parameters and arguments (PARAM and INPUT names) whose requires_grad a lowering decided on
    # (ATen's matmul folds where the weight requires grad, even under no_grad), with its value:
    # the entry checks it
    grad_read: tuple[tuple[str, bool], ...] = ()
    # Objects other than the layers whose attributes a lowering decided on (torch.backends.mha's
    # switch): the entry watches their dictionaries as it watches the layers' (runtime.Guard)
    watched: tuple[Any, ...] = ()


def to_meta(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A meta tensor with t's layout, of t's dtype or `dtype` (built without Python meta kernels,
    the first of which would import sympy: ~0.3 s)."""
    m = TensorMeta.of(t)
    base = torch.empty(max(m.span, 1), dtype=dtype or t.dtype, device="meta")
    return base.as_strided(m.shape, m.stride, m.offset)


# The registry: op key (a torch callable, a method name, a module class, or the "module.name" of a
# function of a library braze does not import, as torchvision's) -> its row, which takes
# (lowerer, fn, args, kwargs, meta result) and returns a Sym, or raises NotNative.
LOWERINGS: dict[Any, Callable[..., Sym]] = {}
# Output layouts of ops whose Python meta kernels would import sympy (see _example_call).
META_RULES: dict[Any, Callable[..., torch.Tensor | None]] = {}


def register(*keys: Any) -> Callable[[Callable[..., Sym]], Callable[..., Sym]]:
    def deco(fn: Callable[..., Sym]) -> Callable[..., Sym]:
        for k in keys:
            LOWERINGS[k] = fn
        return fn

    return deco


class Lowerer:
    def __init__(self, captured: Captured) -> None:
        self.captured = captured
        self.fast = captured.mode == "fast"  # rows may pick faster kernels than eager's (fast.py)
        self.users: dict[str, int] = {}  # how many FX nodes use each value (fast mode's fusions)
        self.sizes_only: set[str] = set()  # values that follow from the call's sizes alone (DETERMINISTIC)
        self.nodes: list[Node] = []
        self.inputs: list[str] = []
        self.param_syms: dict[int, Sym] = {}
        self.params: dict[str, torch.Tensor] = {}  # PARAM -> the model's tensor
        self.given: dict[str, torch.Tensor] = {}  # INPUT -> the call's own tensor (fast.GemmPack's)
        self.base: dict[str, str] = {}  # view (or aliasing extern result) -> the value owning memory
        self.view_root: dict[str, str] = {}  # VIEW -> the value it is addressed from
        self.viewed: set[str] = set()
        # Values whose layout a compile-time decision rests on (a native op or view reads it, a
        # size query was folded): an EXTERN result among them is checked at run time.
        self.layout_read: set[str] = set()
        self.ops: dict[str, Op] = {}
        self.reads_training: list[torch.nn.Module] = []
        self.watched: list[Any] = []  # see Lowered.watched
        self.grad_read: dict[str, bool] = {}  # see Lowered.grad_read
        self.called: list[torch.nn.Module] = []
        self.env: dict[torch.fx.Node, Any] = {}
        self.real: dict[str, Any] = {}  # example value of each Sym (see example())
        # Calls whose example value is a stand-in until the lowering ends: each is then made on
        # the examples, replacing it (fast mode's packed convolutions: lowering/conv.py)
        self.deferred: dict[str, Callable[[], Any]] = {}
        # eager's result of the call being lowered, on the examples (None where a meta rule gave
        # its layout without running it)
        self.eager_out: Any = None

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
            self.params[self.param_syms[id(t)].name] = t
        return self.param_syms[id(t)]

    def weights(self, layer: torch.nn.Module) -> tuple[Any, Any]:
        """A layer's weight and bias (each None where it has none), as parameters of the program."""
        w, b = layer.weight, layer.bias
        return None if w is None else self.param(w, "weight"), None if b is None else self.param(b, "bias")

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

    def examples(self, tree: Any) -> Any:
        """`tree` with each Sym replaced by its example value."""
        return map_tree(lambda v: self.example(v) if isinstance(v, Sym) else v, tree)

    def live(self, tree: Any) -> Any:
        """`tree` with each Sym replaced by its example value, and each parameter by the model's
        own tensor: what fast mode's packed calls, which only read their operands, pack from
        while lowering, so that the program's first call finds that packing in place."""

        def one(v: Any) -> Any:
            return v if not isinstance(v, Sym) else self.params[v.name] if v.name in self.params else self.example(v)

        return map_tree(one, tree)

    def elementwise(self, op: Op, operands: tuple[Any, ...], out: Any, **attrs: Any) -> Sym:
        """An elementwise node in float32; or, for add, sub, mul and comparisons whose tensors
        are all int32 or all int64 (RoBERTa's position ids), in that dtype."""
        whole = _integer_dtype(op, operands)
        want = torch.bool if op in COMPARE else whole or torch.float32
        if not isinstance(out, torch.Tensor) or out.dtype != want:
            raise NotNative(f"result dtype {getattr(out, 'dtype', type(out))} is not {want}")
        ir_ops: list[Operand] = []
        for i, a in enumerate(operands):
            ir_ops.append(self._operand(a, allow_bool=(op is Op.WHERE and i == 0), whole=whole))
        return self.emit(op, tuple(ir_ops), out, **attrs)

    def _operand(self, a: Any, allow_bool: bool, whole: torch.dtype | None = None) -> Operand:
        if isinstance(a, Sym) and a.is_tensor and not (allow_bool or whole) and a.meta.dtype in _CAST:
            # A bool or integer tensor in float32 arithmetic (Bloom's alibi, `x * mask`): ATen casts
            # it to the op's float32 common dtype, element by element, before the arithmetic.
            a = self.emit(Op.COPY, (a.name,), torch.empty(a.meta.shape, dtype=torch.float32, device="meta"))
        if isinstance(a, Sym):
            want = torch.bool if allow_bool else whole or torch.float32
            if not a.is_tensor or a.meta.dtype != want:
                raise NotNative(f"operand dtype {getattr(a.meta, 'dtype', '?')} is not {want}")
            return a.name
        if whole is not None:  # ATen computes in the tensors' integer dtype: a Python int it holds
            if type(a) is int and torch.iinfo(whole).min <= a <= torch.iinfo(whole).max:
                return a
            raise NotNative(f"a scalar that is not a {whole} value beside {whole} tensors")
        if isinstance(a, (bool, int, float)) and not allow_bool:
            # ATen casts a Python scalar to the op's float32 compute type before using it.
            return float32(float(a))
        raise NotNative(f"operand of type {type(a).__name__}")

    # --- running FX nodes --------------------------------------------------------------------
    def run(self, example_args: tuple[Any, ...]) -> Lowered:
        self.example_args = example_args
        out_node = None
        placeholders = 0
        for node in self.captured.graph.nodes:
            if node.op == "placeholder":
                if placeholders < len(example_args):
                    self.env[node] = self._placeholder(node, placeholders, example_args[placeholders])
                elif node.args:  # a parameter the call left at its default
                    self.env[node] = node.args[0]
                elif str(node.target).startswith("**"):  # **kwargs of a call without keywords
                    self.env[node] = {}  # (a call with keywords goes to TorchDynamo: api._miss)
                else:
                    raise TypeError(f"missing argument {node.target!r}")
                placeholders += 1
            elif node.op == "get_attr":
                self.env[node] = self._get_attr(node.target)
            elif node.op == "output":
                out_node = node
            else:
                self.env[node] = self._call(node)
                if isinstance(self.env[node], Sym):
                    self.users[self.env[node].name] = len(node.users)
        return self._finish(out_node, len(example_args))

    def _placeholder(self, node: torch.fx.Node, index: int, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value  # specialised: the runtime guards the exact value
        sym = self.emit(Op.INPUT, (), to_meta(value), "x", label=node.name, index=index)
        self.inputs.append(sym.name)
        self.given[sym.name] = value
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
        return map_tree(lambda v: self.env[v] if isinstance(v, torch.fx.Node) else v, a)

    def _call(self, node: torch.fx.Node) -> Any:
        args, kwargs = self._load(node.args), self._load(node.kwargs)
        if node.op == "call_module":
            mod = self.captured.root.get_submodule(node.target)
            self.called.append(mod)
            return self.call(mod, args, kwargs, key=type(mod), label=f"{node.target} ({type(mod).__name__})")
        if node.op == "call_method":
            fn = getattr(torch.Tensor, node.target)
            return self.call(fn, args, kwargs, key=node.target, label=f".{node.target}")
        target = node.target
        if target is operator.setitem and isinstance(args[0], Sym) and args[0].is_tensor:
            target = _assign  # returns the tensor it changed, which later nodes read
        return self.call(target, args, kwargs, key=_key(node.target), label=_fn_name(node.target))

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
            syms = _syms(args, kwargs)
            if not syms or (_layout_query(key, args) and all(v.is_tensor for v in syms)):
                self._layout_read(syms)
                return out  # sizes, dtypes, ...: constants of this specialisation
            # .item(), .tolist(), arithmetic on their results: values of the call, read each call
        self.eager_out = out_real
        emitted = len(self.nodes)
        sizes = _among(fn, DETERMINISTIC) and all(v.name in self.sizes_only for v in _syms(args, kwargs))
        result = self._native_or_extern(fn, args, kwargs, key, label, out, sizes)
        fresh = isinstance(result, Sym) and len(self.nodes) > emitted and self.nodes[-1].name == result.name
        if sizes and fresh and self.nodes[-1].op in (Op.EXTERN, Op.VIEW):
            self.sizes_only.add(result.name)
            if self.nodes[-1].op is Op.EXTERN:  # what dce and memoize go by
                self.nodes[-1].attrs.update(sizes=True, factory=_among(fn, FACTORIES))
        if isinstance(result, Sym) and out_real is not None:
            self.real.setdefault(result.name, out_real)
        for m in mutated:
            self._functionalize(m, result, label)
        if mutated and fresh and self.ops[result.name] is Op.EXTERN:  # what passes.memoize must know
            self.nodes[-1].attrs["mutates"] = tuple(m.name for m in mutated)
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
        syms = _syms(args, kwargs)
        real = {s.name: self.example(s) for s in syms}
        versions = {n: t._version for n, t in real.items() if isinstance(t, torch.Tensor)}
        with _model_state_kept(fn):
            out_real = fn(*self.examples(args), **self.examples(kwargs))
        mutated = [s for s in syms if s.name in versions and real[s.name]._version != versions[s.name]]
        return out_real, mutated, _aliased(out_real, real)

    def _native_or_extern(self, fn: Any, args: tuple, kwargs: dict, key: Any, label: str, out: Any, sizes: bool) -> Any:
        why = "no native lowering"
        if isinstance(fn, torch.nn.Module) and hooked(fn):
            return self.extern(fn, args, kwargs, label, "a layer with forward hooks: its own call runs them", out)
        if sizes and not _among(fn, _VIEWS):  # made once per sizes (passes.memoize), not per call
            return self.extern(fn, args, kwargs, label, "its inputs follow from the sizes alone", out)
        if key in LOWERINGS and not config.disable_native:
            try:
                result = LOWERINGS[key](self, fn, args, kwargs, out)
            except NotNative as e:
                why = str(e)
            else:
                self._layout_read(leaves((args, kwargs)))
                return result
        return self.extern(fn, args, kwargs, label, why, out)

    def extern(self, fn: Any, args: tuple, kwargs: dict, label: str, why: str, out: Any) -> Sym:
        """A call of fn(*args, **kwargs) made at run time, as an EXTERN node; `why` for explain."""
        inputs = tuple(dict.fromkeys(s.name for s in _syms(args, kwargs)))
        return self.emit(Op.EXTERN, inputs, out, "e", fn=fn, label=label, why=why, args=args, kwargs=kwargs)

    def _layout_read(self, leaves: list[Any]) -> None:
        for v in leaves:
            if isinstance(v, Sym) and v.is_tensor:
                self.layout_read.add(self.view_root.get(v.name, v.name))

    def _functionalize(self, mutated: Sym, result: Any, label: str) -> None:
        if self.ops[self.owner(mutated.name)] in (Op.INPUT, Op.PARAM):
            raise Unsupported(f"{label} changes a model input or parameter in place")
        if mutated.name in self.base and not self._sole_alias(mutated):
            raise Unsupported(f"{label} changes a view in place")
        if mutated.name in self.viewed:
            raise Unsupported(f"{label} changes in place a value that has views")
        if not isinstance(result, Sym):
            raise Unsupported(f"{label} changes a value in place and returns no tensor")
        for k, v in self.env.items():
            if v is mutated:
                self.env[k] = result

    def _sole_alias(self, view: Sym) -> bool:
        """Whether no value of the traced graph that is still to be read but `view` reaches its
        memory: a GEMM's output reshaped (Falcon's `mlp_output += attention_output`), a value
        changed in place before, what torchvision's StochasticDepth hands back in eval (its input,
        read by nothing else). Changing it in place then changes no value read later, and it
        can be replaced by the result. (The node being lowered is not in env yet: its operands
        count as still to be read.)"""
        owner = self.owner(view.name)
        live = [v for node, v in self.env.items() if any(user not in self.env for user in node.users)]
        values = [v for v in pytree.tree_leaves(live) if isinstance(v, Sym)]
        return all(v.name == view.name or self.owner(v.name) != owner for v in values)

    def _finish(self, out_node: torch.fx.Node, n_args: int) -> Lowered:
        for name, call in self.deferred.items():
            self.real[name] = call()
        result = self._load(out_node.args[0])
        if self.fast:
            result = self._in_eager_layouts(result)
        leaves, spec = pytree.tree_flatten(_mutable(result), _is_size)
        out_leaves = [v.name if isinstance(v, Sym) else ("const", v) for v in leaves]
        outputs = tuple(dict.fromkeys(v for v in out_leaves if isinstance(v, str)))
        graph = Graph(tuple(self.inputs), tuple(self.nodes), outputs)
        reads = frozenset(self.layout_read)
        return Lowered(
            graph,
            spec,
            out_leaves,
            n_args,
            tuple(self.reads_training),
            reads,
            tuple(self.called),
            tuple(self.grad_read.items()),
            tuple({id(o): o for o in self.watched}.values()),
        )

    def _in_eager_layouts(self, result: Any) -> Any:
        """Fast mode keeps activations channels-last between convolutions where eager's are NCHW:
        an output whose layout is not eager's is copied into eager's (fused with the elementwise
        ops before it), so that what the caller does with it (`.view(n, -1)`) works as in eager.
        Eager's layouts come from running the graph once, only when an output is not contiguous.
        (Views too: a 1 x 1 convolution's result is a channels-last view of its GEMM's product.
        A view of the caller's tensor has eager's layout, and stays a view.)"""
        kept = (Op.INPUT, Op.PARAM)  # the caller's tensors
        own = {
            v.name
            for v in leaves(result)
            if isinstance(v, Sym) and v.is_tensor and self.ops[v.name] not in kept and v.meta.stride() != _dense(v.meta)
        }
        if not own:
            return result
        with _model_state_kept(self.captured.root):
            eager = torch.fx.GraphModule(self.captured.root, self.captured.graph)(*self.example_args)
        copies: dict[str, Sym] = {}
        for v, e in zip(leaves(result), leaves(eager)):
            if isinstance(v, Sym) and v.name in own and _strided(e) and e.stride() != v.meta.stride():
                copies[v.name] = self.emit(Op.COPY, (v.name,), to_meta(e))
                self.real[copies[v.name].name] = e
        return map_tree(lambda v: copies.get(v.name, v) if isinstance(v, Sym) else v, result)


@contextlib.contextmanager
def _model_state_kept(fn: Any) -> Iterator[None]:
    """A module run on example tensors must leave the model as it was: a BatchNorm in training
    updates its running statistics (the first call then updated them twice). Its buffers are put
    back; a parameter changed in place cannot be, and the model is not compiled."""
    if not isinstance(fn, torch.nn.Module):
        yield
        return
    buffers = [(b, b.clone()) for b in fn.buffers()]
    params = [(p, p._version) for p in fn.parameters()]
    yield
    with torch.no_grad():
        for b, saved in buffers:  # compared by value: ATen's kernel updates running statistics
            if not torch.equal(b, saved):  # without counting a version
                b.copy_(saved)
    if any(p._version != v for p, v in params):
        raise Unsupported(f"{type(fn).__name__} changes its parameters in forward")


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


def _dense(t: torch.Tensor) -> tuple[int, ...]:
    """The strides of a contiguous tensor of t's sizes (t.is_contiguous() holds for any strides
    when t has no elements)."""
    return torch.empty(t.shape, device="meta").stride()


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


def map_tree(fn: Callable[[Any], Any], tree: Any) -> Any:
    """pytree.tree_map, also inside slices (`x[: n]` with a traced n)."""
    within = lambda v: slice(fn(v.start), fn(v.stop), fn(v.step)) if isinstance(v, slice) else fn(v)  # noqa: E731
    return pytree.tree_map(within, tree, is_leaf=_is_size)


# Calls that only make their result: no input changed (call() records `mutates` where one is), no
# random numbers drawn, the same values from the same arguments (`empty` is not among them: its
# contents vary). dce drops an unused factory of constants; passes.memoize keeps the results of
# these calls of sizes, constants and such results per sizes, so they are ATen calls there (views
# aside) even where braze has a native kernel.
FACTORIES = frozenset({torch.tensor, torch.zeros, torch.ones, torch.full, torch.arange, torch.linspace})
_OPERATORS = "add sub mul truediv floordiv mod neg invert and_ or_ xor eq ne lt le gt ge getitem iadd isub imul"
_FUNCTIONS = "diff cumsum where tril triu eq ne lt le gt ge logical_and logical_or logical_not abs log"
_FUNCTIONS += " min max maximum minimum full_like zeros_like ones_like"
_METHODS = "cumsum new_ones new_zeros new_full to float long int bool masked_fill tril triu eq ne lt le gt ge"
_METHODS += " logical_and logical_or logical_not abs log expand unsqueeze view reshape"
DETERMINISTIC = (
    FACTORIES
    | {getattr(operator, f) for f in _OPERATORS.split()}
    | {getattr(torch, f) for f in _FUNCTIONS.split()}
    | {getattr(torch.Tensor, f) for f in _METHODS.split()}
)
_VIEWS = frozenset({operator.getitem, *(getattr(torch.Tensor, f) for f in "expand unsqueeze view reshape".split())})


_INTEGER_OPS = frozenset({Op.ADD, Op.SUB, Op.MUL}) | COMPARE
_CAST = INTEGERS | {torch.bool}  # cast to float32 where float32 arithmetic reads them


def _integer_dtype(op: Op, operands: tuple[Any, ...]) -> torch.dtype | None:
    """The integer dtype `op` computes in natively: its tensors' own, all int32 or all int64, beside
    Python ints (a Python float makes it float32 arithmetic)."""
    dtypes = {a.meta.dtype for a in operands if isinstance(a, Sym) and a.is_tensor}
    ints = all(type(a) is int for a in operands if not isinstance(a, Sym))
    if op in _INTEGER_OPS and ints and len(dtypes) == 1 and dtypes <= INTEGERS:
        return dtypes.pop()
    return None


def _among(fn: object, calls: frozenset) -> bool:
    try:
        return fn in calls
    except TypeError:  # an unhashable callable
        return False


def _syms(args: tuple, kwargs: dict) -> list[Sym]:
    """The IR values among a call's arguments, in order (repeats kept)."""
    return [v for v in leaves((args, kwargs)) if isinstance(v, Sym)]


def _key(fn: Any) -> Any:
    """A function's registry key: itself, or its name where that has the row
    ("torchvision.ops.stochastic_depth.stochastic_depth")."""
    if _among(fn, LOWERINGS):
        return fn
    name = f"{getattr(fn, '__module__', None)}.{getattr(fn, '__qualname__', None)}"
    return name if name in LOWERINGS else fn


def plain_layer(layer: Any, cls: type) -> bool:
    """Whether `layer` is a `cls` whose call is its class's own (that function of its settings
    and parameters, none parametrized): lowerings may make the call it makes themselves. (A
    layer with hooks never gets to a lowering: Lowerer._native_or_extern calls it as itself.)"""
    return (
        isinstance(layer, cls)
        and type(layer).forward is cls.forward
        and not torch.nn.utils.parametrize.is_parametrized(layer)
    )


def leaves(tree: Any) -> list[Any]:
    """pytree.tree_leaves, with a slice's start, stop and step as leaves."""
    out: list[Any] = []
    for v in pytree.tree_leaves(tree, is_leaf=_is_size):
        out.extend((v.start, v.stop, v.step) if isinstance(v, slice) else (v,))
    return out


def _metas(tree: Any) -> Any:
    return map_tree(lambda v: v.meta if isinstance(v, Sym) else v, tree)


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


def _assign(t: torch.Tensor, index: Any, value: Any) -> torch.Tensor:
    """`t[index] = value` (operator.setitem), then `t`: its result as a value of the graph."""
    t[index] = value
    return t


def _fn_name(fn: Any) -> str:
    mod = getattr(fn, "__module__", "") or ""
    return f"{mod.replace('torch.nn.functional', 'F')}.{getattr(fn, '__name__', fn)}".lstrip(".")


def no_out(kwargs: dict) -> None:
    if kwargs.get("out") is not None:
        raise NotNative("out= argument")
