"""A memo of TorchDynamo's guard checks, for the frames braze captures through it (backend.py).

TorchDynamo picks a frame's compiled code by running its guards: 950-1150 checks on a small
Hugging Face model's modules, config, globals and arguments, which took 160-270 us a call once
the model's own work had pushed them out of the caches (bert-tiny, exact mode: 14% of its
call). Almost every call finds the same state. So after a check of the newest compiled code
passes, `record` turns the guards that code was compiled with (TorchDynamo hands them to
`Recorder` as it compiles, by its guard filter) into a `Witness`: what they read, in a form
cheap to check again, and the next call that finds the witness holding takes the code without
running the guards.

What a guard reads is its source, a chain of reads from the frame's arguments, the model and
the globals; a read's result stays the same while what it reads from is unchanged:
- an attribute in an instance's or module's `__dict__`, a class attribute (every class
  dictionary on the MRO: one could add a data descriptor or shadow it), an item of a dict: the
  dictionary's version tag (CPython moves it on every change);
- an object's type, a closure cell's contents, a function's `__code__` / `__defaults__` /
  `__kwdefaults__`: the word in the object (its address and the value it held);
- what no word tells (an attribute through a custom `__getattribute__`, a property, an item of a
  list, `hasattr`): the read itself, again, in Python (`calls`);
- tensors' layouts (TENSOR_MATCH): TorchDynamo's own C++ check (TensorGuards), the arguments'
  at their exact sizes and strides; the global state (grad mode, default dtype, threads,
  autocast, deterministic algorithms): its GlobalStateGuard, plus the torch-function mode stack,
  the default device, inference mode and the saved-tensor hooks.
The words are compared by one native function (WORDS). A guard of a kind or a source of
a form not listed here gives no witness: that code's calls run the guards, as before.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import gc
import sys
import types
from collections.abc import Callable
from typing import Any

import llvmlite.ir as ll
import torch

from . import jit

# The guards whose result follows from their value's identity and what the source reads; and
# those checked on the global state (ROOT) or as the arguments (args rooted: their values).
_IDENTITY = {
    "ID_MATCH", "TYPE_MATCH", "CLASS_MATCH", "MODULE_MATCH", "BUILTIN_MATCH", "FUNCTION_MATCH",
    "CLOSURE_MATCH", "CONSTANT_MATCH", "EQUALS_MATCH", "NONE_MATCH", "DUPLICATE_INPUT",
    "NOT_PRESENT_IN_GENERIC_DICT", "DICT_NOT_CONTAINS", "DICT_CONTAINS", "DICT_KEYS_MATCH",
    "DICT_VERSION", "DICT_LENGTH", "EMPTY_NN_MODULE_HOOKS_DICT", "SEQUENCE_LENGTH", "TENSOR_MATCH",
    "HASATTR",
}  # fmt: skip
_ROOT = {
    "GRAD_MODE", "DETERMINISTIC_ALGORITHMS", "GLOBAL_STATE", "TORCH_FUNCTION_STATE", "DEFAULT_DEVICE",
    "AUTOGRAD_SAVED_TENSORS_HOOKS", "SHAPE_ENV",
}  # fmt: skip
_IMMUTABLE = (type(None), bool, int, float, complex, str, bytes, range, torch.dtype, torch.device)
_HEAPTYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class whose dictionary can change

WORDS = "braze_words_equal"  # (pairs: address, value; n) -> whether every word holds its value


class Unsupported(Exception):
    """A guard or source the witness cannot stand for."""


class Recorder:
    """TorchDynamo's guard filter: keeps every guard, and notes each compilation's guards by its
    compile id (the id its cache entry carries)."""

    def __init__(self) -> None:
        self.guards: dict[Any, list[tuple[str, Any, dict]]] = {}  # (kind, source, its arguments)

    def __call__(self, entries: list[Any]) -> list[bool]:
        try:  # (nothing here may fail TorchDynamo's compilation: a guard list not kept gives no witness)
            compile_id = torch._guards.CompileContext.current_compile_id()
            if compile_id is not None:
                self.guards[compile_id] = [
                    (e.guard_type, e.orig_guard.originating_source, getattr(e.orig_guard.create_fn, "keywords", {}))
                    for e in entries
                ]
        except Exception:
            pass
        return [True] * len(entries)


@dataclasses.dataclass
class Witness:
    """What a passing check of a cache entry's guards read (`entry`: its guard manager, held),
    checked again by state_holds and arguments_hold; the arguments' part is replaced whole
    where only the arguments changed."""

    entry: Any
    words: Any  # ctypes array: address, value, address, value, ...
    count: int
    keep: list[Any]  # whatever the words' addresses and values belong to, kept alive
    calls: list[tuple[Any, ...]]
    tensors: tuple[torch.Tensor, ...]  # guarded tensors not among the arguments (parameters...)
    tensor_ids: dict[int, int]  # id of each of them -> -1 - its index (first), for Arguments
    tensor_guard: Any
    state: Any  # GlobalStateGuard
    extra: tuple
    arguments: Arguments | None = None

    def state_holds(self) -> bool:
        """Whether what the guards read outside the arguments is as it was."""
        if not self.state.check() or _extra_state() != self.extra:
            return False
        if not _words_equal()(self.words, self.count) or not self.tensor_guard.check(*self.tensors):
            return False
        return all(_call_holds(c) for c in self.calls)

    def arguments_hold(self, args: tuple, kwargs: dict) -> bool:
        part = self.arguments  # (one read: another thread may replace it)
        return part is not None and part.hold(args, kwargs, self.tensor_ids)


@dataclasses.dataclass(frozen=True)
class Arguments:
    """A call's arguments as the guards saw them: tensors at their exact layouts (TensorGuards),
    which of them are one another or a guarded tensor, the others' types and values."""

    n_args: int
    kw_names: tuple[str, ...]
    values: tuple  # per argument: None (a tensor) or (type, value)
    aliases: tuple[int, ...]  # per tensor: the index of the first argument it is, or of a guarded tensor
    guard: Any

    @staticmethod
    def of(args: tuple, kwargs: dict, guarded: dict[int, int]) -> Arguments:
        values, tensors = [], []
        for v in (*args, *kwargs.values()):
            if isinstance(v, torch.Tensor):
                values.append(None)
                tensors.append(v)
            elif isinstance(v, _IMMUTABLE):
                values.append((type(v), v))
            else:
                raise Unsupported(f"an argument of type {type(v).__name__}")
        aliases = _aliases(tensors, guarded)
        return Arguments(len(args), tuple(kwargs), tuple(values), aliases, _tensor_guard(tensors))

    def hold(self, args: tuple, kwargs: dict, guarded: dict[int, int]) -> bool:
        if len(args) != self.n_args or tuple(kwargs) != self.kw_names:
            return False
        tensors = []
        for v, want in zip((*args, *kwargs.values()), self.values):
            if want is None:
                if not isinstance(v, torch.Tensor):
                    return False
                tensors.append(v)
            elif type(v) is not want[0] or v != want[1]:
                return False
        return _aliases(tensors, guarded) == self.aliases and self.guard.check(*tensors)


