"""Stage 5, entry points: how a call gets from Python into a program's machine code.

Every program has two CPython-callable native functions:

- `entry(*args, **kwargs)` is what a call of a compiled model runs. It checks the call against
  the specialisation (the guard), then runs `body`, or hands the whole call to `on_miss` (the
  wrapper's slow path, which recompiles or runs eagerly);
- `body(*args)` runs the program unchecked: natively, when its ATen calls are all of ops native
  code calls itself (codegen/calls.py) or made once per sizes, and every output is a fresh
  tensor (it takes the results made once per sizes from the program's Python function, reads
  the data pointers, allocates the outputs with ATen's allocator (an output that is an ATen
  call's result is that result), releases the GIL around the kernels and ATen calls and wraps
  the outputs as Python tensors); else by calling the
  program's generated Python body, which makes the ATen calls.

Both are the same two functions for every program, `braze_entry` and `braze_body` (which share
`braze_run`), built once per process (when braze is imported); a program passes them its
Descriptor: what to check and what to run, as data. A program's own module holds only its
kernels and two trampolines that pass its descriptor. This module holds the descriptor's layout
and what fills it; codegen/entry.py the native code of the two functions.

The guard checks, for every tensor argument and every parameter native code reads: its type, its
dispatch keys (one word of its TensorImpl: device, layout, lazy negation, functorch wrappers),
dtype, sizes and strides, and that each parameter is still registered where it was (setting one
to None calls no hook); that the forward hook tables of the layers the program calls or inlines
hold as many hooks as when compiled, and those layers' attribute dictionaries are at the
versions they were (CPython 3.11's dict version tag: `layer.alpha = 2.0` changes it; the slow
path then captures again where an attribute but the training flag changed); and the thread's
dispatch state (two words: dispatch modes, functorch transforms, autocast, inference mode), so
that native code runs only where eager would run the plain CPU kernels; and, for a program with
GEMMs, ATen's float32 matmul precision (and MKL's thread count, where a GEMM runs on one
thread); and, for fast mode's weights packed once (fast.GemmPack), that each is still the
tensor packed, at the same data pointer and version (`t._version`, read through its
VersionCounter: jit.version_offsets); a mismatch misses, and Program.rearm packs it again.
Where a lowering chose a path by a weight's requires_grad (ATen's matmul folds a batch where it is
set, under no_grad too), the entry checks that flag as compiled.
Tensors are read through ATen's C shim (the `aoti_torch_*` functions of libtorch)
where it has a getter; a Python tensor object holds its at::Tensor at jit.TENSOR_OFFSET.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import llvmlite.ir as ll
import torch

from .codegen import I64, PTR, ModuleBuilder
from .ir import TensorMeta
from .jit import (
    compile_module,
    default_dtype,
    define_symbols,
    dict_version,
    dispatch_keys,
    realigned,
    shim_constant,
    tls_dispatch_words,
)

NULL = ll.Constant(PTR, None)
PY_EQ = 2
UNBOUND = -1  # a symbol's slot before a size binds it (every symbol's smallest value is >= 1)


@dataclass(frozen=True)
class TensorCheck:
    """One tensor the entry checks: an argument (at `pos`) or a parameter (`pos` is -1)."""

    example: torch.Tensor  # the tensor as compiled (for a parameter, the parameter itself)
    pos: int  # argument position, or -1 for a parameter
    slot: int  # where native code reads its data pointer, or -1
    layout: bool  # check type, dispatch keys, dtype, sizes and strides (else only requires_grad)
    # Sizes and strides as words (see `ref`), where a shape-generic program reads symbols: None
    # for the example's own.
    words: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    grad: int = -1  # requires_grad as compiled (0 or 1), checked in any grad mode; -1: see _check_tensor


@dataclass(frozen=True)
class EntrySpec:
    """What the entry checks and what a native body reads and writes (slots of its table)."""

    n_args: int
    tensors: tuple[TensorCheck, ...]  # the tensor arguments, then the parameters
    const_args: tuple[tuple[int, Any], ...]  # (position, value) of specialised Python values
    modules: tuple[torch.nn.Module, ...]  # whose `training` flags must stay as compiled
    epoch: Any  # ctypes int64 cell bumped when a module of the model changes structure
    epoch_value: int
    matmul_precision: int  # jit.matmul_precision() the GEMMs were compiled for; -1: no GEMM
    mkl_threads: int  # jit.mkl_threads() the GEMMs' calls were probed at (one thread, own kernel); -1: none
    mkldnn: int  # torch.backends.mkldnn's flag the program needs (GELU: enabled; convolutions: as compiled); -1: none
    flash: int  # 1: the program computes ATen's flash attention, which eager runs only while enabled; -1: none
    # (slot, layout as words, -1) of each output allocated per call and returned, or (-1, layout,
    # the table word of its handle) of one that an ATen call of the native body returned
    outputs: tuple[tuple[int, TensorMeta, int], ...]
    tuple_output: bool
    scratch: tuple[tuple[int, int], ...]  # (slot, bytes as a word) of buffers kept across calls
    n_slots: int
    release_gil: bool  # around the kernels: other Python threads run meanwhile
    symbols: tuple[tuple[int, int, int], ...] = ()  # (slot, smallest, largest value): a generic program's
    int_symbols: tuple[tuple[int, int], ...] = ()  # (position, slot): int arguments that are symbols
    names: tuple[str, ...] = ()  # the parameters' names, where keyword arguments may name them
    error_slot: int = -1  # the table's word kernels set (codegen.BAD_INDEX, OUT_OF_MEMORY): the call raises
    failed_slot: int = -1  # the table's word set when an ATen call of a native body fails (codegen/calls.py)
    memo_slots: tuple[int, ...] = ()  # where a native body reads its memoized results (the `memo` field's)
    # (a module's `_parameters` or `_buffers`, a name, a parameter's tensor record): that the
    # name there is still the record's tensor
    owners: tuple[tuple[dict, str, int], ...] = ()
    hooks: tuple[tuple[dict, int], ...] = ()  # forward hook tables, each to hold that many hooks
    huge_scratch: int = 0  # kept scratch of at least this many bytes goes on 2 MB pages (0: never)
    versions: tuple[tuple[dict, int], ...] = ()  # layers' dictionaries and their versions (jit.dict_version)
    # (a tensor record, the fast.GemmPack made from its tensor): that it is the tensor packed,
    # at the same address and version
    packs: tuple[tuple[int, Any], ...] = ()


def ref(slot: int) -> int:
    """A word that stands for the value in slot `slot` of the table, not for itself (sizes,
    strides and byte counts are never negative): a shape-generic program's symbol, bound from
    the first size that names it and required equal at the others, or a value its `dims`
    function computes from the symbols."""
    return -1 - slot


# --- the descriptor: one record of 8-byte words, read by the generic code by index ----------------

_FIELDS = (
    "miss on_miss py_body run training n_modules modules oom epoch epoch_value n_args "
    "n_consts const_pos const_types const_values tls_included tls_excluded default_dtype matmul_precision mkl_threads "
    "mkldnn flash "
    "n_tensors tensors n_symbols symbols n_int_symbols int_symbols int_type dims n_names names "
    "n_outputs outputs tuple_output n_scratch scratch kept capacity n_slots release_gil busy error_slot index_error "
    "failed_slot retry memo n_memo memo_slots n_owners owners n_hooks hooks huge n_versions versions n_packs packs"
).split()
W = {name: i for i, name in enumerate(_FIELDS)}
TENSOR_WORDS = ("pos", "obj", "layout", "type", "keys", "dtype", "ndim", "sizes", "strides", "slot", "nonempty", "grad")
MODULE_WORDS = ("obj", "expected", "lookup")  # lookup: 0 the instance dict, 1 getattr
OWNER_WORDS = ("table", "name", "tensor")
HOOK_WORDS = ("table", "count")
VERSION_WORDS = ("dict", "version")
PACK_WORDS = ("tensor", "obj", "data", "counter", "count")  # (see fast.stamp)
OUTPUT_WORDS = ("slot", "dtype", "ndim", "sizes", "strides", "handle")
SCRATCH_WORDS = ("slot", "bytes")
SYMBOL_WORDS = ("slot", "lo", "hi")
INT_SYMBOL_WORDS = ("pos", "slot")
MAX_DIMS = 64  # torch's limit on a tensor's dimensions
INDEX_ERROR = "index out of range in self"  # eager's message for an embedding index out of range
OOM_ERROR = "braze: out of memory for a compiled program's buffers"


def _words(values: list[int]) -> Any:
    return (ctypes.c_int64 * max(len(values), 1))(*values)


class Descriptor:
    """A program's descriptor, in memory that native code reads; it keeps what it points at alive."""

    def __init__(self, spec: EntrySpec, miss: Any, py_body: Any, run: int) -> None:
        self._keep: list[Any] = []  # arrays and objects the words point at
        self._held: dict[int, tuple[Any, ...]] = {}  # tensor record -> its parameter (and the one before)
        self._objects: dict[str, Any] = {}  # the object each object word points at now
        self.words = _words([0] * len(_FIELDS))
        self.address = ctypes.addressof(self.words)
        self._guard(spec, miss)
        self._body(spec, py_body, run)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at exit, the module may be gone before us
            _free(self.words[W["kept"]])  # the scratch memory native code allocated, if any

    def _guard(self, spec: EntrySpec, miss: Any) -> None:
        for name, obj in {"miss": miss, "training": sys.intern("training")}.items():
            self.set_object(name, obj)
        modules = [w for m in spec.modules for w in (self._ref(m), self._ref(m.training), _lookup(m))]
        self._set_array("modules", "n_modules", modules, len(spec.modules))
        self.set("epoch", ctypes.addressof(spec.epoch))
        self.set("epoch_value", spec.epoch_value)
        self.set("matmul_precision", spec.matmul_precision)
        self.set("mkl_threads", spec.mkl_threads)
        self.set("mkldnn", spec.mkldnn)
        self.set("flash", spec.flash)
        self.set("n_args", spec.n_args)
        self._set_array("symbols", "n_symbols", [w for sym in spec.symbols for w in sym], len(spec.symbols))
        self._set_array(
            "int_symbols", "n_int_symbols", [w for sym in spec.int_symbols for w in sym], len(spec.int_symbols)
        )
        self.set_object("int_type", int)
        self._set_array("names", "n_names", [self._ref(sys.intern(n)) for n in spec.names])
        self._set_array("const_pos", "n_consts", [i for i, _ in spec.const_args])
        self.set("const_types", self._array([self._ref(type(v)) for _, v in spec.const_args]))
        self.set("const_values", self._array([self._ref(v) for _, v in spec.const_args]))
        owners = [w for table, name, i in spec.owners for w in (self._ref(table), self._ref(sys.intern(name)), i)]
        self._set_array("owners", "n_owners", owners, len(spec.owners))
        hooks = [w for table, n in spec.hooks for w in (self._ref(table), n)]
        self._set_array("hooks", "n_hooks", hooks, len(spec.hooks))
        self._versioned = [d for d, _ in spec.versions]
        words = [w for d in self._versioned for w in (id(d), 0)]
        self._versions = self._set_array("versions", "n_versions", words, len(self._versioned))
        self._set_versions([v for _, v in spec.versions])
        self._packs = spec.packs
        self.refresh_packs()
        records = [w for i, t in enumerate(spec.tensors) for w in self._tensor(i, t)]
        # set_dispatch_state rewrites their dispatch keys
        self.tensors = self._set_array("tensors", "n_tensors", records, len(spec.tensors))
        self.set_dispatch_state([t.example for t in spec.tensors])

    def set_dispatch_state(self, tensors: list[torch.Tensor]) -> None:
        """Expect this thread's dispatch state, and the dispatch keys `tensors` (one per record:
        the tensor arguments, then the parameters) have, as they are now."""
        included, excluded = tls_dispatch_words()
        self.set("tls_included", included)
        self.set("tls_excluded", excluded)
        self.set("default_dtype", default_dtype())  # factories inside the model follow it
        for i, t in enumerate(tensors):
            self.tensors[i * len(TENSOR_WORDS) + TENSOR_WORDS.index("keys")] = dispatch_keys(t)

    def _body(self, spec: EntrySpec, py_body: Any, run: int) -> None:
        self.set_object("py_body", py_body)
        self.set_object("oom", torch.OutOfMemoryError)
        self.set("run", run)
        outputs = [w for slot, meta, handle in spec.outputs for w in self._output(slot, meta, handle)]
        self._set_array("outputs", "n_outputs", outputs, len(spec.outputs))
        self.set("tuple_output", int(spec.tuple_output))
        # The scratch buffers: one allocation, made (and grown) by the first call that needs it
        self._set_array("scratch", "n_scratch", [w for rec in spec.scratch for w in rec], len(spec.scratch))
        self.set("n_slots", spec.n_slots)
        self.set("release_gil", int(spec.release_gil))
        self.set("error_slot", spec.error_slot)
        self.set("failed_slot", spec.failed_slot)
        self.set("huge", spec.huge_scratch)
        self._set_array("memo_slots", "n_memo", list(spec.memo_slots))
        self.set_object("index_error", IndexError)

    def rebind(self, old: torch.Tensor, new: torch.Tensor) -> None:
        """Check and read `new` where the entry read parameter `old` (replaced in its module).
        The tensor before stays referenced until the next rebind, for a call that may still be
        reading it on another thread."""
        for i, held in list(self._held.items()):
            if held[0] is old:
                self._held[i] = (new, old)
                base = i * len(TENSOR_WORDS)
                self.tensors[base + TENSOR_WORDS.index("obj")] = id(new)
                self.tensors[base + TENSOR_WORDS.index("keys")] = dispatch_keys(new)

    def refresh_packs(self) -> None:
        """Expect the tensors the packs were made from as they were when (last) packed."""
        words = [w for i, pack in self._packs for w in (i, id(pack.stamp[0]), *pack.stamp[1:])]
        self._set_array("packs", "n_packs", words, len(self._packs))  # (each pack holds its tensor)

    def refresh_versions(self) -> None:
        """Expect the watched dictionaries' versions as they are now."""
        self._set_versions([dict_version(d) for d in self._versioned])

    def _set_versions(self, versions: list[int | None]) -> None:
        for i, v in enumerate(versions):  # (a version tag is unsigned, a word signed: the same 64 bits)
            self._versions[i * len(VERSION_WORDS) + VERSION_WORDS.index("version")] = ctypes.c_int64(v or 0).value

    def set(self, name: str, value: int) -> None:
        self.words[W[name]] = value

    @property
    def on_miss(self) -> Any:
        return self._objects["on_miss"]

    def set_object(self, name: str, obj: Any) -> None:
        """Point word `name` at a Python object (None reads as NULL)."""
        self._objects[name] = obj
        self.set(name, 0 if obj is None else id(obj))

    def _ref(self, obj: Any) -> int:
        self._keep.append(obj)
        return id(obj)

    def _array(self, values: list[int]) -> int:
        return ctypes.addressof(self._kept(values))

    def _kept(self, values: list[int]) -> Any:
        arr = _words(values)
        self._keep.append(arr)
        return arr

    def _set_array(self, name: str, count: str, values: list[int], n: int | None = None) -> Any:
        """Point word `name` at a kept array of `values` and set `count`; return the array."""
        arr = self._kept(values)
        self.set(name, ctypes.addressof(arr))
        self.set(count, len(values) if n is None else n)
        return arr

    def _shape(self, shape: tuple[int, ...], stride: tuple[int, ...]) -> tuple[int, int]:
        return self._array(list(shape)), self._array(list(stride))

    def _tensor(self, i: int, t: TensorCheck) -> list[int]:
        x = t.example
        sizes, strides = self._shape(*(t.words or (tuple(x.shape), x.stride())))
        obj = 0
        if t.pos < 0:
            self._held[i] = (x,)
            obj = id(x)
        layout = [self._ref(type(x)), 0, dtype_code(x.dtype), x.dim(), sizes, strides]  # keys: set_dispatch_state
        return [t.pos, obj, int(t.layout), *layout, t.slot, int(x.numel() > 0), t.grad]

    def _output(self, slot: int, meta: TensorMeta, handle: int) -> list[int]:
        sizes, strides = self._shape(meta.shape, meta.stride)
        return [slot, dtype_code(meta.dtype), len(meta.shape), sizes, strides, handle]


