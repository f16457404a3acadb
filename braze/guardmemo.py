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
  dictionary's version tag (CPython moves it on every change), and the instance's pointer to
  its `__dict__` (an assignment to `obj.__dict__` leaves the old dictionary's version as it was);
- an object's type, a closure cell's contents, what a C-level slot holds (a function's
  `__code__` / `__defaults__` / `__kwdefaults__` / `__name__`, a class's `__name__` and
  `__mro__`, a property's getter, a static or class method's function: _SLOTS): the word in
  the object (its address and the value it held);
- an attribute through a Python `__getattribute__` that `_HOOKS` knows (Hugging Face configs'):
  what its model says the function reads, as words;
- what no word tells (another `__getattribute__`, a property, an item of a list, `hasattr` of
  a descriptor): the read itself, again, in Python (`calls`);
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
import dis
import gc
import hashlib
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
            if self.own_dict(value) is None:
                raise Unsupported(f"a {type(value).__name__} without a plain __dict__")
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
        Python's own (or a hook of _HOOKS before it) and its __getattr__ none or nn.Module's;
        None where it cannot tell."""
        cls = type(obj)
        if name.startswith("__"):
            return None
        try:
            name = self.looked_up(obj, name)
        except Unsupported:
            return None
        if name is None:
            return None
        found = _class_attribute(cls, name)
        alias = self.alias(found, name) if _class_attribute(cls, "__getattr__") is _MISSING else None
        if alias is not None:  # (its getter reads obj.alias: hasattr is whether that is there)
            self.classes(cls)
            return self.has_attribute(obj, alias)
        if found is not _MISSING and type(found) is not types.FunctionType and hasattr(type(found), "__get__"):
            return None  # a property or another descriptor: its __get__ may raise
        self.classes(cls)
        own = self.own_dict(obj)
        if own is None:
            return None
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

    def slot(self, obj: Any, name: str) -> Any:
        """obj.name, a pointer its C struct holds (_SLOTS: the descriptor of a function's code,
        a class's name...); the word is the pointer as it is (NULL reads None)."""
        value = getattr(obj, name)
        self.pointer(obj, id(obj) + _SLOTS[id(_class_attribute(type(obj), name))], value, f".{name}")
        return value

    def pointer(self, obj: Any, address: int, value: Any, what: str) -> None:
        """The word at `address`, in obj, that points to `value` (NULL for None) as it is now."""
        stored = ctypes.c_uint64.from_address(address).value
        if stored != id(value) and not (value is None and stored == 0):
            raise Unsupported(f"a {type(obj).__name__}'s {what} not where its samples had it")
        self.word(obj, address, stored, value)

    def own_dict(self, obj: Any) -> dict | None:
        """obj's __dict__ (None where it has no plain one), noting its version and the pointer
        to it (an assignment to obj.__dict__ replaces the dictionary, whose version stays)."""
        if not isinstance(_class_attribute(type(obj), "__dict__"), _DICT_DESCRIPTORS):
            return None
        own = getattr(obj, "__dict__", None)
        if type(own) is not dict:
            return None
        address = _dict_pointer(obj)
        if address is None:
            raise Unsupported(f"a {type(obj).__name__} whose __dict__'s place is not known")
        self.pointer(obj, address, own, "__dict__")
        self.version(own)
        return own

    def hooks(self, cls: type) -> list[Callable[..., str]] | None:
        """The models (_HOOKS) of the __getattribute__ functions on cls's MRO before object's, in
        its order, noting what they read; None where one is not known."""
        chain = []
        for c in cls.__mro__[:-1]:
            fn = _type_dict(c).get("__getattribute__", _MISSING)
            if fn is _MISSING:
                continue
            model = _HOOKS.get(_digest(fn)) if type(fn) is types.FunctionType else None
            if model is None:
                return None
            cell = fn.__closure__[fn.__code__.co_freevars.index("__class__")]
            if self.attribute(cell, "cell_contents") is not c:  # (super() reads the class after c)
                return None
            self.slot(fn, "__code__")
            self.version(fn.__globals__)  # (`super` is a global read, from builtins unless shadowed)
            self.version(fn.__builtins__)
            chain.append(model)
        return chain

    def alias(self, found: Any, name: str) -> str | None:
        """The attribute a property's getter returns as it is (`return self.other`, all it
        does), noting the getter and its code; None for any other class attribute."""
        other = _alias(found)
        if other is None or other == name:
            return None
        self.slot(self.slot(found, "fget"), "__code__")
        return other

    def looked_up(self, obj: Any, name: str) -> str | None:
        """The name obj's lookup passes to object's: `name` where its __getattribute__ is
        object's, as the hooks of _HOOKS map it where they know it; None where not known."""
        if type(obj).__getattribute__ in _GENERIC:
            return name
        chain = self.hooks(type(obj))
        return None if chain is None else self.renamed(obj, name, chain)

    def renamed(self, obj: Any, name: str, chain: list[Callable[..., str]]) -> str:
        """The name object's lookup reads after the hooks of `chain` (hooks) map it."""
        for i, hook in enumerate(chain):
            name = hook(self, obj, name, chain[i + 1 :])
        return name

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
            return self.attribute(self.value(source.base), "__mro__")
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
        cls = type(obj)
        if cls is types.FunctionType and name in ("__globals__", "__closure__"):
            return getattr(obj, name)  # (read-only)
        if isinstance(obj, types.ModuleType) and cls.__getattribute__ is types.ModuleType.__getattribute__:
            if name in obj.__dict__ and not _data_descriptor(_class_attribute(cls, name)):
                self.classes(cls)  # (a module's own class: one could add a descriptor)
                self.version(obj.__dict__)
                return obj.__dict__[name]
        if isinstance(obj, type) and cls.__getattribute__ is type.__getattribute__:
            return self.class_attribute(obj, name)
        looked = self.looked_up(obj, name)
        if looked is not None:
            return self.instance_attribute(obj, looked)
        return self.asked(obj, name)  # another __getattribute__: read again every call

    def asked(self, obj: Any, name: str) -> Any:
        """obj.name, read again on every check (_call_holds)."""
        try:
            value = getattr(obj, name)
        except Exception as e:  # (the guards read it: gone already, the state is changing)
            raise Unsupported(f"{type(obj).__name__}.{name} unreadable ({e})") from e
        self.call("getattr", obj, name, value)
        return value

    def class_attribute(self, cls: type, name: str) -> Any:
        """cls.name as type.__getattribute__ finds it: the metaclass's data descriptor, else the
        classes of the MRO, else (asked again) the metaclass's other attributes or __getattr__."""
        meta = type(cls)
        self.classes(meta)
        described = _class_attribute(meta, name)
        if _data_descriptor(described):
            if id(described) not in _SLOTS:
                return self.asked(cls, name)
            # type's __name__ and __mro__: a heap type's pointers, a static type's fixed
            return self.slot(cls, name) if cls.__flags__ & _HEAPTYPE else getattr(cls, name)
        self.classes(cls)
        for c in cls.__mro__:
            raw = _type_dict(c).get(name, _MISSING)
            if raw is not _MISSING:
                if hasattr(type(raw), "__get__") and type(raw) is not types.FunctionType:
                    return self.asked(cls, name)  # classmethod, property...
                return raw
        return self.asked(cls, name)

    def instance_attribute(self, obj: Any, name: str) -> Any:
        cls = type(obj)
        self.classes(cls)
        found = _class_attribute(cls, name)
        if _data_descriptor(found):  # a property, a slot: before the instance's own
            if found is _CLASS_OF_OBJECT:
                self.type_of(obj)
                return cls
            alias = self.alias(found, name)
            if alias is not None:
                return self.attribute(obj, alias)
            return self.slot(obj, name) if id(found) in _SLOTS else self.asked(obj, name)
        own = self.own_dict(obj)
        if own is not None and name in own:
            return own[name]
        if found is not _MISSING:
            if hasattr(type(found), "__get__"):  # a method: a new bound object each time
                return self.asked(obj, name)
            return found
        if own is not None and _class_attribute(cls, "__getattr__") is torch.nn.Module.__getattr__:
            value = self.module_lookup(own, name)
            if value is not _MISSING:
                return value
        raise Unsupported(f"attribute {name} of a {cls.__name__}")


def _aliased(b: _Builder, obj: Any, name: str, rest: list[Callable[..., str]]) -> str:
    """transformers' PreTrainedConfig: a name its attribute_map holds reads the one it maps to."""
    if name == "attribute_map":
        return name
    table = b.instance_attribute(obj, b.renamed(obj, "attribute_map", rest))
    if type(table) is not dict:
        raise Unsupported(f"an attribute_map of type {type(table).__name__}")
    b.version(table)
    return table.get(name, name)


def _homogeneous(b: _Builder, obj: Any, name: str, rest: list[Callable[..., str]]) -> str:
    """transformers' HeterogeneousConfigMixin: object's lookup, on a config without per-layer
    attributes (its __dict__ holds no _heterogeneity_spec)."""
    own = b.own_dict(obj)
    if own is None or own.get("_heterogeneity_spec") is not None:
        raise Unsupported("a heterogeneous config")
    return name


def _alias(found: Any) -> str | None:
    """For a property whose getter is `def f(self): return self.name` (nothing else), the name."""
    fget = found.fget if type(found) is property else None
    if type(fget) is not types.FunctionType or fget.__closure__ or fget.__code__.co_argcount != 1:
        return None
    code = fget.__code__
    ops = [(i.opname, i.argval) for i in dis.get_instructions(code) if i.opname not in ("RESUME", "CACHE", "NOP")]
    if len(ops) != 3 or ops[0] != ("LOAD_FAST", code.co_varnames[0]) or ops[2][0] != "RETURN_VALUE":
        return None
    return ops[1][1] if ops[1][0] == "LOAD_ATTR" and isinstance(ops[1][1], str) else None


def _digest(fn: types.FunctionType) -> str:
    """Which code fn runs, for _HOOKS: its Python version and a hash of its instructions,
    constants and names."""
    digest = hashlib.sha256(_code_text(fn.__code__).encode()).hexdigest()[:16]
    return f"{sys.version_info.major}.{sys.version_info.minor}:{digest}"


def _code_text(c: types.CodeType) -> str:
    consts = [_code_text(k) if type(k) is types.CodeType else f"{type(k).__name__}:{k!r}" for k in c.co_consts]
    return repr((c.co_code, consts, c.co_names, c.co_varnames, c.co_freevars))


# The Python __getattribute__ functions whose reads the witness knows (by their code's _digest:
# another version of the library, or of Python, leaves them asked again every call). Each model
# (builder, obj, name, the hooks after it) notes what the function reads before it passes the
# lookup on, and gives the name it passes. Hugging Face's configs have both: without them each
# config read was a call of ~3 us (17 of them in a BertModel's guards).
_HOOKS: dict[str, Callable[[_Builder, Any, str, list], str]] = {
    "3.11:5d0fb7d762130c8c": _aliased,  # transformers 5's PreTrainedConfig.__getattribute__
    "3.11:236a3cfd8945d33b": _homogeneous,  # transformers 5's HeterogeneousConfigMixin.__getattribute__
}
# The __getattribute__ of types whose lookup is object's (CPython's PyObject_GenericGetAttr)
_GENERIC = (
    object.__getattribute__, property.__getattribute__, staticmethod.__getattribute__,
    classmethod.__getattribute__, types.CellType.__getattribute__,
)  # fmt: skip
_CLASS_OF_OBJECT = vars(object)["__class__"]
_DICT_DESCRIPTORS = (types.GetSetDescriptorType, types.MemberDescriptorType)


_MISSING = object()


def _class_attribute(cls: type, name: str) -> Any:
    return next((_type_dict(c)[name] for c in cls.__mro__ if name in _type_dict(c)), _MISSING)


def _data_descriptor(found: Any) -> bool:
    """Whether a class attribute takes precedence over an instance's own (a property, a slot)."""
    return found is not _MISSING and (hasattr(type(found), "__set__") or hasattr(type(found), "__delete__"))


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
def _find_offsets() -> tuple[dict[str, int], dict[int, int]] | None:
    """Where objects keep what the witness reads as words: the type's pointer, a managed
    __dict__'s pointer (before the object), and the pointers behind the descriptors of _SLOTS
    (by the descriptor's id)."""

    def word(obj: Any, offset: int) -> int:
        return ctypes.c_uint64.from_address(id(obj) + offset).value

    class Sample:  # a heap type whose name and qualified name are two strings
        __qualname__ = "braze.sample"

    def sample(a: int = 1, *, b: int = 2) -> int:
        return a + b + marker

    marker = 3
    instance = Sample()
    own = instance.__dict__
    managed = [k for k in range(-48, 0, 8) if word(instance, k) == id(own)]
    if word(sample, 8) != id(types.FunctionType) or len(managed) != 1:
        return None
    reads = [(sample, name) for name in ("__code__", "__defaults__", "__kwdefaults__", "__name__")]
    reads += [(sample.__closure__[0], "cell_contents"), (property(sample), "fget"), (Sample, "__name__")]
    reads += [(staticmethod(sample), "__func__"), (classmethod(sample), "__func__"), (Sample, "__mro__")]
    slots = {}
    for obj, name in reads:
        target = id(getattr(obj, name))
        hits = [k for k in range(16, type(obj).__basicsize__ - 7, 8) if word(obj, k) == target]
        if len(hits) != 1:
            return None
        slots[id(_class_attribute(type(obj), name))] = hits[0]
    return {"ob_type": 8, "managed_dict": managed[0]}, slots


_OFFSETS, _SLOTS = _find_offsets() or ({}, {})
_MANAGED_DICT = 1 << 4  # Py_TPFLAGS_MANAGED_DICT: the instance's __dict__ pointer lies before it


def _dict_pointer(obj: Any) -> int | None:
    """The address of the pointer to obj's __dict__; None where it is not known."""
    cls = type(obj)
    if cls.__flags__ & _MANAGED_DICT:
        return id(obj) + _OFFSETS["managed_dict"]
    return id(obj) + cls.__dictoffset__ if cls.__dictoffset__ > 0 else None  # (not a variable-sized one's)


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