def record(entry: Any, guards: list[tuple[str, Any, dict]], fn: Any, scope: dict) -> Witness:
    """The witness of `guards` (cache entry `entry`'s, from Recorder) of the frame
    own(*args, **kwargs) whose closure holds `fn` and whose globals are `scope`, as they are now
    (its check just passed); its arguments' part is set by the caller. Raises Unsupported where
    none can stand for them."""
    if not _usable():
        raise Unsupported("this CPython's objects are laid out otherwise")
    b = _Builder(fn, scope)
    for kind, source, arguments in guards:
        b.guard(kind, source, arguments)
    pairs = list(b.words.items())
    tensors = tuple(b.tensors.values())
    _words_equal()  # (built now, with the witness, not by the first call that checks one)
    return Witness(
        entry=entry,
        words=(ctypes.c_uint64 * (2 * len(pairs) or 1))(*[x for pair in pairs for x in pair]),
        count=len(pairs),
        keep=b.keep,
        calls=list(b.calls.values()),
        tensors=tensors,
        tensor_ids={id(t): -1 - i for i, t in reversed(list(enumerate(tensors)))},
        tensor_guard=_tensor_guard(list(tensors)),
        state=torch._C._dynamo.guards.GlobalStateGuard(),
        extra=_extra_state(),
    )


