"""`torch.compile(model, backend="braze")`: TorchDynamo captures, braze compiles each graph.

Registered through the `torch_dynamo_backends` entry point (pyproject.toml), so importing
braze never imports TorchDynamo.

TorchDynamo rewrites a few calls while it traces, into other arithmetic than eager's: it hands
the backend `torch.addcdiv(a, b, c, value=v)` as `a + (b / c) * v` where ATen computes
`a + v * b / c`, and `Tensor.add_`/`addcmul_`/`addcdiv_` with a tensor scalar as an FMA of
other operands. (Its own eager backend then differs from eager too.) braze promises eager's
bits, so those rewrites decline when the frame being traced is for a braze backend: the graph
then holds the calls as the user wrote them. Traces for other backends are unchanged.

Code also asks whether it is being compiled (`torch.compiler.is_compiling()`), and TorchDynamo
answers yes while it traces: nn.TransformerEncoder then skips its nested-tensor path (with a
padding mask its outputs differed from eager's by up to 3.4), nn.MultiheadAttention its fused
kernel. In a trace for braze, torch.nn's modules get eager's answer, no: the graph holds what
eager runs (a graph break where that cannot be traced, which runs it eagerly). Other code keeps
TorchDynamo's answer: Hugging Face's, told no, takes paths TorchDynamo cannot trace at all.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch

from . import config, debug, guardmemo
from .api import BrazeWarning, CompiledFunction
from .capture import from_graph_module

# TorchDynamo's handlers that trace a call as other arithmetic: TensorVariable's methods for
# tensor methods, and the special handlers of torch functions.
_TENSOR_METHODS = ("method_add_", "method_addcmul_", "method_addcdiv_")
_TORCH_FUNCTIONS = ("addcdiv", "_foreach_pow", "_foreach_lerp_")
# Functions TorchDynamo folds to True while it traces, where eager's answer is False; and the
# code that gets eager's answer in a trace for braze (see the module's docstring).
_EAGER_ANSWER = tuple(
    os.path.join(os.path.dirname(torch.__file__), "nn", "modules", f) for f in ("transformer.py", "activation.py")
)
_COMPILING = (
    "torch.compiler.is_compiling",
    "torch.compiler.is_dynamo_compiling",
    "torch._utils.is_compiling",
    "torch._dynamo.external_utils.is_compiling",
    "torch.nn.modules.activation._is_make_fx_tracing",
)


# Where TorchDynamo's and torch.compile's wrappers of a backend keep it.
_WRAPPED = ("compiler_fn", "_torchdynamo_orig_backend", "func")


def _for_braze(tx: Any) -> bool:
    """Whether the frame `tx` traces is compiled by a braze backend."""
    return _is_braze(getattr(getattr(tx, "output", None), "compiler_fn", None))


def _is_braze(fn: Any) -> bool:
    """Whether `fn` is a braze backend (through TorchDynamo's and torch.compile's wrappers)."""
    for _ in range(8):
        if fn is None:
            return False
        if getattr(fn, "braze_exact", False):
            return True
        fn = next((getattr(fn, a) for a in _WRAPPED if hasattr(fn, a)), None)
    return False


def _declining(original: Callable[..., Any]) -> Callable[..., Any]:
    """`original`, except that it handles nothing (returns None) in a trace for braze."""

    @functools.wraps(original)
    def handler(self: Any, tx: Any, *args: Any, **kwargs: Any) -> Any:
        if _for_braze(tx):
            return None
        return original(self, tx, *args, **kwargs)

    return handler


def _not_compiling(original: Callable[..., Any]) -> Callable[..., Any]:
    """`original`, except that in torch.nn's modules traced for braze the call is eager's False."""
    from torch._dynamo.variables import ConstantVariable

    @functools.wraps(original)
    def handler(self: Any, tx: Any, *args: Any, **kwargs: Any) -> Any:
        if _for_braze(tx) and not args and not kwargs and tx.f_code.co_filename in _EAGER_ANSWER:
            return ConstantVariable.create(False)
        return original(self, tx, *args, **kwargs)

    return handler


def _resolve(path: str) -> Any:
    module, _, name = path.rpartition(".")
    try:
        return getattr(sys.modules.get(module) or __import__(module, fromlist=[name]), name)
    except (ImportError, AttributeError):
        return None


_LIBRARIES = (os.path.dirname(torch.__file__), os.path.dirname(__file__))


class _RecompileLimit(logging.Handler):
    """TorchDynamo says only in a log line that it stopped compiling a function (it runs the
    function's new signatures eagerly from then on): for a function compiled by braze, say it
    as braze's warning."""

    def emit(self, record: logging.LogRecord) -> None:
        if not str(record.msg).startswith("torch._dynamo hit config.") or len(record.args or ()) < 4:
            return
        frame = sys._getframe(1)
        while frame is not None and not (frame.f_code.co_name == "_compile" and "compiler_fn" in frame.f_locals):
            frame = frame.f_back
        if frame is None or not _is_braze(frame.f_locals["compiler_fn"]):
            return
        limit, value, function, reason = record.args[:4]
        message = (
            f"braze: TorchDynamo stopped compiling {function} after {value} compilations ({limit}); "
            f"its new signatures now run eagerly. Last recompilation because: {reason}"
        )
        while frame is not None and frame.f_code.co_filename.startswith(_LIBRARIES):
            frame = frame.f_back  # up to the user's call
        where = (frame.f_code.co_filename, frame.f_lineno) if frame is not None else ("braze", 0)
        warnings.warn_explicit(message, BrazeWarning, *where)


@functools.cache
def prepare_dynamo() -> None:
    """Make TorchDynamo's rewriting handlers decline in traces for braze, and its recompile
    limit loud (once per process). On a TorchDynamo without the handlers there is nothing to do."""
    logging.getLogger("torch._dynamo.convert_frame").addHandler(_RecompileLimit())
    from torch._dynamo.variables.tensor import TensorVariable
    from torch._dynamo.variables.torch import TorchInGraphFunctionVariable

    # torch 2.14 dispatches tensor methods through a table built with the class (tp_methods),
    # 2.13 by looking the method up: decline in both.
    table = getattr(TensorVariable, "tp_methods", {})
    for name in _TENSOR_METHODS:
        if name in vars(TensorVariable):
            setattr(TensorVariable, name, _declining(getattr(TensorVariable, name)))
        method = table.get(name.removeprefix("method_"))
        if method is not None and hasattr(method, "handler"):
            method.handler = _declining(method.handler)
    handlers = TorchInGraphFunctionVariable._get_handlers()
    for name in _TORCH_FUNCTIONS:
        fn = getattr(torch, name, None)
        if fn in handlers:
            handlers[fn] = _declining(handlers[fn])
    for path in _COMPILING:
        fn = _resolve(path)
        if fn in handlers:
            handlers[fn] = _not_compiling(handlers[fn])


def exact(backend: Callable[..., Any]) -> Callable[..., Any]:
    """Mark `backend` as braze's, so TorchDynamo traces eager's arithmetic for it."""
    prepare_dynamo()
    backend.braze_exact = True  # type: ignore[attr-defined]
    return backend


@exact
def braze_backend(
    gm: torch.fx.GraphModule, example_inputs: list[Any], options: dict[str, Any] | None = None
) -> Callable[..., Any]:
    """A TorchDynamo backend: returns a braze wrapper of `gm` (compiled on its first call).
    `options` (torch.compile's): {"mode": "fast"} for fast mode (see braze.compile)."""
    options = dict(options or {})
    mode = options.pop("mode", "exact")
    if options:
        raise ValueError(f"braze: unknown options {sorted(options)} (only 'mode')")
    wrapper = CompiledFunction(gm, mode=mode)
    wrapper._runs_hooks = False
    wrapper.use_capture(from_graph_module(gm))
    wrapper.symbolic = symbolic_places(gm)
    return wrapper


def symbolic_places(gm: torch.fx.GraphModule) -> list[tuple[tuple[int, int], ...]]:
    """Where each of a TorchDynamo graph's symbolic sizes comes in: the int placeholders it
    passes them as, (position, -1), and the tensor dimensions of that size, (position, dim).
    A program compiled for the graph is then generic in them (see lowering/generic.py)."""
    places: dict[str, list[tuple[int, int]]] = {}
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, node in enumerate(inputs):
        value = node.meta.get("example_value")
        sizes = [(-1, value)] if isinstance(value, torch.SymInt) else []
        if isinstance(value, torch.Tensor):
            sizes = list(enumerate(value.shape))
        for d, size in sizes:
            expr = size.node.expr if isinstance(size, torch.SymInt) else None
            if expr is not None and expr.is_Symbol:
                places.setdefault(str(expr), []).append((i, d))
    return [tuple(p) for p in places.values()]


def graph_key(gm: torch.fx.GraphModule) -> tuple | None:
    """What a braze program of `gm` depends on, for a model's TorchDynamo graphs: each node's op,
    target (functions and get_attr's objects by identity, held in the key), arguments (other
    nodes by position, floats by their bits: -0.0 is not 0.0), and each placeholder's example
    value (sizes and strides, symbols by name, dtype, requires_grad). TorchDynamo traces a frame
    again where its guards failed, or where threads missed while it traced (four threads
    serving `transformer-layer` at three batch sizes: 6 graphs, 2 distinct); equal keys share
    one wrapper and its programs. None where a value has no such form (no sharing)."""
    index = {node: i for i, node in enumerate(gm.graph.nodes)}

    def frozen(v: Any) -> Any:
        if isinstance(v, torch.fx.Node):
            return ("node", index[v])
        if isinstance(v, float):
            return ("float", v.hex())
        if isinstance(v, (tuple, list)):
            return (type(v).__name__, *map(frozen, v))
        if isinstance(v, dict):
            return ("dict", *((k, frozen(x)) for k, x in v.items()))
        if isinstance(v, slice):
            return ("slice", frozen(v.start), frozen(v.stop), frozen(v.step))
        if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return ("sym", str(v))
        if isinstance(v, torch.Tensor):  # (a FakeTensor example: its layout, symbols by name)
            layout = (*map(str, v.shape), "/", *map(str, v.stride()), v.dtype, v.requires_grad, type(v).__name__)
            return ("tensor", *layout)
        hash(v)  # (TypeError: not frozen)
        return (type(v), v)

    key: list[Any] = []
    try:
        for node in gm.graph.nodes:
            target = node.target
            if node.op == "get_attr":
                target = getattr(gm, target)
            elif node.op == "call_module":
                target = gm.get_submodule(target)
            example = node.meta.get("example_value") if node.op == "placeholder" else None
            # an object by its id, held behind it (a tuple compares the ids first, never a tensor's
            # values); a name (a method's, a placeholder's) by its value
            ident = (target,) if isinstance(target, str) else (id(target), target)
            key.append((node.op, *ident, frozen(node.args), frozen(node.kwargs), frozen(example)))
        return tuple(key)
    except (TypeError, AttributeError):
        return None


def dynamo_fallback(wrapper: CompiledFunction, why: str) -> Callable[..., Any] | None:
    """Hand the model to TorchDynamo with braze as backend; None (eager) if that is impossible."""
    try:
        graphs: dict[tuple, CompiledFunction] = {}  # by graph_key: one wrapper per distinct graph

        @exact
        def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
            key = graph_key(gm)
            if key is not None and key in graphs:
                return graphs[key]
            sub = braze_backend(gm, example_inputs, options={"mode": wrapper.mode})
            sub.dynamic = wrapper.dynamic
            wrapper._subgraphs.append(sub)
            if key is not None:
                graphs[key] = sub
            return sub

        from torch._dynamo import config as dynamo_config

        own = _own_frame(wrapper.fn)
        recorder = guardmemo.Recorder()  # (keeps every guard: TorchDynamo's own checks unchanged)
        options = {"guard_filter_fn": recorder}
        compiled = torch.compile(own, backend=backend, dynamic=wrapper.dynamic, options=options)
        guarded = _guarded_code(own, recorder)
    except Exception as e:  # dynamo unavailable on this platform/Python
        wrapper._say(f"{why}; TorchDynamo is unavailable too ({e})")
        return None
    if config.debug:
        debug.log(f"braze: {why}; capturing with TorchDynamo instead")

    def call(*args: Any, **kwargs: Any) -> Any:
        if wrapper.dynamic is None and not wrapper._subgraphs:  # until TorchDynamo's first trace
            _maybe_dynamic(args, kwargs)
        try:
            code = guarded(args, kwargs)
            if code is not None:
                return code(*args, **kwargs)
            # A hook added to a layer after compiling is eager's to run: TorchDynamo then guards
            # the layers' hook tables (by default it does not, and such a hook was left out)
            try:
                with dynamo_config.patch(skip_nnmodule_hook_guards=False):
                    out = compiled(*args, **kwargs)
            finally:
                guarded.memo.drop_older()  # (TorchDynamo may have compiled an entry before the witness's)
        except Exception:
            # Eager decides: bad inputs raise eager's error (and TorchDynamo stays); TorchDynamo
            # failing where eager works must not break the user (it runs eagerly from then on).
            out = wrapper.fn(*args, **kwargs)
            wrapper._say(f"{why}; TorchDynamo capture failed too")
            wrapper._dynamo = wrapper.fn
            return out
        # The witness of what TorchDynamo ran (compiled, most often), made now rather than at
        # the next call, which then skips the guards too (bert-tiny's second call took ~10 ms
        # making it). (Nothing here may fail the call: the next one tries again.)
        with contextlib.suppress(Exception):
            guarded(args, kwargs)
        return out

    call.memo = guarded.memo  # type: ignore[attr-defined]  # (for tests)
    return call


def _guarded_code(
    own: Callable[..., Any], recorder: guardmemo.Recorder
) -> Callable[[tuple, dict], Callable[..., Any] | None]:
    """code_for(args, kwargs): the code TorchDynamo compiled for that call of `own`, as a
    function: its first cache entry whose guards pass (TorchDynamo's own C++ guards, given the
    frame's locals), as its frame evaluation would pick it; None where none passes (TorchDynamo
    then compiles anew), where the code continues in frames TorchDynamo compiles (a graph
    break's resume functions), while TorchDynamo traces, or where the user set it aside (a
    stance other than the default, `torch._dynamo.config.disable`). Calling it directly skips
    TorchDynamo's per-call frame handling around the guards (`bert-tiny`: about 0.1 ms of 1.6).
    What does not change between calls (TorchDynamo's modules, own's closure) is read here once.

    A call whose witness holds takes the witness's code without reading TorchDynamo's entries:
    the witness is made for the newest entry only, and dropped where one is newer after a call
    TorchDynamo handled (only `call` has it compile `own`). After torch._dynamo.reset() that code
    stays in use while the witness holds (it is still the code for that state); a change
    compiles anew."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch._dynamo import eval_frame

    free = dict(zip(own.__code__.co_freevars, (c.cell_contents for c in own.__closure__)))
    # Per compiled code object (by id, kept alive beside it): its function, or None where it
    # continues in resume functions. Made once: scanning its names took ~3 us a call.
    functions: dict[int, tuple[types.CodeType, Callable[..., Any] | None]] = {}

    def function(code: types.CodeType) -> Callable[..., Any] | None:
        known = functions.get(id(code))
        if known is None or known[0] is not code:
            resumes = any(name.startswith("__resume_at") for name in code.co_names)
            fn = None if resumes else types.FunctionType(code, own.__globals__, own.__name__, None, own.__closure__)
            known = functions[id(code)] = (code, fn)
        return known[1]

    memo = _GuardMemo(own, recorder, free)
    disabled = _dynamo_disabled()

    def code_for(args: tuple, kwargs: dict) -> Callable[..., Any] | None:
        if torch.compiler.is_compiling() or eval_frame._stance.stance != "default" or disabled():
            return None
        witness, code = (memo.current if config.guard_memo else None) or (None, None)  # (one read: threads)
        try:  # (a witness that cannot be checked holds nothing)
            state = witness is not None and witness.state_holds()
            holds = state and witness.arguments_hold(args, kwargs)
        except Exception:
            state = holds = False
        if holds:  # (the witness's entry is the newest: memo.drop_older drops it once one is newer)
            if config.debug:  # (the witness's claim, checked)
                assert memo.newest(witness), "the guard memo's entry is not the newest"
                assert witness.entry.check({"args": args, "kwargs": kwargs, **free}), "stale guard memo"
            memo.hits += 1
            return code
        entries = _debug_get_cache_entry_list(own.__code__)
        frame = {"args": args, "kwargs": kwargs, **free}
        for i, entry in enumerate(entries):
            try:
                passed = entry.guard_manager.check(frame)
            except Exception:  # a guard that cannot be evaluated (an attribute gone): TorchDynamo decides
                return None
            if passed:
                fn = function(entry.code)
                if i == 0 and fn is not None and config.guard_memo:
                    same = state and witness.entry is entry.guard_manager  # (only the arguments changed)
                    memo.passed(entry, fn, args, kwargs, witness if same else None)
                return fn
        return None

    code_for.memo = memo  # type: ignore[attr-defined]
    return code_for


def _dynamo_disabled() -> Callable[[], bool]:
    """What `torch._dynamo.config.disable` reads, without ConfigModule.__getattr__ (~39 us a call
    once the model's work had left its path out of the caches: BERT): the setting's own
    ContextVar (set by assignment and by config.patch), else its value from the environment or
    default. Where the setting is made otherwise (an alias, a forced value, a JustKnob), the
    attribute itself."""
    from torch._dynamo import config as dynamo_config
    from torch.utils import _config_module

    def attribute() -> bool:
        return dynamo_config.disable

    unset = getattr(_config_module, "_UNSET_SENTINEL", None)
    entry = getattr(dynamo_config, "_config", {}).get("disable")
    plain = ("alias", "justknob", "env_value_force", "env_value_default", "default", "user_override")
    if unset is None or entry is None or not all(hasattr(entry, a) for a in plain):
        return attribute
    if entry.alias is not None or entry.justknob is not None or entry.env_value_force is not unset:
        return attribute
    base = entry.default if entry.env_value_default is unset else entry.env_value_default
    override = entry.user_override

    def disabled() -> bool:
        value = override.get()
        return base if value is unset else value

    return disabled


class _GuardMemo:
    """The witness (guardmemo.py) of the newest compiled code's guards, made when they pass:
    the next calls that find it holding skip TorchDynamo's check. Made again where the state
    changed (at most MAX_RECORDS times a cache entry: then its guards run every call), and only
    its arguments' part where only they did."""

    MAX_RECORDS = 4

    def __init__(self, own: Callable[..., Any], recorder: guardmemo.Recorder, free: dict) -> None:
        self.own, self.recorder, self.free = own, recorder, free
        self.current: tuple[guardmemo.Witness, Callable[..., Any]] | None = None  # and its entry's code
        self.records: dict[int, int] = {}  # by id(guard manager): witnesses made
        self.why: str = ""  # why the last entry has none
        self.hits = 0  # calls that skipped the guards

    @property
    def witness(self) -> guardmemo.Witness | None:
        current = self.current
        return None if current is None else current[0]

    def forget(self) -> None:
        self.current = None

    def newest(self, witness: guardmemo.Witness) -> bool:
        """Whether the witness's entry is TorchDynamo's newest (or there is none: after
        torch._dynamo.reset() its code is still the code for its state)."""
        from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

        entries = _debug_get_cache_entry_list(self.own.__code__)
        return not entries or witness.entry is entries[0].guard_manager

    def drop_older(self) -> None:
        """Keep the witness only while its entry is the newest."""
        witness = self.witness
        if witness is not None and not self.newest(witness):
            self.forget()

    def passed(
        self, entry: Any, code: Callable[..., Any], args: tuple, kwargs: dict, witness: guardmemo.Witness | None
    ) -> None:
        try:
            if witness is None:
                made = self.records.get(id(entry.guard_manager), 0)
                guards = self.recorder.guards.get(entry.compile_id)
                if made >= self.MAX_RECORDS or guards is None:
                    self.forget()
                    return
                self.records[id(entry.guard_manager)] = made + 1
                witness = guardmemo.record(entry.guard_manager, guards, self.free["fn"], self.own.__globals__)
            witness.arguments = guardmemo.Arguments.of(args, kwargs, witness.tensor_ids)
            self.current = (witness, code)
        except Exception as e:  # (guardmemo.Unsupported, or its own failure: the guards run, as before)
            self.forget()
            self.why = str(e)
            self.records[id(entry.guard_manager)] = self.MAX_RECORDS
            if config.debug and not isinstance(e, guardmemo.Unsupported):
                raise


def _own_frame(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A function calling fn whose code object is its own. TorchDynamo keeps its compiled graphs,
    and counts them against its recompile limit (8), per code object: torch.compile of a module
    enters through one shared frame (external_utils.inner), so the ninth model a process
    compiled that way ran eagerly, as would the ninth instance of a class through its forward."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    name = f"braze_{type(fn).__name__ if isinstance(fn, torch.nn.Module) else getattr(fn, '__name__', 'fn')}"
    call.__code__ = call.__code__.replace(co_name=name, co_qualname=name)
    return call


def _maybe_dynamic(args: tuple, kwargs: dict) -> None:
    """Let TorchDynamo trace the call's tensor arguments with symbolic sizes from its first
    trace on (where nothing fixes them: it specialises the rest), rather than once per size
    before: a model served at many sizes (a prompt of another length) then compiles once.

    Images (floating tensors of 4 or more dimensions) have only their batch symbolic: their
    height and width become symbols once a call changes them. Symbolic from the start, they had
    TorchDynamo trace a two-stage Swin in 30-46 s instead of 1.2 s (the size arithmetic of its
    shifted windows), for a size that serving seldom changes."""
    from torch._dynamo import maybe_mark_dynamic

    for t in (*args, *kwargs.values()):
        if isinstance(t, torch.Tensor):
            image = t.dim() >= 4 and t.is_floating_point()
            for d in range(1 if image else t.dim()):
                maybe_mark_dynamic(t, d)
