"""Stage 1, capture: turn a model or function into a torch.fx graph.

The fast path is symbolic tracing (milliseconds). Code that FX cannot trace (Python control flow
on tensor values, say) raises here; the caller then hands the model to TorchDynamo with braze as
its backend, and if that fails too it runs eagerly with one warning.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import operator
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx


class CaptureError(RuntimeError):
    pass


@dataclass
class Captured:
    graph: torch.fx.Graph
    root: torch.nn.Module  # what get_attr and call_module targets resolve against
    traced: tuple[torch.nn.Module, ...] = ()  # modules whose forward the graph inlines
    mode: str = "exact"  # the wrapper's: "fast" lets lowering pick faster kernels (fast.py)


# Modules whose forward is only a loop over their children: never a branch on `training`.
_CONTAINERS = (torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict)


class _Tracer(torch.fx.Tracer):
    """Keeps torch.nn's own modules as single nodes (the default), so lowering sees nn.Linear
    whole; notes the modules whose forward it inlines (the graph holds their `training` as it
    was)."""

    def __init__(self) -> None:
        super().__init__()
        self.inlined: list[torch.nn.Module] = []

    def proxy(self, node: torch.fx.Node) -> torch.fx.Proxy:
        return _Proxy(node, self)

    def call_module(self, m: torch.nn.Module, forward: Any, args: Any, kwargs: Any) -> Any:
        if not self.is_leaf_module(m, self.path_of_module(m)):
            self.inlined.append(m)
        return super().call_module(m, forward, args, kwargs)


class _Proxy(torch.fx.Proxy):
    """FX's proxy, recording augmented assignments as what they are: FX's own has no `__iadd__`,
    so Python ran `v += 1` as `v = v + 1`, and another name for v's tensor (the tensor v views,
    a second variable) kept the old values where eager changes them. Recorded as operator.iadd,
    lowering sees the change in place (and runs eagerly what it cannot functionalise)."""


def _in_place(op: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    def method(self: torch.fx.Proxy, other: Any) -> Any:
        return self.tracer.create_proxy("call_function", op, (self, other), {})

    return method


_AUGMENTED = "iadd isub imul itruediv ifloordiv imod ipow imatmul iand ior ixor ilshift irshift".split()
for _op in _AUGMENTED:
    setattr(_Proxy, f"__{_op}__", _in_place(getattr(operator, _op)))


# Factories that FX would run once while tracing and bake in as constants, when eager draws
# new numbers every call. Seeing one, capture fails and TorchDynamo (which records them) runs.
_RANDOM = {
    torch.rand,
    torch.randn,
    torch.randint,
    torch.randperm,
    torch.normal,
    torch.bernoulli,
    torch.multinomial,
    torch.poisson,
    torch.rand_like,
    torch.randn_like,
    torch.randint_like,
}


class _NoUntracedRandom(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if func in _RANDOM and not any(isinstance(a, torch.fx.Proxy) for a in (*args, *kwargs.values())):
            raise CaptureError(f"{func.__name__} outside the traced values would become a constant")
        return func(*args, **kwargs)


# Functions that set the random generator's state. Called in forward, they would run once, while
# tracing, where eager runs them every call (seeded dropout, OpInfo's wrapper_set_seed): seeing
# one, capture fails and TorchDynamo runs. They are replaced only while some thread traces (and
# only that thread's calls fail), so TorchDynamo and everyone else see torch's own functions.
_RNG_SETTERS = (
    (torch, "manual_seed"),
    (torch, "seed"),
    (torch, "set_rng_state"),
    (torch.random, "manual_seed"),
    (torch.random, "seed"),
    (torch.random, "set_rng_state"),
)
_tracing = threading.local()
_guard_lock = threading.Lock()
_guard_users = [0]


def _rng_guarded(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def setter(*args: Any, **kwargs: Any) -> Any:
        if getattr(_tracing, "active", False):
            raise CaptureError(f"{original.__name__} in forward would run only while tracing")
        return original(*args, **kwargs)

    return setter


_ORIGINALS = [(m, name, getattr(m, name)) for m, name in _RNG_SETTERS]
_GUARDED = [(m, name, _rng_guarded(fn)) for m, name, fn in _ORIGINALS]


@contextlib.contextmanager
def _no_rng_setters() -> Iterator[None]:
    with _guard_lock:
        _guard_users[0] += 1
        if _guard_users[0] == 1:
            for m, name, fn in _GUARDED:
                setattr(m, name, fn)
    _tracing.active = True
    try:
        yield
    finally:
        _tracing.active = False
        with _guard_lock:
            _guard_users[0] -= 1
            if _guard_users[0] == 0:
                for m, name, fn in _ORIGINALS:
                    setattr(m, name, fn)


def trace(fn: Callable[..., Any], n_args: int) -> Captured:
    """Symbolically trace `fn` (an nn.Module or a function of tensors) into an FX graph."""
    tracer = _Tracer()
    state = _ModuleState(fn)
    try:
        with _NoUntracedRandom(), _no_rng_setters():
            graph = tracer.trace(_traceable(fn, n_args))
    except Exception as e:  # FX raises many kinds: TraceError, TypeError, NotImplementedError...
        state.restore()
        raise CaptureError(f"torch.fx could not trace {_name(fn)}: {type(e).__name__}: {e}") from e
    changed = state.restore()
    if changed:
        raise CaptureError(
            f"torch.fx could not trace {_name(fn)}: its forward changes {changed}, which eager does every call"
        )
    # For a function, the tracer's own root holds the tensors it closes over (_tensor_constant0).
    inlined = ([fn] if isinstance(fn, torch.nn.Module) else []) + tracer.inlined
    traced = tuple({id(m): m for m in inlined if type(m) not in _CONTAINERS}.values())
    return Captured(graph, tracer.root, traced)


class _ModuleState:
    """The Python state of a model's modules (their attributes, and the contents of those that
    are dicts, lists or sets), to put back after tracing. A forward that changes it (a cache
    filled on the first call, a counter) ran once, on proxies: the model kept proxies (timm's
    LeViT its attention-bias cache, which then broke `copy.deepcopy` of the model), and the
    graph would not change the state as eager does on every call."""

    def __init__(self, fn: Any) -> None:
        modules = fn.named_modules() if isinstance(fn, torch.nn.Module) else ()
        states = [(name, m, _state(m)) for name, m in modules]
        self.saved = [(name, m, state, {k: _copy(v) for k, v in state.items()}) for name, m, state in states]

    def restore(self) -> str:
        """Put the state back; what had changed ('' if nothing)."""
        changed = []
        for name, m, attrs, contents in self.saved:
            now = vars(m)
            keys = [k for k in _state(m) if k not in attrs or not _same(now[k], attrs[k])]
            for k in keys:
                if k in attrs:
                    now[k] = attrs[k]
                else:
                    del now[k]
            for k, saved in contents.items():
                if saved is not None and _ids(attrs[k]) != _ids(saved):
                    keys.append(k)
                    attrs[k].clear()
                    if isinstance(saved, list):
                        attrs[k].extend(saved)
                    else:
                        attrs[k].update(saved)
            changed += [f"{name}.{k}" if name else k for k in keys]
        return ", ".join(dict.fromkeys(changed))


_SCALARS = (bool, int, float, str, type(None))
# What a forward may register on its module (Hugging Face's rotary embeddings register their
# buffer again in forward): the graph reads the module's registries when it runs, not the trace.
_REGISTRIES = ("_parameters", "_buffers", "_modules")


def _state(m: torch.nn.Module) -> dict[str, Any]:
    return {k: v for k, v in vars(m).items() if k not in _REGISTRIES}


def _same(a: Any, b: Any) -> bool:
    return a is b or (type(a) is type(b) and isinstance(a, _SCALARS) and a == b)


def _copy(v: Any) -> Any:
    """A shallow copy of a dict, list or set; None for anything else."""
    return type(v)(v) if type(v) in (dict, list, set, collections.OrderedDict) else None


def _ids(v: Any) -> list:
    """A container's contents by identity (values never compared: they may be tensors)."""
    return [(k, id(x)) for k, x in v.items()] if isinstance(v, dict) else [id(x) for x in v]


def _traceable(fn: Callable[..., Any], n_args: int) -> Callable[..., Any]:
    """FX traces Python functions and modules; give builtins such as torch.relu, and functions
    of `*args` (which FX would hand one proxy for all of them), a Python body that takes as many
    arguments as the first call passed."""
    if isinstance(fn, torch.nn.Module):
        return fn
    if (inspect.isfunction(fn) or inspect.ismethod(fn)) and not _var_positional(fn):
        return fn
    names = [f"a{i}" for i in range(n_args)]
    ns: dict[str, Any] = {"fn": fn}
    exec(f"def call({', '.join(names)}):\n    return fn({', '.join(names)})", ns)
    return ns["call"]


def _var_positional(fn: Callable[..., Any]) -> bool:
    return any(p.kind is p.VAR_POSITIONAL for p in inspect.signature(fn).parameters.values())


def from_graph_module(gm: torch.fx.GraphModule) -> Captured:
    """A graph that TorchDynamo (or the user) already captured."""
    return Captured(gm.graph, gm)


def _name(fn: Callable[..., Any]) -> str:
    return type(fn).__name__ if isinstance(fn, torch.nn.Module) else getattr(fn, "__name__", repr(fn))