class _Builder:
    """Walks each guard's source to its value, noting the words and reads it depends on."""

    def __init__(self, fn: Any, scope: dict) -> None:
        self.fn, self.scope = fn, scope
        self.words: dict[int, int] = {}  # address -> the value it must hold
        self.keep: list[Any] = []
        self.calls: dict[tuple, tuple[Any, ...]] = {}
        self.tensors: dict[int, torch.Tensor] = {}
        self.memo: dict[Any, Any] = {}

    def guard(self, kind: str, source: Any, arguments: dict) -> None:
        if kind in _ROOT:
            return  # the global state: Witness.state and extra
        if kind not in _IDENTITY:
            raise Unsupported(f"a guard of kind {kind}")
        if kind == "DUPLICATE_INPUT":  # two sources one object: both read; an argument's by identity
            for one, other in ((source, arguments["source_b"]), (arguments["source_b"], source)):
                if _argument(one) and not _argument(other):
                    value = self.value(other)
                    if isinstance(value, torch.Tensor):  # (Arguments records which it is)
                        self.tensors[id(value)] = value
                elif not _argument(one):
                    self.value(one)
            return
        if _argument(source):
            return  # the arguments: compared whole (Arguments)
        value = self.value(source)
        if kind == "HASATTR":
            attr = arguments["attr"]
            if self.has_attribute(value, attr) is None:  # asked again
                self.call("hasattr", value, attr, hasattr(value, attr))
        elif kind in ("TYPE_MATCH", "CLASS_MATCH"):
            self.type_of(value)
        elif kind == "CLOSURE_MATCH" and type(value) is types.FunctionType:
            self.slot(value, "__code__")
        elif kind in ("CONSTANT_MATCH", "EQUALS_MATCH") and not _immutable(value):
            if type(value) not in (dict, collections.OrderedDict):
                raise Unsupported(f"a value of type {type(value).__name__} compared by equality")
            self.version(value)
        elif kind == "NOT_PRESENT_IN_GENERIC_DICT":
            self.version(_instance_dict(value))
        elif kind in ("DICT_NOT_CONTAINS", "DICT_CONTAINS", "DICT_KEYS_MATCH", "DICT_VERSION", "DICT_LENGTH"):
            self.version(value)
        elif kind == "EMPTY_NN_MODULE_HOOKS_DICT":
            self.version(value)
        elif kind == "SEQUENCE_LENGTH" and type(value) is not tuple:
            if isinstance(value, dict):
                self.version(value)
            else:
                self.call("len", value, None, len(value))
        elif kind == "TENSOR_MATCH":
            if not isinstance(value, torch.Tensor):
                raise Unsupported("TENSOR_MATCH on a non-tensor")
            self.tensors[id(value)] = value

    def call(self, kind: str, obj: Any, key: Any, value: Any) -> None:
        """A read asked again every call (_call_holds), once per object and key."""
        self.calls.setdefault((kind, id(obj), key), (kind, obj, key, value))

    def has_attribute(self, obj: Any, name: str) -> bool | None:
        """hasattr(obj, name) from the dictionaries it reads (noted), where an object's lookup is
        Python's own and its __getattr__ none or nn.Module's; None where it cannot tell."""
        cls = type(obj)
        if cls.__getattribute__ is not object.__getattribute__ or name.startswith("__"):
            return None
        found = _class_attribute(cls, name)
        if found is not _MISSING and type(found) is not types.FunctionType and hasattr(type(found), "__get__"):
            return None  # a property or another descriptor: its __get__ may raise
        own = getattr(obj, "__dict__", None)
        if type(own) is not dict:
            return None
        self.classes(cls)
        self.version(own)
        if name in own or found is not _MISSING:
            return True
        hook = _class_attribute(cls, "__getattr__")
        if hook is _MISSING:
            return False
        if hook is not torch.nn.Module.__getattr__:
            return None
        try:
            return self.module_lookup(own, name) is not _MISSING
        except Unsupported:
            return None

    def module_lookup(self, own: dict, name: str) -> Any:
        """nn.Module.__getattr__'s lookup of `name` in the parameters, buffers and submodules of
        the module whose __dict__ is `own`, noting their versions; _MISSING where none has it."""
        tables = [own.get(table) for table in ("_parameters", "_buffers", "_modules")]
        if not all(type(t) is dict for t in tables):
            raise Unsupported("a module whose parameter, buffer or submodule table is not a dict")
        for table in tables:
            self.version(table)
        return next((table[name] for table in tables if name in table), _MISSING)

    # --- the words ---------------------------------------------------------------------------
    def word(self, owner: Any, address: int, value: int, *held: Any) -> None:
        self.words[address] = value
        self.keep.extend((owner, *held))

    def version(self, d: Any) -> None:
        if not isinstance(d, dict):
            raise Unsupported(f"a version of a {type(d).__name__}")
        self.word(d, id(d) + jit.DICT_VERSION_OFFSET, jit.dict_version(d))

    def type_of(self, obj: Any) -> None:
        self.word(obj, id(obj) + _OFFSETS["ob_type"], id(type(obj)), type(obj))

    def slot(self, fn: types.FunctionType, name: str) -> Any:
        value = getattr(fn, name)  # (no defaults: the slot holds NULL, Python reads None)
        self.word(fn, id(fn) + _OFFSETS[name], 0 if value is None else id(value), value)
        return value

    def classes(self, cls: type) -> None:
        """The dictionaries of cls's MRO that can change (an attribute found there, or one added
        before it, changes what the lookup gives)."""
        for c in cls.__mro__:
            if c.__flags__ & _HEAPTYPE:
                self.version(_type_dict(c))

    # --- sources -----------------------------------------------------------------------------
    def value(self, source: Any) -> Any:
        if source not in self.memo:
            self.memo[source] = self._value(source)
        return self.memo[source]

    def _value(self, source: Any) -> Any:  # noqa: C901 (one case per source type)
        from torch._dynamo import source as S

        kind = type(source)
        if kind is S.LocalSource:
            if source.local_name != "fn":
                raise Unsupported(f"the local {source.local_name}")
            return self.fn
        if kind is S.GlobalSource:
            self.version(self.scope)
            return self.scope[source.global_name]
        if kind in (S.NNModuleSource, S.UnspecializedNNModuleSource, S.UnspecializedBuiltinNNModuleSource):
            return self.value(source.base)
        if kind in (S.AttrSource, S.UnspecializedParamBufferSource, S.CellContentsSource):
            return self.attribute(self.value(source.base), source.member)
        if kind in (S.DictGetItemSource, S.DictSubclassGetItemSource):
            d = self.value(source.base)
            key = self.value(source.index) if isinstance(source.index, S.ConstDictKeySource) else source.index
            self.version(d)
            return dict.__getitem__(d, key)
        if kind is S.ConstDictKeySource:
            d = self.value(source.base)
            self.version(d)
            return list(dict.keys(d))[source.index]
        if kind is S.GetItemSource and not source.index_is_slice:
            base = self.value(source.base)
            if type(base) is tuple:
                return base[source.index]
            if type(base) is dict:
                self.version(base)
                return base[source.index]
            value = base[source.index]
            self.call("getitem", base, source.index, value)
            return value
        if kind is S.TypeSource:
            obj = self.value(source.base)
            self.type_of(obj)
            return type(obj)
        if kind is S.TypeDictSource:
            return _type_dict(self.value(source.base))
        if kind is S.TypeMROSource:
            cls = self.value(source.base)
            self.call("getattr", cls, "__mro__", cls.__mro__)
            return cls.__mro__
        if kind is S.ClosureSource:
            return self.value(source.base).__closure__  # (read-only)
        if kind is S.DefaultsSource:
            fn = self.value(source.base)
            if source.is_kw:
                defaults = self.slot(fn, "__kwdefaults__")
                self.version(defaults)
                return defaults[source.idx_key]
            return self.slot(fn, "__defaults__")[source.idx_key]
        raise Unsupported(f"a source of type {kind.__name__}")

    def attribute(self, obj: Any, name: str) -> Any:
        """obj.name, noting what the lookup reads."""
        if type(obj) is types.CellType and name == "cell_contents":
            value = obj.cell_contents
            self.word(obj, id(obj) + _OFFSETS["cell_contents"], id(value), value)
            return value
        if type(obj) is types.FunctionType and name in ("__code__", "__defaults__", "__kwdefaults__"):
            return self.slot(obj, name)
        if type(obj) is types.FunctionType and name in ("__globals__", "__closure__"):
            return getattr(obj, name)  # (read-only)
        if isinstance(obj, types.ModuleType) and type(obj).__getattribute__ is types.ModuleType.__getattribute__:
            if name in obj.__dict__ and not _data_descriptor(type(obj), name):
                self.classes(type(obj))  # (a module's own class: one could add a descriptor)
                self.version(obj.__dict__)
                return obj.__dict__[name]
        if isinstance(obj, type) and type(obj) is type and not name.startswith("__"):
            return self.class_attribute(obj, name)
        if type(obj).__getattribute__ is object.__getattribute__ and not name.startswith("__"):
            return self.instance_attribute(obj, name)
        value = getattr(obj, name)  # a custom __getattribute__, a dunder: read again every call
        self.call("getattr", obj, name, value)
        return value

    def class_attribute(self, cls: type, name: str) -> Any:
        self.classes(cls)
        for c in cls.__mro__:
            raw = _type_dict(c).get(name, _MISSING)
            if raw is not _MISSING:
                if hasattr(type(raw), "__get__") and type(raw) is not types.FunctionType:
                    value = getattr(cls, name)  # classmethod, property...: read again
                    self.call("getattr", cls, name, value)
                    return value
                return raw
        raise Unsupported(f"class attribute {name} not in the MRO")

    def instance_attribute(self, obj: Any, name: str) -> Any:
        cls = type(obj)
        self.classes(cls)
        found = _class_attribute(cls, name)
        descriptor = type(found)
        if found is not _MISSING and _data_descriptor(cls, name):
            value = getattr(obj, name)  # a property, a slot: read again
            self.call("getattr", obj, name, value)
            return value
        own = getattr(obj, "__dict__", None)
        if type(own) is dict:
            self.version(own)
            if name in own:
                return own[name]
        if found is not _MISSING:
            if hasattr(descriptor, "__get__"):  # a method: a new bound object each time
                value = getattr(obj, name)
                self.call("getattr", obj, name, value)
                return value
            return found
        if type(own) is dict and _class_attribute(cls, "__getattr__") is torch.nn.Module.__getattr__:
            value = self.module_lookup(own, name)
            if value is not _MISSING:
                return value
        raise Unsupported(f"attribute {name} of a {cls.__name__}")