_libc = ctypes.CDLL(None)
_libc.free.argtypes = [ctypes.c_void_p]


def _free(address: int) -> None:
    if address:
        _libc.free(address)


def _lookup(m: torch.nn.Module) -> int:
    """How the entry reads m.training: from the instance dict (as getattr finds it there), or
    by getattr itself where the class defines `training` or customises attribute access."""
    cls = type(m)
    custom = cls.__getattribute__ is not object.__getattribute__ or any("training" in vars(k) for k in cls.__mro__)
    return int(custom)


def dtype_code(dtype: torch.dtype) -> int:
    return shim_constant(f"dtype_{str(dtype).removeprefix('torch.')}")


# --- per program: two trampolines that pass the program's descriptor -------------------------------


def emit_trampolines(mb: ModuleBuilder) -> str:
    """Add `{prefix}_entry` and `{prefix}_body`, reading the descriptor address from the global
    `{prefix}_desc` (filled after loading); return that global's name."""
    desc = ll.GlobalVariable(mb.module, PTR, f"{mb.prefix}_desc")
    desc.initializer = NULL
    for name, args in (("entry", [PTR, PTR, I64, PTR]), ("body", [PTR, PTR, I64])):
        fn = ll.Function(mb.module, ll.FunctionType(PTR, args), f"{mb.prefix}_{name}")
        target = mb.declare(f"braze_{name}", PTR, [PTR, *args[1:]])
        b = ll.IRBuilder(fn.append_basic_block("entry"))
        b.ret(b.call(target, [b.load(desc, typ=PTR), *fn.args[1:]], tail=True))
    return desc.name


