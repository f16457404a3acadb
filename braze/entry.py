"""Stage 5, entry points: how a call gets from Python into a program's machine code.

Every program has two CPython-callable native functions:

- `entry(*args, **kwargs)` is what a call of a compiled model runs. It checks the call against
  the specialisation (the guard), then runs `body`, or hands the whole call to `on_miss` (the
  wrapper's slow path, which recompiles or runs eagerly);
- `body(*args)` runs the program unchecked: natively, when its ATen calls are all of ops native
  code calls itself (codegen/calls.py) or made once per sizes, and every output is a fresh
  tensor (it takes the results made once per sizes from the program's Python function, reads
  the data pointers, allocates the outputs with ATen's allocator, releases the GIL around the
  kernels and ATen calls and wraps the outputs as Python tensors); else by calling the
  program's generated Python body, which makes the ATen calls.

Both are the same two functions for every program, `braze_entry` and `braze_body` (which share
`braze_run`), built once per process (when braze is imported); a program passes them its
Descriptor: what to check and what to run, as data. A program's own module holds only its
kernels and two trampolines that pass its descriptor.

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

from .codegen import I1, I8, I32, I64, PTR, VOID, ModuleBuilder, counted_loop
from .ir import TensorMeta
from .jit import (
    DEFAULT_DTYPE,
    DICT_VERSION_OFFSET,
    FN_MODE,
    FP32_PRECISION,
    GLOBAL_CONTEXT,
    KEYSET_OFFSET,
    MATMUL,
    MKL_THREADS,
    MKLDNN,
    MKLDNN_ENABLED,
    REQUIRES_GRAD,
    TENSOR_OFFSET,
    TLS_GUARD,
    TLS_GUARD_END,
    WRAP,
    compile_module,
    default_dtype,
    define_symbols,
    dict_version,
    dispatch_keys,
    realigned,
    shim_constant,
    tls_dispatch_words,
    version_offsets,
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
    outputs: tuple[tuple[int, TensorMeta], ...]  # (slot, layout as words) allocated per call and returned
    tuple_output: bool
    scratch: tuple[tuple[int, int], ...]  # (slot, bytes as a word) of buffers kept across calls
    n_slots: int
    release_gil: bool  # around the kernels: other Python threads run meanwhile
    symbols: tuple[tuple[int, int, int], ...] = ()  # (slot, smallest, largest value): a generic program's
    int_symbols: tuple[tuple[int, int], ...] = ()  # (position, slot): int arguments that are symbols
    names: tuple[str, ...] = ()  # the parameters' names, where keyword arguments may name them
    error_slot: int = -1  # the table's word a kernel sets on a bad index: the call raises IndexError
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
    "mkldnn "
    "n_tensors tensors n_symbols symbols n_int_symbols int_symbols int_type dims n_names names "
    "n_outputs outputs tuple_output n_scratch scratch kept capacity n_slots release_gil busy error_slot index_error "
    "failed_slot retry memo n_memo memo_slots n_owners owners n_hooks hooks huge n_versions versions n_packs packs"
).split()
W = {name: i for i, name in enumerate(_FIELDS)}
TENSOR_WORDS = ("pos", "obj", "layout", "type", "keys", "dtype", "ndim", "sizes", "strides", "slot", "nonempty")
MODULE_WORDS = ("obj", "expected", "lookup")  # lookup: 0 the instance dict, 1 getattr
OWNER_WORDS = ("table", "name", "tensor")
HOOK_WORDS = ("table", "count")
VERSION_WORDS = ("dict", "version")
PACK_WORDS = ("tensor", "obj", "data", "counter", "count")  # (see fast.stamp)
OUTPUT_WORDS = ("slot", "dtype", "ndim", "sizes", "strides")
SCRATCH_WORDS = ("slot", "bytes")
SYMBOL_WORDS = ("slot", "lo", "hi")
INT_SYMBOL_WORDS = ("pos", "slot")
MAX_DIMS = 64  # torch's limit on a tensor's dimensions
INDEX_ERROR = "index out of range in self"  # eager's message for an embedding index out of range


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
        outputs = [w for slot, meta in spec.outputs for w in self._output(slot, meta)]
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
        return [t.pos, obj, int(t.layout), *layout, t.slot, int(x.numel() > 0)]

    def _output(self, slot: int, meta: TensorMeta) -> list[int]:
        sizes, strides = self._shape(meta.shape, meta.stride)
        return [slot, dtype_code(meta.dtype), len(meta.shape), sizes, strides]


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


def _aligned(b: ll.IRBuilder, nbytes: ll.Value) -> ll.Value:
    """nbytes rounded up to 64 (each scratch buffer starts on a cache line)."""
    return b.and_(b.add(nbytes, I64(63)), I64(-64))


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
HUGE_PAGE, MADV_HUGEPAGE = 2 << 20, 14  # (Linux x86-64)


def ensure_runtime() -> bool:
    """Build braze_entry and braze_body, once per process, and make them callable from every
    program's module; True if this call built them. Without LLVM's optimiser: their time goes
    into calls of the C API, and -O2 would add ~50 ms to every process that imports braze."""
    with _lock:
        if _runtime:
            return False
        mb = ModuleBuilder("braze_rt", lambda name: None, 0)  # type: ignore[arg-type,return-value]
        _Runtime(mb).emit()
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


class _Callee:
    """A function pointer as a call target (llvmlite's call reads the callee's function type)."""

    def __init__(self, value: ll.Value, function_type: ll.FunctionType) -> None:
        self.value, self.function_type, self.type = value, function_type, PTR

    def get_reference(self) -> str:
        return self.value.get_reference()


class _Runtime:
    """Emits braze_entry and braze_body, which read everything program-specific from the
    descriptor they are given."""

    def __init__(self, mb: ModuleBuilder) -> None:
        self.mb = mb
        d = mb.declare
        self.vectorcall = d("PyObject_Vectorcall", PTR, [PTR, PTR, I64, PTR])
        self.getattr = d("PyObject_GetAttr", PTR, [PTR, PTR])
        self.decref = d("Py_DecRef", VOID, [PTR])  # Py_XDECREF: NULL is fine
        self.data_ptr = d("aoti_torch_get_data_ptr", I32, [PTR, PTR])
        self.delete = d("aoti_torch_delete_tensor_object", I32, [PTR])

    def emit(self) -> None:
        run = self._run()
        self._body(run)
        self._entry(run)
        mxcsr = ll.Function(self.mb.module, ll.FunctionType(I32, []), "braze_mxcsr")
        b = ll.IRBuilder(mxcsr.append_basic_block("entry"))
        b.ret(self._mxcsr(b))

    # --- reading the descriptor --------------------------------------------------------------
    @staticmethod
    def word(b: ll.IRBuilder, base: ll.Value, index: ll.Value | int, ty: ll.Type = I64) -> ll.Value:
        i = I64(index) if isinstance(index, int) else index
        return b.load(b.gep(base, [i], source_etype=I64), typ=ty)

    def field(self, b: ll.IRBuilder, d: ll.Value, name: str, ty: ll.Type = I64) -> ll.Value:
        return self.word(b, d, W[name], ty)

    def record(self, b: ll.IRBuilder, d: ll.Value, name: str, i: ll.Value, words: tuple[str, ...]) -> Callable:
        """Accessor for word `w` of record `i` of the array `name`."""
        base = self.field(b, d, name, PTR)
        start = b.mul(i, I64(len(words)))
        return lambda w, ty=I64: self.word(b, base, b.add(start, I64(words.index(w))), ty)

    @staticmethod
    def item(b: ll.IRBuilder, array: ll.Value, i: ll.Value | int) -> ll.Value:
        return b.gep(array, [I64(i) if isinstance(i, int) else i], source_etype=PTR)

    # --- braze_entry: the guard --------------------------------------------------------------
    def _entry(self, run: ll.Function) -> None:
        fn = ll.Function(self.mb.module, ll.FunctionType(PTR, [PTR, PTR, I64, PTR]), "braze_entry")
        d, args, nargs, kwnames = fn.args
        b = ll.IRBuilder(fn.append_basic_block("entry"))
        miss = fn.append_basic_block("miss")
        table = b.alloca(PTR, size=self.field(b, d, "n_slots"))  # the guard reads data pointers into it

        def require(ok: ll.Value) -> None:
            nxt = fn.append_basic_block("ok")
            b.cbranch(ok, nxt, miss)
            b.position_at_end(nxt)

        f = lambda name, ty=I64: self.field(b, d, name, ty)  # noqa: E731
        given = args  # the call's own arguments, which a miss passes on as they came
        args = self._keywords(b, d, args, nargs, kwnames, require)
        nargs = f("n_args")
        require(b.icmp_signed("==", b.load(f("epoch", PTR), typ=I64), f("epoch_value")))
        self._check_consts(b, d, args, require)
        self._check_dispatch_state(b, d, require)
        require(self._denormals_kept(b))
        grad_mode = b.call(self.mb.declare("aoti_torch_grad_mode_is_enabled", I1, []), [])
        with counted_loop(b, I64(0), f("n_symbols")) as i:
            sym = self.record(b, d, "symbols", i, SYMBOL_WORDS)
            b.store(I64(UNBOUND), self.item(b, table, sym("slot")))
        with counted_loop(b, I64(0), f("n_tensors")) as i:
            self._check_layout(b, d, args, i, table, require)
        with counted_loop(b, I64(0), f("n_int_symbols")) as i:
            self._bind_int(b, d, args, i, table, require)
        with counted_loop(b, I64(0), f("n_symbols")) as i:
            sym = self.record(b, d, "symbols", i, SYMBOL_WORDS)
            value = b.load(self.item(b, table, sym("slot")), typ=I64)
            require(b.and_(b.icmp_signed(">=", value, sym("lo")), b.icmp_signed("<=", value, sym("hi"))))
        self._dims(b, d, table)
        with counted_loop(b, I64(0), f("n_tensors")) as i:
            self._check_tensor(b, d, args, i, table, grad_mode, require)
        with counted_loop(b, I64(0), f("n_modules")) as i:
            self._check_training(b, d, i, require)
        with counted_loop(b, I64(0), f("n_owners")) as i:
            self._check_owner(b, d, i, require)
        with counted_loop(b, I64(0), f("n_packs")) as i:
            self._check_pack(b, d, args, i, require)
        size = self.mb.declare("PyDict_Size", I64, [PTR])
        with counted_loop(b, I64(0), f("n_hooks")) as i:  # no forward hook added or removed
            h = self.record(b, d, "hooks", i, HOOK_WORDS)
            require(b.icmp_signed("==", b.call(size, [h("table", PTR)]), h("count")))
        with counted_loop(b, I64(0), f("n_versions")) as i:  # no layer's attribute set since
            v = self.record(b, d, "versions", i, VERSION_WORDS)
            tag = b.load(b.gep(v("dict", PTR), [I64(DICT_VERSION_OFFSET)], source_etype=I8), typ=I64)
            require(b.icmp_unsigned("==", tag, v("version")))
        fn_mode = b.call(self.mb.declare(FN_MODE, I8, []), [])
        require(b.icmp_unsigned("==", fn_mode, I8(0)))
        dtype = b.sext(b.call(self.mb.declare(DEFAULT_DTYPE, I8, []), []), I64)
        require(b.icmp_signed("==", dtype, f("default_dtype")))
        self._check_settings(b, d, require)
        self._python_body(b, d, args, nargs)
        b.ret(b.call(run, [d, table, args, nargs]))
        b.position_at_end(miss)
        b.call(self.mb.declare("PyErr_Clear", VOID, []), [])
        b.ret(b.call(self.vectorcall, [f("on_miss", PTR), given, fn.args[2], kwnames]))

    def _keywords(
        self, b: ll.IRBuilder, d: ll.Value, args: ll.Value, nargs: ll.Value, kwnames: ll.Value, require: Callable
    ) -> ll.Value:
        """The call's arguments in positional order: keyword arguments that name parameters
        (the descriptor's `names`, compared by identity: CPython interns the names a call site
        writes) put in their places; every parameter given once, none left to a default (a call
        that leaves one out takes the slow path, which fills in the defaults)."""
        n_args = self.field(b, d, "n_args")
        with b.goto_entry_block():
            bound = b.alloca(PTR, size=self.field(b, d, "n_args"))
        n_kw = self._alloca(b, I64)
        b.store(I64(0), n_kw)
        with b.if_then(b.icmp_unsigned("!=", kwnames, NULL)):
            b.store(b.call(self.mb.declare("PyTuple_Size", I64, [PTR]), [kwnames]), n_kw)
        keywords = b.load(n_kw, typ=I64)
        require(b.icmp_signed("==", b.add(nargs, keywords), n_args))
        names = self.field(b, d, "names", PTR)
        with b.if_then(b.icmp_signed(">", keywords, I64(0))):
            require(b.icmp_signed("==", self.field(b, d, "n_names"), n_args))
            with counted_loop(b, I64(0), n_args) as k:
                given = b.select(b.icmp_signed("<", k, nargs), b.load(self.item(b, args, k), typ=PTR), NULL)
                b.store(given, self.item(b, bound, k))
            with counted_loop(b, I64(0), keywords) as k:
                name = b.call(self.mb.declare("PyTuple_GetItem", PTR, [PTR, I64]), [kwnames, k])
                found = self._alloca(b, I64)
                b.store(I64(-1), found)
                with counted_loop(b, I64(0), n_args) as p:
                    same = b.icmp_unsigned("==", self.word(b, names, p, PTR), name)
                    b.store(b.select(same, p, b.load(found, typ=I64)), found)
                at = b.load(found, typ=I64)
                require(b.icmp_signed(">=", at, nargs))  # a parameter not given positionally (-1: none)
                require(b.icmp_unsigned("==", b.load(self.item(b, bound, at), typ=PTR), NULL))
                b.store(b.load(self.item(b, args, b.add(nargs, k)), typ=PTR), self.item(b, bound, at))
        return b.select(b.icmp_signed(">", keywords, I64(0)), bound, args)

    def _bind_int(
        self, b: ll.IRBuilder, d: ll.Value, args: ll.Value, i: ll.Value, table: ll.Value, require: Callable | None
    ) -> None:
        """Int argument i of a generic program (a TorchDynamo graph's symbolic size): an int
        (checked, unless `require` is None) whose value binds its symbol or equals the value bound."""
        sym = self.record(b, d, "int_symbols", i, INT_SYMBOL_WORDS)
        obj = b.load(self.item(b, args, sym("pos")), typ=PTR)
        if require is not None:
            ob_type = b.load(b.gep(obj, [I64(8)], source_etype=I8), typ=PTR)
            require(b.icmp_unsigned("==", ob_type, self.field(b, d, "int_type", PTR)))
        value = b.call(self.mb.declare("PyLong_AsLongLong", I64, [PTR]), [obj])
        self._bind(b, self.item(b, table, sym("slot")), value, require)

    def _bind(self, b: ll.IRBuilder, bound: ll.Value, value: ll.Value, require: Callable | None) -> None:
        """Store `value` as a symbol's (the first place that names it), or require it equal to
        the value stored; unchecked (require None), store it."""
        if require is None:
            b.store(value, bound)
            return
        before = b.load(bound, typ=I64)
        b.store(b.select(b.icmp_signed("==", before, I64(UNBOUND)), value, before), bound)
        require(b.icmp_signed("==", value, b.load(bound, typ=I64)))

    def resolve(self, b: ll.IRBuilder, table: ll.Value, word: ll.Value) -> ll.Value:
        """A size or stride word's value: itself, or the table's value that it refers to (ref)."""
        referred = b.icmp_signed("<", word, I64(0))
        slot = b.select(referred, b.sub(I64(-1), word), I64(0))
        return b.select(referred, b.load(self.item(b, table, slot), typ=I64), word)

    def _dims(self, b: ll.IRBuilder, d: ll.Value, table: ll.Value) -> None:
        """A generic program's values computed from its symbols, into the table."""
        dims = self.field(b, d, "dims", PTR)
        with b.if_then(b.icmp_unsigned("!=", dims, NULL)):
            b.call(_Callee(dims, ll.FunctionType(VOID, [PTR])), [table])

    def _check_consts(self, b: ll.IRBuilder, d: ll.Value, args: ll.Value, require: Callable) -> None:
        """type(arg) is type(value) and arg == value, for each specialised Python argument."""
        cmp = self.mb.declare("PyObject_RichCompareBool", I32, [PTR, PTR, I32])
        with counted_loop(b, I64(0), self.field(b, d, "n_consts")) as i:
            arg = b.load(self.item(b, args, self.word(b, self.field(b, d, "const_pos", PTR), i)), typ=PTR)
            ob_type = b.load(b.gep(arg, [I64(8)], source_etype=I8), typ=PTR)
            require(b.icmp_unsigned("==", ob_type, self.word(b, self.field(b, d, "const_types", PTR), i, PTR)))
            value = self.word(b, self.field(b, d, "const_values", PTR), i, PTR)
            require(b.icmp_signed("==", b.call(cmp, [arg, value, I32(PY_EQ)]), I32(1)))

    def _check_training(self, b: ll.IRBuilder, d: ll.Value, i: ll.Value, require: Callable) -> None:
        """Module i's `training` is the object (True or False) it was when compiled."""
        m = self.record(b, d, "modules", i, MODULE_WORDS)
        obj, name = m("obj", PTR), self.field(b, d, "training", PTR)
        found = self._alloca(b, PTR)
        with b.if_else(b.icmp_signed("==", m("lookup"), I64(0))) as (in_dict, by_getattr):
            with in_dict:  # a borrowed reference, or NULL (no dict, no entry: then a miss)
                slot = b.call(self.mb.declare("_PyObject_GetDictPtr", PTR, [PTR]), [obj])
                d_ = b.load(slot, typ=PTR)
                get = self.mb.declare("PyDict_GetItemWithError", PTR, [PTR, PTR])
                b.store(NULL, found)
                with b.if_then(b.icmp_unsigned("!=", d_, NULL)):
                    b.store(b.call(get, [d_, name]), found)
            with by_getattr:
                value = b.call(self.getattr, [obj, name])
                b.call(self.decref, [value])  # compared by identity (True, False) only
                b.store(value, found)
        require(b.icmp_unsigned("==", b.load(found, typ=PTR), m("expected", PTR)))

    def _check_owner(self, b: ll.IRBuilder, d: ll.Value, i: ll.Value, require: Callable) -> None:
        """Owner record i: its module still registers, under its name, the parameter the tensor
        record reads (rebind keeps the record's object the one registered now)."""
        o = self.record(b, d, "owners", i, OWNER_WORDS)
        get = self.mb.declare("PyDict_GetItemWithError", PTR, [PTR, PTR])
        registered = b.call(get, [o("table", PTR), o("name", PTR)])  # borrowed, or NULL
        t = self.record(b, d, "tensors", o("tensor"), TENSOR_WORDS)
        require(b.icmp_unsigned("==", registered, t("obj", PTR)))

    def _check_pack(self, b: ll.IRBuilder, d: ll.Value, args: ll.Value, i: ll.Value, require: Callable) -> None:
        """Pack record i: its tensor is the one packed, at the same data pointer, with the same
        version counter at the same count (`t._version`: no in-place change since)."""
        p = self.record(b, d, "packs", i, PACK_WORDS)
        obj = self._tensor_object(b, args, self.record(b, d, "tensors", p("tensor"), TENSOR_WORDS))
        require(b.icmp_unsigned("==", obj, p("obj", PTR)))
        h = b.gep(obj, [I64(TENSOR_OFFSET)], source_etype=I8)
        data = self._alloca(b, PTR)
        b.call(self.data_ptr, [h, data])
        require(b.icmp_unsigned("==", b.load(data, typ=PTR), p("data", PTR)))
        at, count = version_offsets() or (0, 0)  # (without them no program has packs)
        counter = b.load(b.gep(b.load(h, typ=PTR), [I64(at)], source_etype=I8), typ=PTR)
        require(b.icmp_unsigned("==", counter, p("counter", PTR)))  # (a packed tensor has one)
        value = b.load(b.gep(counter, [I64(count)], source_etype=I8), typ=I32)
        require(b.icmp_unsigned("==", b.zext(value, I64), p("count")))

    def _check_settings(self, b: ll.IRBuilder, d: ll.Value, require: Callable) -> None:
        """The process's settings the program's bits depend on are as compiled (a field of -1:
        the program depends on no such setting): ATen's float32 matmul precision its GEMMs were
        compiled for; MKL's thread count its one-thread GEMMs and braze's own GEMM kernels were
        probed at (on another count, eager's GEMMs may give other bits); torch.backends.mkldnn's
        flag, where its GELU is the oneDNN kernel's (which eager runs only while enabled) or its
        convolutions follow the path ATen takes with the flag as compiled."""
        context = lambda: b.call(self.mb.declare(GLOBAL_CONTEXT, PTR, []), [])  # noqa: E731
        precision = self.mb.declare(FP32_PRECISION, I32, [PTR, I32, I32])
        reads = {
            "matmul_precision": lambda: b.call(precision, [context(), I32(MKLDNN), I32(MATMUL)]),
            "mkl_threads": lambda: b.call(self.mb.declare(MKL_THREADS, I32, []), []),
            "mkldnn": lambda: b.call(self.mb.declare(MKLDNN_ENABLED, I8, [PTR]), [context()]),
        }
        for field, read in reads.items():
            want = self.field(b, d, field)
            with b.if_then(b.icmp_signed(">=", want, I64(0))):
                require(b.icmp_signed("==", b.sext(read(), I64), want))

    def _denormals_kept(self, b: ll.IRBuilder) -> ll.Value:
        """Whether this thread's MXCSR keeps denormals (no flush to zero, no denormals as zero:
        torch.set_flush_denormal(False)). With them flushed, eager's ops that set their own
        (MKL's vector math keeps denormals) and those that do not disagree with braze's fused
        loops: the call runs eagerly (signatures.unusual_state)."""
        flushing = b.and_(self._mxcsr(b), I32(MXCSR_FLUSH))
        return b.icmp_unsigned("==", flushing, I32(0))

    def _mxcsr(self, b: ll.IRBuilder) -> ll.Value:
        """This thread's MXCSR."""
        word = self._alloca(b, I32)
        b.call(self.mb.declare("llvm.x86.sse.stmxcsr", VOID, [PTR]), [word])
        return b.load(word, typ=I32)

    def _check_dispatch_state(self, b: ll.IRBuilder, d: ll.Value, require: Callable) -> None:
        """This thread's dispatch state is as compiled: no dispatch mode, functorch transform or
        autocast that eager would run the ops through; the same inference mode."""
        guard = self._alloca(b, ll.ArrayType(I64, 2))
        b.call(self.mb.declare(TLS_GUARD, VOID, [PTR, I64]), [guard, I64(0)])
        state = b.load(guard, typ=PTR)
        included, excluded = self.word(b, state, 0), self.word(b, state, 1)
        b.call(self.mb.declare(TLS_GUARD_END, VOID, [PTR]), [guard])
        require(b.icmp_unsigned("==", included, self.field(b, d, "tls_included")))
        require(b.icmp_unsigned("==", excluded, self.field(b, d, "tls_excluded")))

    def _tensor_object(self, b: ll.IRBuilder, args: ll.Value, t: Callable) -> ll.Value:
        """The tensor of record `t`: its argument, or the parameter object it holds."""
        obj = self._alloca(b, PTR)
        b.store(t("obj", PTR), obj)
        pos = t("pos")
        with b.if_then(b.icmp_signed(">=", pos, I64(0))):
            b.store(b.load(self.item(b, args, pos), typ=PTR), obj)
        return b.load(obj, typ=PTR)

    def _check_layout(
        self, b: ll.IRBuilder, d: ll.Value, args: ll.Value, i: ll.Value, table: ll.Value, require: Callable
    ) -> None:
        """Tensor i's type, dispatch keys (so device, layout, and no lazy negation or functorch
        wrapper), dtype and sizes as compiled; a size that names a symbol binds it, or must
        equal the value bound."""
        t = self.record(b, d, "tensors", i, TENSOR_WORDS)
        obj = self._tensor_object(b, args, t)
        h = b.gep(obj, [I64(TENSOR_OFFSET)], source_etype=I8)  # the at::Tensor: its first word is the impl
        with b.if_then(b.icmp_signed("!=", t("layout"), I64(0))):
            require(b.icmp_unsigned("==", b.load(b.gep(obj, [I64(8)], source_etype=I8), typ=PTR), t("type", PTR)))
            keys = b.load(b.gep(b.load(h, typ=PTR), [I64(KEYSET_OFFSET)], source_etype=I8), typ=I64)
            require(b.icmp_unsigned("==", keys, t("keys")))
            out = self._alloca(b, I64)
            b.store(I64(0), out)  # the getter writes an int32 into it
            b.call(self.mb.declare("aoti_torch_get_dtype", I32, [PTR, PTR]), [h, out])
            require(b.icmp_signed("==", b.load(out, typ=I64), t("dtype")))
            b.call(self.mb.declare("aoti_torch_get_dim", I32, [PTR, PTR]), [h, out])
            ndim = t("ndim")
            require(b.icmp_signed("==", b.load(out, typ=I64), ndim))
            b.call(self.mb.declare("aoti_torch_get_sizes", I32, [PTR, PTR]), [h, out])
            have, want = b.load(out, typ=PTR), t("sizes", PTR)
            with counted_loop(b, I64(0), ndim) as k:
                size, word = self.word(b, have, k), self.word(b, want, k)
                with b.if_else(b.icmp_signed("<", word, I64(0))) as (symbolic, fixed):
                    with symbolic:
                        self._bind(b, self.item(b, table, b.sub(I64(-1), word)), size, require)
                    with fixed:
                        require(b.icmp_signed("==", size, word))

    def _check_tensor(
        self,
        b: ll.IRBuilder,
        d: ll.Value,
        args: ll.Value,
        i: ll.Value,
        table: ll.Value,
        grad_mode: ll.Value,
        require: Callable,
    ) -> None:
        """Tensor i's strides as compiled, and memory behind it (its data pointer goes into the
        table); and, in grad mode, it does not require grad (autograd needs eager)."""
        t = self.record(b, d, "tensors", i, TENSOR_WORDS)
        obj = self._tensor_object(b, args, t)
        h = b.gep(obj, [I64(TENSOR_OFFSET)], source_etype=I8)
        with b.if_then(b.icmp_signed("!=", t("layout"), I64(0))):
            out = self._alloca(b, I64)
            b.call(self.mb.declare("aoti_torch_get_strides", I32, [PTR, PTR]), [h, out])
            have, want = b.load(out, typ=PTR), t("strides", PTR)
            with counted_loop(b, I64(0), t("ndim")) as k:
                require(b.icmp_signed("==", self.word(b, have, k), self.resolve(b, table, self.word(b, want, k))))
            slot = t("slot")
            into = b.select(b.icmp_signed(">=", slot, I64(0)), self.item(b, table, slot), out)
            b.call(self.data_ptr, [h, into])
            empty = b.icmp_signed("==", t("nonempty"), I64(0))
            require(b.or_(empty, b.icmp_unsigned("!=", b.load(into, typ=PTR), NULL)))
        with b.if_then(grad_mode):
            impl = b.load(h, typ=PTR)
            require(b.icmp_unsigned("==", b.call(self.mb.declare(REQUIRES_GRAD, I8, [PTR]), [impl]), I8(0)))

    # --- braze_body and braze_run ----------------------------------------------------------
    def _python_body(self, b: ll.IRBuilder, d: ll.Value, args: ll.Value, nargs: ll.Value) -> None:
        """A program with ATen calls: return what its generated Python body returns."""
        py_body = self.field(b, d, "py_body", PTR)
        with b.if_then(b.icmp_unsigned("!=", py_body, NULL)):
            b.ret(b.call(self.vectorcall, [py_body, args, nargs, NULL]))

    def _body(self, run: ll.Function) -> None:
        fn = ll.Function(self.mb.module, ll.FunctionType(PTR, [PTR, PTR, I64]), "braze_body")
        d, args, nargs = fn.args
        b = ll.IRBuilder(fn.append_basic_block("entry"))
        self._python_body(b, d, args, nargs)
        table = b.alloca(PTR, size=self.field(b, d, "n_slots"))
        with counted_loop(b, I64(0), self.field(b, d, "n_tensors")) as k:
            t = self.record(b, d, "tensors", k, TENSOR_WORDS)
            handle = b.gep(self._tensor_object(b, args, t), [I64(TENSOR_OFFSET)], source_etype=I8)
            with b.if_then(b.icmp_signed(">=", t("slot"), I64(0))):
                b.call(self.data_ptr, [handle, self.item(b, table, t("slot"))])
            with b.if_then(b.icmp_signed("!=", t("layout"), I64(0))):  # bind the symbols, unchecked
                sizes = self._alloca(b, PTR)
                b.call(self.mb.declare("aoti_torch_get_sizes", I32, [PTR, PTR]), [handle, sizes])
                have, want = b.load(sizes, typ=PTR), t("sizes", PTR)
                with counted_loop(b, I64(0), t("ndim")) as i:
                    word = self.word(b, want, i)
                    with b.if_then(b.icmp_signed("<", word, I64(0))):
                        self._bind(b, self.item(b, table, b.sub(I64(-1), word)), self.word(b, have, i), None)
        with counted_loop(b, I64(0), self.field(b, d, "n_int_symbols")) as i:
            self._bind_int(b, d, args, i, table, None)
        self._dims(b, d, table)
        b.ret(b.call(run, [d, table, args, nargs]))

    def _run(self) -> ll.Function:
        """braze_run(descriptor, table, args, nargs): the table holds the arguments' and
        parameters' data pointers (and a generic program's sizes); allocate the outputs, point
        at the scratch buffers, run the kernels, return the outputs (where an ATen call of the
        run failed: what the descriptor's `retry` returns for the arguments)."""
        fn = ll.Function(self.mb.module, ll.FunctionType(PTR, [PTR, PTR, PTR, I64]), "braze_run")
        fn.linkage = "internal"
        d, table, args, nargs = fn.args
        b = ll.IRBuilder(fn.append_basic_block("entry"))
        f = lambda name, ty=I64: self.field(b, d, name, ty)  # noqa: E731
        memo = self._memo(b, d, table, args, nargs)
        n_out = f("n_outputs")
        handles = b.alloca(PTR, size=n_out)
        oom = fn.append_basic_block("oom")
        with counted_loop(b, I64(0), n_out) as k:
            b.store(NULL, self.item(b, handles, k))
        with counted_loop(b, I64(0), n_out) as k:
            self._allocate(b, d, k, self.item(b, handles, k), table, oom)
        busy = b.gep(d, [I64(W["busy"])], source_etype=I64)
        took = b.extract_value(b.cmpxchg(busy, I64(0), I64(1), "acquire", "monotonic"), 1)
        fresh = self._scratch(b, d, table, took, busy, oom)
        release_gil = b.icmp_signed("!=", f("release_gil"), I64(0))
        state = self._alloca(b, PTR)
        b.store(NULL, state)
        with b.if_then(release_gil):
            b.store(b.call(self.mb.declare("PyEval_SaveThread", PTR, []), []), state)
        run = f("run", PTR)
        error_slot = f("error_slot")
        checked = b.icmp_signed(">=", error_slot, I64(0))
        with b.if_then(checked):
            b.store(NULL, self.item(b, table, error_slot))
        failed_slot = f("failed_slot")
        calls = b.icmp_signed(">=", failed_slot, I64(0))
        with b.if_then(calls):
            b.store(NULL, self.item(b, table, failed_slot))
        with b.if_then(b.icmp_unsigned("!=", run, NULL)):
            b.call(_Callee(run, ll.FunctionType(VOID, [PTR])), [table])
        with b.if_then(release_gil):
            b.call(self.mb.declare("PyEval_RestoreThread", VOID, [PTR]), [b.load(state, typ=PTR)])
        b.call(self.decref, [memo])
        with b.if_else(took) as (kept, other):
            with kept:
                b.atomic_rmw("xchg", busy, I64(0), "release")
            with other:
                b.call(self.mb.declare("free", VOID, [PTR]), [fresh])
        with b.if_then(calls):
            failed = b.load(self.item(b, table, failed_slot), typ=PTR)
            with b.if_then(b.icmp_unsigned("!=", failed, NULL)):
                self._free_outputs(b, d, handles)
                self._retry(b, d, args, nargs)
        bad_index = fn.append_basic_block("bad_index")
        done = fn.append_basic_block("done")
        flagged = self._alloca(b, ll.IntType(1))
        b.store(ll.IntType(1)(0), flagged)
        with b.if_then(checked):
            b.store(b.icmp_unsigned("!=", b.load(self.item(b, table, error_slot), typ=PTR), NULL), flagged)
        b.cbranch(b.load(flagged, typ=ll.IntType(1)), bad_index, done)
        b.position_at_end(done)
        self._results(b, d, handles)
        self._fail(b, fn, bad_index, handles, "index_error", INDEX_ERROR)
        self._fail(b, fn, oom, handles, "oom", "braze: out of memory for a compiled program's buffers")
        return fn

    def _fail(self, b: ll.IRBuilder, fn: ll.Function, block: ll.Block, handles: ll.Value, kind: str, text: str) -> None:
        """At `block`: free the outputs allocated so far (NULL handles are deleted as no-ops),
        raise the exception type in descriptor field `kind` with `text`, return NULL."""
        b.position_at_end(block)
        d = fn.args[0]
        self._free_outputs(b, d, handles)
        text_ptr = self.mb.cstring(f"braze_{kind}", text)
        b.call(self.mb.declare("PyErr_SetString", VOID, [PTR, PTR]), [self.field(b, d, kind, PTR), text_ptr])
        b.ret(NULL)

    def _memo(self, b: ll.IRBuilder, d: ll.Value, table: ll.Value, args: ll.Value, nargs: ll.Value) -> ll.Value:
        """A native body's memoized ATen results (runtime.Program._memo_function): their data
        pointers into the table; the tuple holding them is returned (a new reference, NULL if
        none), to be released after the run. Where the function raised, return NULL; where it
        returned other than one result per slot, the call runs in Python (`retry`)."""
        memo = self.field(b, d, "memo", PTR)
        held = self._alloca(b, PTR)
        b.store(NULL, held)
        with b.if_then(b.icmp_unsigned("!=", memo, NULL)):
            results = b.call(self.vectorcall, [memo, args, nargs, NULL])
            with b.if_then(b.icmp_unsigned("==", results, NULL)):
                b.ret(NULL)
            n = self.field(b, d, "n_memo")
            with b.if_then(b.icmp_signed("!=", b.call(self.mb.declare("PyTuple_Size", I64, [PTR]), [results]), n)):
                b.call(self.decref, [results])
                self._retry(b, d, args, nargs)
            b.store(results, held)
            item = self.mb.declare("PyTuple_GetItem", PTR, [PTR, I64])
            with counted_loop(b, I64(0), n) as k:
                tensor = b.gep(b.call(item, [results, k]), [I64(TENSOR_OFFSET)], source_etype=I8)
                slot = self.word(b, self.field(b, d, "memo_slots", PTR), k)
                b.call(self.data_ptr, [tensor, self.item(b, table, slot)])
        return b.load(held, typ=PTR)

    def _retry(self, b: ll.IRBuilder, d: ll.Value, args: ll.Value, nargs: ll.Value) -> None:
        """Return what the descriptor's `retry` (the program's Python body) gives for the call."""
        b.ret(b.call(self.vectorcall, [self.field(b, d, "retry", PTR), args, nargs, NULL]))

    def _free_outputs(self, b: ll.IRBuilder, d: ll.Value, handles: ll.Value) -> None:
        """Free the outputs allocated so far (NULL handles are deleted as no-ops)."""
        with counted_loop(b, I64(0), self.field(b, d, "n_outputs")) as k:
            b.call(self.delete, [b.load(self.item(b, handles, k), typ=PTR)])

    def _allocate(
        self, b: ll.IRBuilder, d: ll.Value, k: ll.Value, handle: ll.Value, table: ll.Value, oom: ll.Block
    ) -> None:
        """Output k: a fresh tensor of its layout, from ATen's allocator."""
        o = self.record(b, d, "outputs", k, OUTPUT_WORDS)
        layout = {}
        for name in ("sizes", "strides"):
            words = o(name, PTR)
            with b.goto_entry_block():
                layout[name] = b.alloca(I64, size=I64(MAX_DIMS))
            with counted_loop(b, I64(0), o("ndim")) as i:
                b.store(self.resolve(b, table, self.word(b, words, i)), b.gep(layout[name], [i], source_etype=I64))
        empty = self.mb.declare("aoti_torch_empty_strided", I32, [I64, PTR, PTR, I32, I32, I32, PTR])
        cpu = I32(shim_constant("device_type_cpu"))
        dtype = b.trunc(o("dtype"), I32)
        err = b.call(empty, [o("ndim"), layout["sizes"], layout["strides"], dtype, cpu, I32(0), handle])
        ok = b.append_basic_block("allocated")
        b.cbranch(b.icmp_signed("==", err, I32(0)), ok, oom)
        b.position_at_end(ok)
        b.call(self.data_ptr, [b.load(handle, typ=PTR), self.item(b, table, o("slot"))])

    def _scratch(
        self, b: ll.IRBuilder, d: ll.Value, table: ll.Value, took: ll.Value, busy: ll.Value, oom: ll.Block
    ) -> ll.Value:
        """Point the table's scratch slots into the program's kept allocation (grown when this
        call needs more: a generic program's buffers follow its sizes) or, while another thread
        runs this program, into one fresh allocation, which is returned (else NULL)."""
        total = self._alloca(b, I64)
        b.store(I64(0), total)
        with counted_loop(b, I64(0), self.field(b, d, "n_scratch")) as k:
            s = self.record(b, d, "scratch", k, SCRATCH_WORDS)
            b.store(b.add(b.load(total, typ=I64), _aligned(b, self.resolve(b, table, s("bytes")))), total)
        need = b.load(total, typ=I64)
        kept = b.gep(d, [I64(W["kept"])], source_etype=I64)
        capacity = b.gep(d, [I64(W["capacity"])], source_etype=I64)
        alloc = self.mb.declare("aligned_alloc", PTR, [I64, I64])
        grow = b.and_(took, b.icmp_signed(">", need, b.load(capacity, typ=I64)))
        with b.if_then(grow):  # this thread holds the program: nobody else uses the memory
            b.call(self.mb.declare("free", VOID, [PTR]), [b.load(kept, typ=PTR)])
            b.store(I64(0), capacity)
            mem = self._kept_scratch(b, d, need)
            b.store(mem, kept)
            grown = b.append_basic_block("scratch_grown")
            failed = b.append_basic_block("scratch_failed")
            b.cbranch(b.icmp_unsigned("!=", mem, NULL), grown, failed)
            b.position_at_end(failed)
            b.atomic_rmw("xchg", busy, I64(0), "release")
            b.branch(oom)
            b.position_at_end(grown)
            b.store(need, capacity)
        fresh = self._alloca(b, PTR)
        b.store(NULL, fresh)
        with b.if_then(b.and_(b.not_(took), b.icmp_signed(">", need, I64(0)))):
            mem = b.call(alloc, [I64(64), need])
            ok = b.append_basic_block("scratch_allocated")
            b.cbranch(b.icmp_unsigned("!=", mem, NULL), ok, oom)
            b.position_at_end(ok)
            b.store(mem, fresh)
        base = b.select(took, b.load(kept, typ=PTR), b.load(fresh, typ=PTR))
        offset = self._alloca(b, I64)
        b.store(I64(0), offset)
        with counted_loop(b, I64(0), self.field(b, d, "n_scratch")) as k:
            s = self.record(b, d, "scratch", k, SCRATCH_WORDS)
            at = b.load(offset, typ=I64)
            b.store(b.gep(base, [at], source_etype=I8), self.item(b, table, s("slot")))
            b.store(b.add(at, _aligned(b, self.resolve(b, table, s("bytes")))), offset)
        return b.load(fresh, typ=PTR)

    def _kept_scratch(self, b: ll.IRBuilder, d: ll.Value, need: ll.Value) -> ll.Value:
        """A program's kept scratch memory of `need` bytes: on 2 MB pages from the descriptor's
        `huge` bytes up (a whole number of them, and madvise asks the kernel for huge pages;
        fewer TLB misses on the activations the kernels stream through), else 64-byte aligned."""
        huge = self.field(b, d, "huge")
        big = b.and_(b.icmp_signed(">", huge, I64(0)), b.icmp_signed(">=", need, huge))
        size = b.select(big, b.and_(b.add(need, I64(HUGE_PAGE - 1)), I64(-HUGE_PAGE)), need)
        alloc = self.mb.declare("aligned_alloc", PTR, [I64, I64])
        mem = b.call(alloc, [b.select(big, I64(HUGE_PAGE), I64(64)), size])
        with b.if_then(b.and_(big, b.icmp_unsigned("!=", mem, NULL))):  # (advice: its failure is harmless)
            b.call(self.mb.declare("madvise", I32, [PTR, I64, I32]), [mem, size, I32(MADV_HUGEPAGE)])
        return mem

    def _results(self, b: ll.IRBuilder, d: ll.Value, handles: ll.Value) -> None:
        """Wrap each output as a Python tensor; return it, or a tuple of them."""
        wrap = self.mb.declare(WRAP, PTR, [PTR])
        n = self.field(b, d, "n_outputs")

        def wrapped(k: ll.Value | int) -> ll.Value:
            h = b.load(self.item(b, handles, k), typ=PTR)
            obj = b.call(wrap, [h])
            b.call(self.delete, [h])  # moved from by the wrap: frees only the handle
            return obj

        with b.if_then(b.icmp_signed("==", self.field(b, d, "tuple_output"), I64(0))):
            b.ret(wrapped(0))
        tup = b.call(self.mb.declare("PyTuple_New", PTR, [I64]), [n])
        with counted_loop(b, I64(0), n) as k:
            b.call(self.mb.declare("PyTuple_SetItem", I32, [PTR, I64, PTR]), [tup, k, wrapped(k)])
        b.ret(tup)

    # --- helpers -----------------------------------------------------------------------------
    @staticmethod
    def _alloca(b: ll.IRBuilder, ty: ll.Type) -> ll.Value:
        with b.goto_entry_block():
            return b.alloca(ty)