_MISSING = object()


def _class_attribute(cls: type, name: str) -> Any:
    return next((_type_dict(c)[name] for c in cls.__mro__ if name in _type_dict(c)), _MISSING)


def _data_descriptor(cls: type, name: str) -> bool:
    """Whether cls's attribute `name` takes precedence over an instance's own (a property, a slot)."""
    found = type(_class_attribute(cls, name))
    return hasattr(found, "__set__") or hasattr(found, "__delete__")


def _argument(source: Any) -> bool:
    """Whether the source is the frame's arguments or one of them (compared whole by holds);
    deeper reads into them are not."""
    from torch._dynamo import source as S

    if type(source) is S.LocalSource:
        return source.local_name in ("args", "kwargs")
    if type(source) in (S.GetItemSource, S.DictGetItemSource) and type(source.base) is S.LocalSource:
        if source.base.local_name in ("args", "kwargs"):
            return True
    if _rooted(source):
        raise Unsupported(f"a read into an argument ({source.name})")
    return False


def _rooted(source: Any) -> bool:
    from torch._dynamo import source as S

    while hasattr(source, "base"):
        source = source.base
    return type(source) is S.LocalSource and source.local_name in ("args", "kwargs")


def _immutable(v: Any) -> bool:
    """Whether v compares equal to what it was while it is the same object: a value that cannot
    change, or one whose equality is its identity."""
    if isinstance(v, tuple | frozenset):
        return type(v) in (tuple, frozenset) and all(_immutable(x) for x in v)
    return type(v) in _IMMUTABLE or type(v) is types.CodeType or type(v).__eq__ is object.__eq__