# --- the generic code, built once per process ------------------------------------------------------

_lock = threading.Lock()
_runtime: dict[str, int] = {}
MXCSR_FLUSH = 0x8040  # MXCSR's flush-to-zero and denormals-are-zero bits


def ensure_runtime() -> bool:
    """Build braze_entry and braze_body, once per process, and make them callable from every
    program's module; True if this call built them. Without LLVM's optimiser: their time goes
    into calls of the C API, and -O2 would add ~50 ms to every process that imports braze."""
    with _lock:
        if _runtime:
            return False
        mb = ModuleBuilder("braze_rt", lambda name: None, 0)  # type: ignore[arg-type,return-value]
        from .codegen.entry import Runtime  # (it reads this module's record layouts)

        Runtime(mb).emit()
        names = ["braze_entry", "braze_body", "braze_mxcsr"]
        _runtime.update(compile_module(str(realigned(mb.module)), names, 0, False).addresses)
        define_symbols(_runtime)
        return True


@functools.cache
def _mxcsr() -> Callable[[], int]:
    ensure_runtime()
    return ctypes.CFUNCTYPE(ctypes.c_uint32)(_runtime["braze_mxcsr"])


def flushes_denormals() -> bool:
    """Whether this thread's MXCSR flushes denormals (torch.set_flush_denormal(True))."""
    return bool(_mxcsr()() & MXCSR_FLUSH)
