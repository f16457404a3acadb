"""The user-facing wrapper: `braze.compile(model)` and the pipeline it drives on a first call.

    capture (FX) -> lower (IR) -> passes -> codegen (LLVM) -> runtime (Program)

A wrapper keeps a bounded cache of Programs keyed by the signature of its arguments (shapes,
strides, dtypes, devices, Python constants, training flag). A call whose signature is new
compiles; a call that needs autograd, or that braze cannot compile, runs eagerly.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import functools
import gc
import inspect
import os
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from . import capture, config, debug, entry, signatures
from .dims import Undecided
from .lowering import Unsupported, lower
from .lowering.core import hook_tables, hooked
from .lowering.generic import Family, NotGeneric, Place, lower_generic, size_at, varying
from .passes import FAST_PIPELINE, PIPELINE, run_passes
from .runtime import ATTRIBUTE_CHANGED, Guard, Program

_EAGER = "eager"  # cache entry for signatures braze runs eagerly
# "exact": eager's bits (torch.equal); "fast": faster kernels where they win, within the accuracy
# contract of accuracy.py (see fast.py)
MODES = ("exact", "fast")
_UNREAD = object()
# A storm: this many compilations within this many calls of a wrapper's slow path (the fast path,
# native, is not counted: every compilation starts on the slow path).
STORM = (8, 100)

# Each wrapper of a module has an epoch, bumped when one of its model's modules gains or replaces
# a parameter, buffer or submodule, so that it sees `model.fc.weight = nn.Parameter(...)` and
# recompiles. Changes to other modules leave it alone: a forward that builds modules as it runs
# (Hugging Face's Llama slices its ModuleList, which makes a new one each call) or a process
# that builds other models meanwhile. A C integer per wrapper: its native guard reads it.
Epoch = ctypes.c_int64 * 1
_watching: weakref.WeakKeyDictionary[torch.nn.Module, weakref.WeakSet[CompiledFunction]] = weakref.WeakKeyDictionary()


_running = threading.local()  # .wrappers: those whose slow path runs on this thread


def _module_replaced(module: torch.nn.Module, *_: Any) -> None:
    """A submodule of `module` is added or replaced: its wrappers recompile, except one whose
    own slow path (tracing forward, or running it eagerly) does it: it compiles what forward does."""
    if torch.compiler.is_compiling():
        return  # see _tensor_replaced
    mine = getattr(_running, "wrappers", ())
    for wrapper in list(_watching.get(module, ())):
        if wrapper not in mine:
            wrapper.epoch[0] += 1


def _tensor_replaced(table: str) -> Callable[[torch.nn.Module, str, Any], None]:
    """A parameter or buffer (`table`: "_parameters" or "_buffers") of `module` is about to be
    replaced: its wrappers' programs read the new tensor from now on; set where it was None:
    they compile again."""

    def hook(module: torch.nn.Module, name: str, value: Any) -> None:
        # TorchDynamo, tracing a forward that registers modules (Llama's), would otherwise trace
        # these hooks and guard on the length of `_watching`, which any new wrapper or module
        # changes: a recompile of every graph each time. Its replay of forward's changes to
        # modules runs them for real.
        if torch.compiler.is_compiling():
            return
        old = getattr(module, table).get(name)
        if old is not None and isinstance(value, torch.Tensor):
            for wrapper in list(_watching.get(module, ())):
                wrapper._rebind(old, value)
        elif name in getattr(module, table):  # set where it was None (`linear.bias = None` was seen by the entry)
            _module_replaced(module)

    return hook


torch.nn.modules.module.register_module_module_registration_hook(_module_replaced)
torch.nn.modules.module.register_module_parameter_registration_hook(_tensor_replaced("_parameters"))
torch.nn.modules.module.register_module_buffer_registration_hook(_tensor_replaced("_buffers"))


# The native entry every program is called through takes ~20 ms to build: do it at import, not
# in the first call. Should it fail, the first compile tries again and reports why.
with contextlib.suppress(Exception):
    entry.ensure_runtime()


class BrazeWarning(UserWarning):
    pass


TESTED_TORCH = "2.13."
if not torch.__version__.startswith(TESTED_TORCH):
    warnings.warn(
        f"braze is tested with torch {TESTED_TORCH}x, not {torch.__version__}: its native code is used only "
        "where start-up checks of torch's internals pass; elsewhere models run eagerly, with a warning saying why",
        BrazeWarning,
        stacklevel=2,
    )


_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def _caller_level() -> int:
    """The stacklevel of the first frame outside braze: the user's call (reached through the
    native entry or not), so a warning names the user's line."""
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == _PACKAGE:
        frame, level = frame.f_back, level + 1
    return level


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    """Compiling allocates thousands of small objects; a full collection of torch's heap in the
    middle would add ~100 ms to a first call that otherwise takes tens. Collect later instead."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class _Failed:
    """A signature that did not compile; eager decides whether the inputs were bad."""

    def __init__(self, why: str) -> None:
        self.why = why


def exact_instead(captured: capture.Captured, build: Callable[[capture.Captured], Program]) -> Program | None:
    """Where fast mode's lowering of `captured` failed: build(exact mode's capture) (None where
    `captured` is exact mode's, or that fails too). Fast mode's channels-last convolution results
    can break what eager's layouts allow (a `.view` of one), which exact mode, keeping eager's,
    does not."""
    if captured.mode != "fast":
        return None
    try:
        return build(dataclasses.replace(captured, mode="exact"))
    except Exception:
        return None


def build_program(
    captured: capture.Captured,
    args: tuple[Any, ...],
    epoch: Any = None,
    places: Sequence[Sequence[Place]] = (),
    seen: Sequence[Sequence[int]] = (),
    names: tuple[str, ...] = (),
) -> Program:
    """Run the pipeline after capture for one argument signature (`epoch`: the wrapper's, which
    the program's guard checks); with `places` (each symbol's argument dimensions, whose values
    so far are `seen`), one program for every size of them (raises NotGeneric or Undecided
    where that cannot be)."""
    epoch = Epoch() if epoch is None else epoch
    t0 = time.perf_counter()
    family = None
    if places:
        lowered, family = lower_generic(captured, args, places, seen)
    else:
        lowered = lower(captured, args)
    t1 = time.perf_counter()
    graph, log = run_passes(lowered.graph, FAST_PIPELINE if captured.mode == "fast" else PIPELINE)
    timings = [("lower", (t1 - t0) * 1e3)] + [(f"pass.{n}", ms) for n, ms in log.timings()]
    # The modules whose `training` the program was built for: those whose forward the capture
    # inlined, and those a lowering decided on (dropout). Other modules' flags change nothing.
    flags = {id(m): m for m in (*captured.traced, *lowered.reads_training)}
    # Every parameter, also those only an ATen call reads (an nn.Module run unchanged): in grad
    # mode, one that requires grad means autograd, which needs eager (as on the slow path).
    params = tuple(captured.root.parameters())
    # The hooks of the layers the program calls or inlines, as many as now (a layer's hook added
    # later is not in it: the entry then misses, and the program compiles again)
    layers = {id(m): m for m in (captured.root, *captured.traced, *lowered.called)}.values()
    hooks = tuple((t, len(t)) for t in (*hook_tables(), *(t for m in layers for t in hook_tables(m))))
    owners = _owners(captured.root)
    watched = (*layers, *lowered.watched)
    guard = Guard(args, tuple(flags.values()), params, epoch, epoch[0], names, owners, hooks, watched)
    prog = Program(lowered, graph, timings, guard, family)
    prog.pass_log = log
    prog.captured_graph = captured.graph
    return prog


def _owners(root: torch.nn.Module) -> dict[int, tuple[tuple[dict, str], ...]]:
    """Where each parameter and buffer of `root` is registered: (its module's `_parameters` or
    `_buffers`, its name there), by the tensor's id."""
    found: dict[int, list[tuple[dict, str]]] = {}
    for m in root.modules():
        for table in (m._parameters, m._buffers):
            for name, t in table.items():
                if t is not None:
                    found.setdefault(id(t), []).append((table, name))
    return {k: tuple(v) for k, v in found.items()}


class CompiledFunction:
    """What `braze.compile` returns for a function (CompiledModule, for a module, adds the
    nn.Module interface): call it like the function.

    Each wrapper is the only instance of a class of its own, whose `__call__` becomes the native
    entry of the program it ran last: a call that matches goes from the interpreter straight
    into machine code. A call that does not is handed back to `_slow`.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> CompiledFunction:
        own = type(cls.__name__, (cls,), {"__module__": cls.__module__, "__qualname__": cls.__qualname__})
        return super().__new__(own)

    def __init__(
        self, fn: Callable[..., Any], mode: str = "exact", cache_size: int | None = None, dynamic: bool | None = None
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"braze: unknown mode {mode!r} (one of {', '.join(MODES)})")
        self.fn = fn
        self.mode = mode
        self.dynamic = dynamic  # see braze.compile
        self._generic: list[Program] = []  # shape-generic programs, newest last
        self._not_generic: set[tuple] = set()  # family keys (see signatures.family_key) that did not fit
        self.symbolic: list[tuple[Place, ...]] = []  # a TorchDynamo graph's symbolic sizes (backend.py)
        self._sig: Any = _UNREAD  # see _signature
        self.cache_size = config.cache_size if cache_size is None else cache_size
        self._cache: collections.OrderedDict[tuple, Any] = collections.OrderedDict()
        self._captured: capture.Captured | None = None
        self._captured_state: tuple = ()  # the state it was traced in (see _trace_state)
        self._dynamo: Callable[..., Any] | None = None
        self.epoch = Epoch()  # see _watching
        self._epoch = 0  # the epoch the cache was filled in
        self._lock = threading.Lock()
        self._said: set[str] = set()
        self._restaled: set[tuple] = set()  # signatures whose program went stale once
        self.compilations: list[signatures.Compilation] = []  # every program compiled, and why
        self._last_key: tuple | None = None  # the signature compiled last
        self._why = ""  # why the next compilation happens, when it is not a new signature
        self._slow_calls = 0  # calls the slow path has taken
        self._compiled_at: collections.deque[int] = collections.deque(maxlen=STORM[0])
        self._module = fn if isinstance(fn, torch.nn.Module) else None
        self._watched: tuple[torch.nn.Module, ...] = ()
        self._params: list[torch.nn.Parameter] = []
        self._find_state()
        self._subgraphs: list[CompiledFunction] = []  # TorchDynamo's graphs, when FX could not trace
        # Forward hooks on the model itself (its own, global ones) are eager's to run: the program
        # is its forward's. False for a TorchDynamo graph (it traced the hooks it runs).
        self._runs_hooks = True
        functools.update_wrapper(self, fn, updated=())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._slow(args, kwargs)  # until a program is installed as the class's __call__

    def _on_miss(self, *args: Any, **kwargs: Any) -> Any:
        return self._slow(args, kwargs)

    def _install(self, prog: Program | None) -> None:
        """Make `prog`'s entry the next call's fast path (None: the slow path)."""
        cls = type(self)
        if prog is None:
            if "__call__" in cls.__dict__:
                del cls.__call__
        elif cls.__dict__.get("__call__") is not prog.entry:
            cls.__call__ = prog.entry

    def _slow(self, args: tuple, kwargs: dict) -> Any:
        """Everything the fast path does not: bind keywords, decide eager or native, look up or
        compile the program for this signature, and make it the next call's fast path."""
        self._slow_calls += 1
        outer = getattr(_running, "wrappers", ())
        _running.wrappers = (*outer, self)
        try:
            return self._miss(args, kwargs)
        finally:
            _running.wrappers = outer

    def _miss(self, args: tuple, kwargs: dict) -> Any:
        if kwargs:
            bound = self._bind(args, kwargs)
            if bound is None and self._signature() is not None:
                return self.fn(*args, **kwargs)  # a call its signature refuses: eager's TypeError
            if bound is None:  # **kwargs in forward (Hugging Face models): TorchDynamo binds them
                if self._dynamo is None:
                    with self._lock:  # (one TorchDynamo capture for all threads)
                        if self._dynamo is None:
                            self._dynamo = self._through_dynamo("keyword arguments that cannot be bound positionally")
                if self._dynamo is None:
                    return self.fn(*args, **kwargs)
                return self._dynamo(*args, **kwargs)
            args = bound
        if self._dynamo is not None:
            return self._dynamo(*args)
        if torch.is_grad_enabled() and self._needs_grad(args):
            return self._eager("gradients are needed (grad mode on and a tensor requires grad)", args, {})
        unusual = signatures.unusual_state()
        if unusual:
            return self._eager(f"{unusual} is active; native code would bypass it", args, {})
        if self._runs_hooks and self._module is not None and hooked(self._module):  # (the trace is of forward)
            return self._eager("forward hooks run on the model itself", args, {})
        if self._epoch != self.epoch[0]:  # before the signature: it holds the modules' flags
            self._reset()
            self._why = "the model's submodules were replaced"
        try:
            key = signatures.signature(args) + self._trace_state() + signatures.global_state()
        except Exception:  # e.g. a sparse tensor has no strides
            return self._eager("an argument braze cannot describe", args, {})
        if any(isinstance(a, torch.Tensor) and not signatures.plain_cpu(a) for a in args):
            return self._eager("an argument that is not a plain, strided CPU tensor", args, {})
        if not all(signatures.plain_cpu(p) for p in self._params):
            return self._eager("a parameter that is not a plain, strided CPU tensor", args, {})
        prog = self._cache.get(key)
        if isinstance(prog, Program) and prog.stale:  # an ATen call inside changed its layout
            self._cache.pop(key, None)  # another thread may have dropped it already
            if key in self._restaled:  # twice: its layouts change from call to call
                self._cache[key] = _EAGER
                return self._eager("an ATen call inside returns layouts that change between calls", args, {})
            self._restaled.add(key)
            self._why = "an ATen call inside returned another layout than when compiled"
            prog = None
        if prog is None:
            prog = self._covering(key, args)
        if isinstance(prog, Program) and prog.stale:
            # The generic program's ATen call gave these sizes another layout than its family's
            # (ATen's size-1 special cases): they get a program of their own (it was handed the
            # same program back, forever); the family keeps its other sizes.
            prog.stale = False
            self._not_generic.add(signatures.family_key(key, prog.family))
            self._why = "an ATen call inside the generic program returned another layout at these sizes"
            prog = None
        if prog is None:
            prog = self._compile(key, args)
        if prog is _EAGER:
            return self.fn(*args)
        if isinstance(prog, _Failed):
            # Bad inputs fail to compile the way they fail in eager: let eager raise its error.
            out = self.fn(*args)
            self._say(prog.why)
            self._cache[key] = _EAGER
            return out
        if not isinstance(prog, Program):  # the TorchDynamo path took over
            return prog(*args)
        # The entry may have refused a call of this signature because the thread's dispatch
        # state changed (no_grad -> inference_mode, say): check the tensors again under this one.
        changed = prog.rearm(args)  # `.double()`, `linear.bias = None`, a hook added: recompile
        if changed:
            self._cache.pop(key, None)
            if changed == ATTRIBUTE_CHANGED:  # `layer.alpha = 2.0`: forward may read it otherwise
                self._reset()
            self._why = changed
            return self._miss(args, {})
        out = prog.body(*args)
        self._install(prog)
        return out

    # --- shape-generic programs ----------------------------------------------------------------
    def _covering(self, key: tuple, args: tuple) -> Program | None:
        """A generic program whose family holds this call's signature."""
        for prog in reversed(self._generic):
            if prog.family.values(args) is not None and signatures.family_key(key, prog.family) == prog.family_key:
                return prog
        return None

    def _keep_generic(self, prog: Program, key: tuple) -> None:
        """Keep a generic program (it replaces one of the same family), at most cache_size."""
        prog.family_key = signatures.family_key(key, prog.family)
        kept = [p for p in self._generic if p.family_key != prog.family_key]
        self._generic = kept[len(kept) + 1 - self.cache_size :] + [prog]

    def _places(self, key: tuple, args: tuple) -> tuple[list[list[Place]], list[tuple[int, ...]]]:
        """The argument dimensions to compile a generic program for, one list per symbol, and
        the symbols' values in the calls so far; none to compile for this call's sizes alone.

        dynamic=None (the default) goes generic on the dimensions whose size changed from the
        signature compiled last, when nothing else did (as torch.compile's automatic dynamic
        shapes do); dynamic=True on every dimension of the first call's contiguous tensors that
        may change (not those a weight fixes)."""
        if self.dynamic is False:
            return [], []
        if self.symbolic:
            # TorchDynamo's graph says where its symbolic sizes are. Symbols of equal value are
            # taken as one (an attention mask's batch and its input's: TorchDynamo keeps them
            # apart, and lowering at sizes where they differ fails); a call where they differ
            # then misses and compiles for its own.
            merged: dict[int, list[Place]] = {}
            for ps in self.symbolic:
                merged.setdefault(size_at(args, ps[0]), []).extend(ps)
            places, seen = list(merged.values()), [tuple(merged)]
        else:
            if self.dynamic:
                candidates = [(i, d) for i, a in enumerate(args) if signatures.contiguous(a) for d in range(a.dim())]
                old, changed = key, set(varying(self._captured, args, candidates))
            else:
                old, changed = self._last_key, signatures.size_change(self._last_key, key, len(args))
            symbols: dict[tuple[int, int], list[Place]] = {}
            for i, d in sorted(changed):
                symbols.setdefault((old[i][0][d], args[i].shape[d]), []).append((i, d))
            places, seen = list(symbols.values()), [tuple(v[0] for v in symbols), tuple(v[1] for v in symbols)]
        if signatures.family_key(key, Family(tuple(map(tuple, places)), ())) in self._not_generic:
            return [], []  # tried for this family before, and it did not fit
        return places, seen

    # --- helpers -----------------------------------------------------------------------------
    def _signature(self) -> inspect.Signature | None:
        """forward's (or the function's) signature, where every parameter may be given by
        position (None otherwise: **kwargs and the like go to TorchDynamo). Read once: 20-50 us
        that a keyword call would otherwise pay each time."""
        if self._sig is not _UNREAD:
            return self._sig
        target = self.fn.forward if self._module is not None else self.fn
        try:
            sig: inspect.Signature | None = inspect.signature(target)
        except (TypeError, ValueError):
            sig = None
        if sig is not None and any(
            p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in sig.parameters.values()
        ):
            sig = None
        self._sig = sig
        return sig

    def _bind(self, args: tuple, kwargs: dict) -> tuple | None:
        sig = self._signature()
        try:
            bound = sig.bind(*args, **kwargs) if sig is not None else None
        except TypeError:
            return None
        if bound is None:
            return None
        bound.apply_defaults()
        return tuple(bound.arguments.values())

    def _names(self) -> tuple[str, ...]:
        """The parameters' names, for the native entry to place keyword arguments by."""
        sig = self._signature()
        if sig is None or any(p.kind is p.POSITIONAL_ONLY for p in sig.parameters.values()):
            return ()
        return tuple(sig.parameters)

    def _rebind(self, old: torch.Tensor, new: torch.Tensor) -> None:
        self._params = [new if p is old else p for p in self._params]
        for prog in self.programs():
            prog.rebind(old, new)

    def _storm(self) -> None:
        """Say once when compilations keep coming (STORM), and what keeps changing."""
        count, calls = STORM
        if len(self._compiled_at) < count or self._slow_calls - self._compiled_at[0] >= calls or "storm" in self._said:
            return
        self._said.add("storm")
        whys = collections.Counter(signatures.topic(c.why) for c in self.compilations[-count:])
        what, _ = whys.most_common(1)[0]
        ms = sum(c.ms for c in self.compilations[-count:]) / count
        self._say(
            f"{count} compilations in its last {self._slow_calls - self._compiled_at[0] + 1} calls, mostly for "
            f"{what} ({ms:.0f} ms each): each program is specialised to its shapes (see compiled.compilations)",
            eagerly=False,
        )

    def _needs_grad(self, args: tuple) -> bool:
        return any(isinstance(a, torch.Tensor) and a.requires_grad for a in args) or any(
            p.requires_grad for p in self._params
        )

    def _reset(self) -> None:
        self._cache.clear()
        self._generic.clear()
        self._not_generic.clear()
        self._install(None)
        self._captured = None
        self._epoch = self.epoch[0]
        self._find_state()

    def _find_state(self) -> None:
        """The model's modules (each one's `training` flag is part of what is compiled: a
        submodule's Dropout reads its own) and parameters."""
        self._watched = tuple(self._module.modules()) if self._module is not None else ()
        self._params = list(self._module.parameters()) if self._module is not None else []
        for m in self._watched:
            _watching.setdefault(m, weakref.WeakSet()).add(self)

    def _say(self, why: str, eagerly: bool = True) -> None:
        if why not in self._said:
            self._said.add(why)
            doing = "running {} eagerly" if eagerly else "{} keeps compiling"
            message = f"braze: {doing.format(capture._name(self.fn))}: {why}"
            warnings.warn(message, BrazeWarning, stacklevel=_caller_level())

    def _through_dynamo(self, why: str) -> Callable[..., Any] | None:
        from . import backend  # it imports this module

        return backend.dynamo_fallback(self, why)

    def _eager(self, why: str, args: Any, kwargs: dict) -> Any:
        self._say(why)
        return self.fn(*args, **kwargs)

    def _compile(self, key: tuple, args: tuple) -> Any:
        with self._lock, _no_gc():
            if key in self._cache:
                return self._cache[key]
            if self._dynamo is not None:  # another thread's _build, while this one waited
                return self._dynamo
            entry = self._build(key, args)
            if entry is None:
                return self._dynamo or _EAGER
            if isinstance(entry, _Failed):
                return entry
            if isinstance(entry, Program):
                self._record(entry, key)
                self._why, self._last_key = "", key
            self._cache[key] = entry
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return entry

    def _build(self, key: tuple, args: tuple) -> Any:
        t0 = time.perf_counter()
        if self._captured is None or self._captured_state != self._trace_state():
            try:
                self.use_capture(capture.trace(self.fn, len(args)))
            except capture.CaptureError as e:
                self._dynamo = self._through_dynamo(str(e))
                return None
        capture_ms = (time.perf_counter() - t0) * 1e3
        places, seen = self._places(key, args)
        note = ""
        try:
            prog = None
            if places:
                try:
                    prog = build_program(self._captured, args, self.epoch, places, seen, self._names())
                except (NotGeneric, Undecided) as e:
                    note = f"; compiled for these sizes only: {e}"
                    self._not_generic.add(signatures.family_key(key, Family(tuple(map(tuple, places)), ())))
                if prog is not None and prog.family.values(args) is None:
                    # the family leaves out this call's sizes (ATen lowers a size of 1 otherwise):
                    # keep it for the calls it holds, and compile for this one
                    self._adopt(prog, key, capture_ms, t0)
                    outside = signatures.generic_note(prog)[2:]
                    note = f"; compiled for these sizes only: outside the generic program's ({outside})"
                    prog = None
            if prog is None:
                prog = build_program(self._captured, args, self.epoch, names=self._names())
        except Unsupported as e:
            self._say(str(e))
            return _EAGER
        except Exception as e:
            if config.debug >= 2:
                raise
            failed = f"compilation failed ({type(e).__name__}: {e})"
            prog = exact_instead(self._captured, lambda c: build_program(c, args, self.epoch, names=self._names()))
            if prog is None:
                return _Failed(failed)
            self._say(f"fast mode's {failed}; exact mode's program instead", eagerly=False)
        return self._finish(prog, note or signatures.generic_note(prog), capture_ms, t0)

    def _finish(self, prog: Program, note: str, capture_ms: float, t0: float) -> Program:
        prog.shapes_note = note
        prog.timings.insert(0, ("capture", capture_ms))
        prog.total_ms = (time.perf_counter() - t0) * 1e3
        debug.report_compile(prog, self.fn)
        return prog

    def _adopt(self, prog: Program, key: tuple, capture_ms: float, t0: float) -> None:
        """Keep a generic program built for a call it does not hold: it serves later calls."""
        self._record(self._finish(prog, signatures.generic_note(prog), capture_ms, t0), key)

    def _record(self, prog: Program, key: tuple) -> None:
        """A program compiled for `key`: its misses come back here; counted with why and how
        long it took (and a storm said); kept among the generic ones if it is one."""
        prog.bind(self._on_miss)
        why = (self._why or signatures.difference(self._last_key, key)) + prog.shapes_note
        self.compilations.append(signatures.Compilation(why, prog.total_ms))
        self._compiled_at.append(self._slow_calls)
        self._storm()
        if prog.family is not None:
            self._keep_generic(prog, key)

    def use_capture(self, captured: capture.Captured) -> None:
        """Compile from `captured`, a graph of the model with its modules' flags as they are now."""
        self._captured = dataclasses.replace(captured, mode=self.mode)
        self._captured_state = self._trace_state()

    def _trace_state(self) -> tuple:
        """What a traced graph may have baked in besides the model: forward may branch on the
        modules' training flags, and tensors it makes without inputs (torch.ones(3)) become
        constants of the default dtype."""
        return (*(m.training for m in self._watched), torch.get_default_dtype())

    def compilation_count(self) -> int:
        """How many programs it compiled, its TorchDynamo graphs' too (each with why and how
        long: `compilations`, and each graph's)."""
        return len(self.compilations) + sum(sub.compilation_count() for sub in self._subgraphs)

    def programs(self) -> list[Program]:
        """The compiled specialisations this wrapper holds, oldest first."""
        own = [p for p in self._cache.values() if isinstance(p, Program)]
        own += [p for p in self._generic if all(p is not q for q in own)]
        return own + [p for sub in self._subgraphs for p in sub.programs()]

    def __reduce_ex__(self, protocol: Any) -> tuple:
        """Pickled (and deep-copied): the model or function and braze's options; programs are
        compiled again, on the first call after loading."""
        return _compiled_again, (self.fn, self.mode, self.cache_size, self.dynamic)


class CompiledModule(CompiledFunction, torch.nn.Module):
    """What `braze.compile` returns for an nn.Module: an nn.Module itself, as torch.compile's
    OptimizedModule is. The model is its submodule `_orig_mod`, so `train()`, `eval()`, `to()`
    and `parameters()` reach it; `state_dict()` and `load_state_dict()` are the model's own (the
    same keys), and any other attribute is read from the model."""

    def __init__(
        self, fn: torch.nn.Module, mode: str = "exact", cache_size: int | None = None, dynamic: bool | None = None
    ) -> None:
        torch.nn.Module.__init__(self)
        self._orig_mod = fn
        self.training = fn.training
        CompiledFunction.__init__(self, fn, mode, cache_size, dynamic)

    def __setattr__(self, name: str, value: Any) -> None:
        # Only the model is a submodule: braze's own attributes (the model as `fn`, TorchDynamo's
        # callable...) must not become modules, parameters or state_dict entries.
        if name == "_orig_mod":
            torch.nn.Module.__setattr__(self, name, value)
        else:
            object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:
        try:
            return torch.nn.Module.__getattr__(self, name)
        except AttributeError:
            if name in ("fn", "_orig_mod", "_modules"):
                raise
            return getattr(self.fn, name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._slow(args, kwargs)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn.state_dict(*args, **kwargs)

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn.load_state_dict(*args, **kwargs)


def compile(
    fn: Callable[..., Any] | None = None,
    *,
    mode: str = "exact",
    cache_size: int | None = None,
    dynamic: bool | None = None,
) -> Any:
    """Wrap `fn` (an nn.Module or a function of tensors); nothing is compiled until its first call.

    Works as `braze.compile(model)`, `@braze.compile` and `@braze.compile(mode=...)`.
    `mode`: "exact" (default) gives eager's bits, torch.equal; "fast" uses faster kernels where
    they win (fast.py), within the accuracy contract `braze.check_accuracy` reports.
    `dynamic`, as torch.compile's: None (default) compiles for the first call's sizes, then, when
    a call differs from the last compiled only in sizes, one program for every size of the
    dimensions that changed; True makes every dimension generic from the first call; False
    compiles a program per signature.
    """
    if fn is None:
        return lambda f: compile(f, mode=mode, cache_size=cache_size, dynamic=dynamic)
    kind = CompiledModule if isinstance(fn, torch.nn.Module) else CompiledFunction
    return kind(fn, mode=mode, cache_size=cache_size, dynamic=dynamic)


def _compiled_again(fn: Callable[..., Any], mode: str, cache_size: int, dynamic: bool | None = None) -> Any:
    """A wrapper unpickled: compiled afresh, lazily."""
    return compile(fn, mode=mode, cache_size=cache_size, dynamic=dynamic)