def _instance_dict(obj: Any) -> dict:
    own = getattr(obj, "__dict__", None)
    if type(own) is not dict:
        raise Unsupported(f"a {type(obj).__name__} without a plain __dict__")
    return own


def _type_dict(cls: type) -> dict:
    """The dictionary behind a class's __dict__ proxy."""
    (d,) = gc.get_referents(cls.__dict__)
    return d


def _call_holds(call: tuple[Any, ...]) -> bool:
    kind, obj, key, want = call
    try:
        if kind == "hasattr":
            return hasattr(obj, key) is want
        if kind == "len":
            return len(obj) == want
        value = getattr(obj, key) if kind == "getattr" else obj[key]
    except Exception:
        return False
    return value is want or (type(value) is types.MethodType and value == want)


def _tensor_guard(tensors: list[torch.Tensor]) -> Any:
    sizes = [list(t.shape) for t in tensors]
    strides = [list(t.stride()) for t in tensors]
    return torch._C._dynamo.guards.TensorGuards(*tensors, dynamic_dims_sizes=sizes, dynamic_dims_strides=strides)


def _aliases(tensors: list[torch.Tensor], guarded: dict[int, int]) -> tuple[int, ...]:
    """Per tensor, -1 - the index of the guarded tensor it is (Witness.tensor_ids), or else the
    index of the first of them it is (TorchDynamo guards that no two sources are one tensor, or
    that two are)."""
    first: dict[int, int] = {}
    return tuple(guarded.get(id(t), first.setdefault(id(t), i)) for i, t in enumerate(tensors))


def _extra_state() -> tuple:
    """The global state TorchDynamo guards on beyond its GlobalStateGuard (its modules are
    loaded by then: the state is read only once TorchDynamo compiled)."""
    hooks = _saved_tensors_hooks()
    return (
        torch._C._len_torch_function_stack(),
        sys.modules["torch.utils._device"].CURRENT_DEVICE,
        torch.is_inference_mode_enabled(),
        None if hooks is None else tuple(map(id, hooks)),
    )


def _saved_tensors_hooks() -> Any:
    return sys.modules["torch._functorch._aot_autograd.utils"].top_saved_tensors_hooks()


# --- CPython's layout, found on samples (None: the memo stays off) ------------------------------
def _find_offsets() -> dict[str, int] | None:
    def word(obj: Any, offset: int) -> int:
        return ctypes.c_uint64.from_address(id(obj) + offset).value

    def sample(a: int = 1, *, b: int = 2) -> int:
        return a + b + marker

    marker = 3
    cell = sample.__closure__[0]
    offsets = {"ob_type": 8, "cell_contents": 16}
    if word(sample, 8) != id(types.FunctionType) or word(cell, 16) != id(cell.cell_contents):
        return None
    for name in ("__code__", "__defaults__", "__kwdefaults__"):
        target = id(getattr(sample, name))
        hits = [k for k in range(16, types.FunctionType.__basicsize__ - 7, 8) if word(sample, k) == target]
        if len(hits) != 1:
            return None
        offsets[name] = hits[0]
    return offsets


_OFFSETS = _find_offsets() or {}


def _usable() -> bool:
    return bool(_OFFSETS) and jit.dict_version({}) is not None


def _write_words(module: ll.Module) -> None:
    i64 = ll.IntType(64)
    ptr = ll.PointerType(i64)
    fn = ll.Function(module, ll.FunctionType(ll.IntType(32), [ptr, i64]), WORDS)
    pairs, n = fn.args
    entry, loop, body, same, done = (fn.append_basic_block(x) for x in ("entry", "loop", "body", "same", "done"))
    b = ll.IRBuilder(entry)
    b.branch(loop)
    b.position_at_end(loop)
    i = b.phi(i64)
    i.add_incoming(i64(0), entry)
    b.cbranch(b.icmp_signed("<", i, n), body, done)
    b.position_at_end(body)
    address = b.load(b.gep(pairs, [b.mul(i, i64(2))]))
    want = b.load(b.gep(pairs, [b.add(b.mul(i, i64(2)), i64(1))]))
    got = b.load(b.inttoptr(address, ptr))
    b.cbranch(b.icmp_unsigned("==", got, want), same, done)
    b.position_at_end(same)
    i.add_incoming(b.add(i, i64(1)), same)
    b.branch(loop)
    b.position_at_end(done)
    result = b.phi(ll.IntType(32))
    result.add_incoming(ll.IntType(32)(1), loop)
    result.add_incoming(ll.IntType(32)(0), body)
    b.ret(result)


_checker: list[Callable[[Any, int], int]] = []


def _words_equal() -> Callable[[Any, int], int]:
    if not _checker:
        address = jit.kernel(WORDS, _write_words)
        _checker.append(ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int64)(address))
    return _checker[0]
