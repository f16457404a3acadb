"""Stage 6, machine code: optimise an LLVM module for the host CPU, load it, and make its entry
points callable from Python.

One MCJIT engine per process (per instruction-selection level); modules are added to it. The
symbols generated code calls are bound to the exact functions the process already loaded:
MKL's `sgemm_` inside libtorch_cpu (the routine eager's addmm calls) and its thread count, the
libgomp that ATen's parallel_for uses, CPython's C API, and ATen's C shim (the AOTInductor
`aoti_torch_*` functions) for tensor data pointers, layouts and allocation, MKL's vector math and
Sleef's functions that ATen's kernels call. Also here: native libraries built once per process
(`library`: rows.py, sleef.py), and the probes that decide whether a small GEMM may run on one
thread (one_thread_same) and whether ATen's unary ops give VML's bits (vml_same).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import os
import struct
import sys
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import llvmlite.binding as llvm
import llvmlite.ir as ll
import torch

from . import config, kernelcache

_lock = threading.Lock()
_state: list[tuple[llvm.ExecutionEngine, llvm.TargetMachine]] = []  # the JIT, once made

# A Python tensor object is PyObject_HEAD followed by its at::Tensor (torch/csrc/autograd/
# python_variable.h), so object address + 16 is an AtenTensorHandle, and the word there is the
# c10::TensorImpl*. The impl keeps its dispatch key set (c10::DispatchKeySet, one 64-bit word) at
# KEYSET_OFFSET. Both are checked at start-up.
TENSOR_OFFSET = 16
KEYSET_OFFSET = 168
# CPython 3.11's dict: its version tag (PEP 509), bumped by every change of a value, at this offset
DICT_VERSION_OFFSET = 24 if sys.version_info[:2] == (3, 11) else -1
# The C++ functions braze calls, by their mangled names:
WRAP = "_Z16THPVariable_WrapON2at10TensorBaseE"  # THPVariable_Wrap(at::TensorBase&&): a Python tensor
REQUIRES_GRAD = "_ZNK3c1010TensorImpl13requires_gradEv"  # TensorImpl::requires_grad() const
FN_MODE = "_ZN2at4impl27torch_function_mode_enabledEv"  # a TorchFunctionMode is active
DEFAULT_DTYPE = "_ZN3c1031get_default_dtype_as_scalartypeEv"  # torch.get_default_dtype(), a ScalarType
# ExcludeDispatchKeyGuard(DispatchKeySet) and its destructor. Constructed with the empty set it
# changes nothing, and its first member then points at this thread's dispatch state
# (c10::impl::PODLocalDispatchKeySet: the included and the excluded keys, one word each).
TLS_GUARD = "_ZN3c104impl23ExcludeDispatchKeyGuardC1ENS_14DispatchKeySetE"
TLS_GUARD_END = "_ZN3c104impl23ExcludeDispatchKeyGuardD1Ev"
# at::globalContext() and at::Context::float32Precision(Float32Backend, Float32Op) const: the
# float32 precision ATen's CPU matmuls consult (backend MKLDNN, op MATMUL), resolved as ATen
# resolves it; NONE (nothing set) or IEEE is full precision: sgemm_, not oneDNN's bf16/tf32 GEMM.
GLOBAL_CONTEXT = "_ZN2at13globalContextEv"
FP32_PRECISION = "_ZNK2at7Context16float32PrecisionENS_14Float32BackendENS_9Float32OpE"
MKLDNN, MATMUL = 2, 3
# at::Context::userEnabledMkldnn() const: torch.backends.mkldnn.enabled, which ATen's gelu consults
MKLDNN_ENABLED = "_ZNK2at7Context17userEnabledMkldnnEv"
# at::Context::userEnabledFlashSDP() const: torch.backends.cuda.flash_sdp_enabled() (the sdpa_kernel
# context sets it), which decides whether ATen's CPU attention is its flash kernel or the math one
FLASH_ENABLED = "_ZNK2at7Context19userEnabledFlashSDPEv"
FULL_PRECISION = (0, 1)
# MKL's thread count for its calls from this thread (torch.set_num_threads sets it per thread), and
# the per-thread override a one-thread GEMM sets around its sgemm_ (it returns the one it replaced).
MKL_THREADS = "MKL_Get_Max_Threads"
MKL_SET_THREADS = "MKL_Set_Num_Threads_Local"
# MKL's vector math functions ATen's float32 unary ops call here (torch op -> VML function), and
# the mode it passes: high accuracy, denormals kept, no error handling.
VML_FUNCTIONS = {
    name: f"vms{vml}"
    for name, vml in {
        "exp": "Exp", "tanh": "Tanh", "erf": "Erf", "erfc": "Erfc", "erfinv": "ErfInv", "log": "Ln", "log2": "Log2",
        "log10": "Log10", "sin": "Sin", "cos": "Cos", "tan": "Tan", "asin": "Asin", "acos": "Acos", "atan": "Atan",
        "sqrt": "Sqrt", "trunc": "Trunc",
    }.items()
}  # fmt: skip
VML_MODE = 0x2 | 0x140000 | 0x100
# Sleef's functions inside libtorch_cpu that ATen's vectorised kernels call (sleef.py).
SLEEF_FUNCTIONS = ("Sleef_expf16_u10", "Sleef_logf16_u10", "Sleef_tanhf16_u10")

_C_API = (
    "PyObject_Vectorcall",
    "PyObject_GetAttr",
    "_PyObject_GetDictPtr",
    "PyDict_GetItemWithError",
    "PyObject_RichCompareBool",
    "PyTuple_New",
    "PyTuple_SetItem",
    "PyErr_Clear",
    "PyErr_SetString",
    "Py_IncRef",
    "Py_DecRef",
    "PyEval_SaveThread",
    "PyEval_RestoreThread",
)
_SHIM = (
    "aoti_torch_get_data_ptr",
    "aoti_torch_get_dtype",
    "aoti_torch_get_device_type",
    "aoti_torch_get_layout",
    "aoti_torch_get_dim",
    "aoti_torch_get_sizes",
    "aoti_torch_get_strides",
    "aoti_torch_empty_strided",
    "aoti_torch__reinterpret_tensor",  # an ATen result a native body returns, viewed
    "aoti_torch_delete_tensor_object",
    "aoti_torch_grad_mode_is_enabled",
    "aoti_torch_create_tensor_from_blob",  # codegen/calls.py: ATen calls from native code
    "aoti_torch_call_dispatcher",
    "torch_new_stable_ivalue",
    "torch_new_list_reserve_size",
    "torch_list_push_back",
    "torch_new_string_handle",
    "aoti_torch_scalar_to_tensor_bool",  # (a number where an op takes a tensor)
    "aoti_torch_scalar_to_tensor_int64",
    "aoti_torch_scalar_to_tensor_float64",
    "aoti_torch_cpu_baddbmm_out",  # (codegen/calls.py: SHIMS)
)


@functools.cache
def _torch_lib(name: str) -> ctypes.CDLL:
    return ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", name))


def _address(lib: Any, name: str) -> int:
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value


def _bind_symbols() -> None:
    cpu, libc = _torch_lib("libtorch_cpu.so"), ctypes.CDLL(None)
    for name in (
        "sgemm_",
        "cblas_sgemm_batch",
        MKL_THREADS,
        MKL_SET_THREADS,
        *VML_FUNCTIONS.values(),
        *SLEEF_FUNCTIONS,
    ):
        llvm.add_symbol(name, _address(cpu, name))
    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    for name in ("expf", "tanhf", "erff", "exp"):  # ATen's scalar tails call them
        llvm.add_symbol(name, _address(libm, name))
    gomp = _torch_lib("libgomp.so.1")
    for name in ("GOMP_parallel", "omp_get_thread_num", "omp_get_num_threads", "omp_get_max_threads"):
        llvm.add_symbol(name, _address(gomp, name))
    for name in _C_API:
        llvm.add_symbol(name, _address(ctypes.pythonapi, name))
    for name in _SHIM:
        llvm.add_symbol(name, _address(cpu, name))
    llvm.add_symbol(WRAP, _address(_torch_lib("libtorch_python.so"), WRAP))
    for name in (FN_MODE, GLOBAL_CONTEXT, FP32_PRECISION, MKLDNN_ENABLED, FLASH_ENABLED):
        llvm.add_symbol(name, _address(cpu, name))
    for name in (REQUIRES_GRAD, DEFAULT_DTYPE, TLS_GUARD, TLS_GUARD_END):
        llvm.add_symbol(name, _address(_torch_lib("libc10.so"), name))
    for name in ("aligned_alloc", "free", "madvise"):
        llvm.add_symbol(name, _address(libc, name))
    _check_tensor_layout(cpu)


# A tensor's version (`t._version`, bumped by every in-place change through it): the impl holds a
# pointer to its c10::VersionCounter (torch::autograd::impl::version_counter(t) returns the
# member's address; NULL for an inference tensor), which holds the count as a uint32.
VERSION_COUNTER = "_ZN5torch8autograd4impl15version_counterERKN2at6TensorE"


@functools.cache
def version_offsets() -> tuple[int, int] | None:
    """(where the impl keeps its VersionCounter*, where the counter keeps the count) as native code
    reads `t._version`; None where a probe of tensors whose versions move does not confirm it."""
    get = getattr(_torch_lib("libtorch_cpu.so"), VERSION_COUNTER)
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
    probes = [torch.zeros(3), torch.nn.Parameter(torch.ones(2, 5)), torch.arange(4.0)[1:]]
    member = {get(id(t) + TENSOR_OFFSET) - _impl(t) for t in probes}
    if len(member) != 1 or not 0 < min(member) < 4096:
        return None
    at = member.pop()
    for count in range(8, 64, 4):  # past the counter's vtable and reference counts

        def read(t: torch.Tensor, count: int = count) -> int:
            return ctypes.c_uint32.from_address(ctypes.c_void_p.from_address(_impl(t) + at).value + count).value

        seen = []
        with torch.no_grad():
            for bumps in (0, 3, 1):
                for t in probes:
                    for _ in range(bumps):
                        t.add_(0)
                seen += [read(t) == t._version for t in probes]
        if all(seen):
            return at, count
    return None


def tensor_version(t: torch.Tensor) -> tuple[int, int] | None:
    """(the address of t's version counter, its count) as native code reads them; None for a
    tensor without a counter (an inference tensor) or where version_offsets found none."""
    offsets = version_offsets()
    if offsets is None:
        return None
    counter = ctypes.c_void_p.from_address(_impl(t) + offsets[0]).value
    return None if not counter else (counter, ctypes.c_uint32.from_address(counter + offsets[1]).value)


def dict_version(d: dict) -> int | None:
    """d's version tag (native code reads it at DICT_VERSION_OFFSET); None where this CPython has
    none, or it does not move as expected."""
    return _version_tag(d) if _dict_versions() else None


def _version_tag(d: dict) -> int:
    return ctypes.c_uint64.from_address(id(d) + DICT_VERSION_OFFSET).value


@functools.cache
def _dict_versions() -> bool:
    if DICT_VERSION_OFFSET < 0:
        return False
    d: dict = {"x": True}
    before = _version_tag(d)
    d["x"] = True  # the same value: no change
    same = _version_tag(d)
    d["x"] = False
    return before == same != _version_tag(d)


def _check_tensor_layout(cpu: ctypes.CDLL) -> None:
    """Native entries read tensors at TENSOR_OFFSET and KEYSET_OFFSET; refuse to run on a torch
    where that is wrong."""
    get = cpu.aoti_torch_get_data_ptr
    get.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]
    probe = torch.arange(6.0)[2:]
    ptr = ctypes.c_void_p()
    with torch.inference_mode():
        inference = torch.ones(2)
    probes = (probe, torch._neg_view(probe), inference)  # three different key sets
    if (
        get(id(probe) + TENSOR_OFFSET, ctypes.byref(ptr)) != 0
        or ptr.value != probe.data_ptr()
        or any(dispatch_keys(t) != torch._C._dispatch_keys(t).raw_repr() for t in probes)
    ):
        raise RuntimeError(f"braze: torch {torch.__version__} lays out tensor objects differently; braze needs 2.13")


def default_dtype() -> int:
    """torch.get_default_dtype() as native code reads it."""
    return ctypes.c_int8(getattr(_torch_lib("libc10.so"), DEFAULT_DTYPE)()).value


def matmul_precision() -> int:
    """The float32 precision of ATen's CPU matmuls now, as native code reads it (see FULL_PRECISION)."""
    context, precision = _precision_fns()
    return precision(context(), MKLDNN, MATMUL)


@functools.cache
def _precision_fns() -> tuple[Any, Any]:
    cpu = _torch_lib("libtorch_cpu.so")
    context = ctypes.CFUNCTYPE(ctypes.c_void_p)(_address(cpu, GLOBAL_CONTEXT))
    precision = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int)(
        _address(cpu, FP32_PRECISION)
    )
    return context, precision


def mkl_threads() -> int:
    """The number of threads MKL's sgemm_ runs on when this thread calls it, as native code reads it."""
    return _torch_lib("libtorch_cpu.so").MKL_Get_Max_Threads()


def one_thread_same(blas: dict[str, Any], beta: float) -> bool:
    """Whether sgemm_ with these arguments (lowering.gemm.blas_args) gives the same bits on one thread
    as on mkl_threads().

    MKL splits a GEMM between threads in ways that can change its order of operations: 7x64x64
    differs in 37% of its outputs between one and two threads here, 32x64x64 in none. Probed on
    random data (an order that differs shows in a large share of the outputs), twice: with every
    matrix 64-byte aligned and with each one float off. Cached per arguments and thread count.
    """
    return one_thread_same_sizes([blas], beta)[0]


def one_thread_same_sizes(calls: list[dict[str, Any]], beta: float) -> list[bool]:
    """one_thread_same for many argument lists (a generic GEMM's, one per size) on shared
    random operands: ~80 us a size. Cached per arguments and thread count."""
    threads, cpu = mkl_threads(), _torch_lib("libtorch_cpu.so")
    args = [tuple(blas[a] for a in ("ta", "tb", "m", "n", "k", "lda", "ldb", "ldc")) for blas in calls]
    spans = [(lda * (m if ta else k), ldb * (k if tb else n), ldc * n) for ta, tb, m, n, k, lda, ldb, ldc in args]
    gen = torch.Generator().manual_seed(0)  # the user's random stream stays untouched
    same = [True] * len(args)
    for skew in (0, 1):
        longest = (max(s) + skew for s in zip(*spans, (0, 0, 0)))
        a, b, c = (torch.randn(n, generator=gen, dtype=torch.float32)[skew:] for n in longest)
        for i, (call, (_, _, nc)) in enumerate(zip(args, spans)):
            if not same[i] or (call, beta, threads) in _PROBED:
                continue
            threaded, alone = c[:nc].clone(), c[:nc].clone()
            _sgemm(call, a, b, beta, threaded)
            before = cpu.MKL_Set_Num_Threads_Local(1)
            try:
                _sgemm(call, a, b, beta, alone)
            finally:
                cpu.MKL_Set_Num_Threads_Local(before)
            same[i] = torch.equal(threaded.view(torch.int32), alone.view(torch.int32))
    return [_PROBED.setdefault((call, beta, threads), ok) for call, ok in zip(args, same)]


_PROBED: dict[tuple, bool] = {}  # (sgemm_ arguments, beta, threads) -> the probe's answer


def _sgemm(call: tuple, a: torch.Tensor, b: torch.Tensor, beta: float, c: torch.Tensor) -> None:
    """sgemm_ through ctypes (column-major, alpha 1) on tensors' memory; call = (ta, tb, m, n, k,
    lda, ldb, ldc)."""
    ta, tb, m, n, k, lda, ldb, ldc = call
    i32 = lambda v: ctypes.byref(ctypes.c_int32(v))  # noqa: E731
    f32 = lambda v: ctypes.byref(ctypes.c_float(v))  # noqa: E731
    flag = lambda t: ctypes.byref(ctypes.c_char(b"T" if t else b"N"))  # noqa: E731
    ptr = lambda t: ctypes.c_void_p(t.data_ptr())  # noqa: E731
    sizes = (i32(m), i32(n), i32(k))
    operands = (ptr(a), i32(lda), ptr(b), i32(ldb), f32(beta), ptr(c), i32(ldc))
    _torch_lib("libtorch_cpu.so").sgemm_(flag(ta), flag(tb), *sizes, f32(1.0), *operands)


# Where MKL's generic vmsTanh kernel (mkl_vml_kernel_sTanh_EXHAynn) keeps its polynomials in the
# libtorch_cpu.so of torch 2.13.0+cpu (known by its GNU build id): 27 rows of 8 doubles, the
# coefficients of degree 0 to 7, at this file offset (vstanh_data + 0x540; the first loadable
# segment maps file offsets to the same addresses). braze reads them from the wheel at run time.
_MKL_TANH_BUILD = "b7066ed94f422786bd205cd2743c2722b5f366fd"
_MKL_TANH_TABLE = 0x12A3B600


@functools.cache
def mkl_tanh_table() -> list[float] | None:
    """MKL's tanh coefficients (27 x 8 doubles, row-major) from this wheel's libtorch_cpu.so, or
    None where the library is not the build whose layout braze knows."""
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        with open(path, "rb") as f:
            if _build_id(f) != _MKL_TANH_BUILD:
                return None
            f.seek(_MKL_TANH_TABLE)
            return list(struct.unpack("<216d", f.read(27 * 64)))
    except (OSError, struct.error):
        return None


def _build_id(f: Any) -> str | None:
    """The GNU build id of the 64-bit little-endian ELF file f, from its note segments."""
    head = f.read(64)
    if head[:6] != b"\x7fELF\x02\x01":
        return None
    phoff, phentsize, phnum = struct.unpack_from("<Q", head, 32)[0], *struct.unpack_from("<HH", head, 54)
    f.seek(phoff)
    table = f.read(phentsize * phnum)
    for i in range(phnum):
        kind, _, offset, _, _, size = struct.unpack_from("<IIQQQQ", table, i * phentsize)
        if kind != 4:  # PT_NOTE
            continue
        f.seek(offset)
        notes, at = f.read(size), 0
        while at + 12 <= len(notes):
            namesz, descsz, note = struct.unpack_from("<III", notes, at)
            name_end = at + 12 + (namesz + 3) // 4 * 4
            if note == 3 and notes[at + 12 : at + 12 + namesz] == b"GNU\0":  # NT_GNU_BUILD_ID
                return notes[name_end : name_end + descsz].hex()
            at = name_end + (descsz + 3) // 4 * 4
    return None


def vml_same(name: str) -> bool:
    """Whether ATen's float32 `name` (a key of VML_FUNCTIONS) gives here what its VML function
    gives with ATen's mode, on special values, subnormals, 77 decades of magnitudes, odd lengths,
    strided inputs, in place, past the 32k-element split between threads. Once per process and
    thread count (torch.get_num_threads())."""
    return _vml_same(name, torch.get_num_threads())


@functools.cache
def _vml_same(name: str, threads: int) -> bool:  # threads: in the cache key
    vml = getattr(_torch_lib("libtorch_cpu.so"), VML_FUNCTIONS[name])
    vml.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    aten = getattr(torch, name)
    gen = torch.Generator().manual_seed(0)
    special = [0.0, -0.0, 1.0, -1.0, 0.5, 1e-45, -1e-40, 88.7, -103.9, 9.0, 3.4e38, float("inf"), -float("inf")]
    decades = torch.logspace(-38, 38, 77, dtype=torch.float64).float().repeat_interleave(8)
    spread = (torch.rand(decades.numel(), generator=gen) - 0.5) * decades  # few: huge inputs are slow in VML
    x = torch.cat([torch.tensor(special + [float("nan")]), spread, torch.rand(32768, generator=gen) * 2 - 1])
    want = torch.empty_like(x)
    vml(x.numel(), x.data_ptr(), want.data_ptr(), VML_MODE)
    inplace = x.clone()
    vml(x.numel(), inplace.data_ptr(), inplace.data_ptr(), VML_MODE)
    pairs = ((aten(x), want), (aten(x[:33]), want[:33]), (aten(x[::2]), want[::2]), (inplace, want))
    return all(same_bits(a, b) for a, b in pairs)


def ieee_sqrt(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded square root of each float64 of x, by C's sqrt (math.sqrt), for the
    probes' references. ATen's float64 sqrt (MKL's vdSqrt) is not: it missed 230 of the rsqrt
    probe's 34k values here, and 233 in some processes of the test suite, where a reference built
    on it made the rsqrt and batch_norm probes fail now and then (a fresh clone's `make test`:
    20 failures)."""
    roots = [math.sqrt(v) if v >= 0 else math.nan for v in x.reshape(-1).tolist()]
    return torch.tensor(roots, dtype=torch.float64).view(x.shape)


def rsqrt_is_ieee() -> bool:
    """Whether ATen's float32 rsqrt is 1 / (the correctly rounded square root), as its AVX2 kernel
    computes it here (_mm256_sqrt_ps, then a division; std::sqrt in the scalar tail), on every
    kind of input (special values, subnormals, powers of two, 79 decades of magnitudes), in the
    vector body and the scalar tail of its loop, past the 32k-element split between threads.
    Once per process and thread count (torch.get_num_threads())."""
    return _rsqrt_is_ieee(torch.get_num_threads())


@functools.cache
def _rsqrt_is_ieee(threads: int) -> bool:  # threads: in the cache key
    gen = torch.Generator().manual_seed(0)
    special = torch.tensor(
        [0.0, -0.0, 1.0, 4.0, 2.0, 0.5, 1e-45, 1e-40, 1e-38, 3.4e38, -1.0, float("inf"), float("-inf"), float("nan")]
    )
    scales = torch.logspace(-40, 38, 79, dtype=torch.float64).float().repeat_interleave(421)
    x = torch.cat([special, torch.rand(scales.numel(), generator=gen) * scales, torch.rand(17, generator=gen)])
    want = 1 / ieee_sqrt(x.double()).float()  # a float64 square root of a float32, rounded: the IEEE float32 root
    pairs = ((torch.rsqrt(x), want), (torch.rsqrt(x[:33]), want[:33]))
    return all(same_bits(a, b, nan_payloads=False) for a, b in pairs)  # the reference's NaNs are positive


def batch_norm_same() -> bool:
    """Whether ATen's eval batch_norm computes, per channel, invstd = 1 / sqrt(var + eps) in IEEE
    float32, alpha = invstd * weight, beta = fma(-mean, alpha, bias), and per element
    fma(x, alpha, beta): what its AVX2 kernel does here, where GCC fused both (a build without FMA
    rounds each product; braze's lowering then keeps ATen's call). Checked on channels with zero,
    negative and tiny variances and on special values, for a contiguous input (the only layout
    braze lowers). Once per process. (The reference rounds x * alpha + beta from float64: a rare double rounding would
    only make the probe fail, and braze call ATen.)"""
    return _batch_norm_same()


@functools.cache
def _batch_norm_same() -> bool:
    gen = torch.Generator().manual_seed(0)
    c = 37
    mean, weight, bias = (torch.randn(c, generator=gen) * 3 for _ in range(3))
    var = torch.rand(c, generator=gen) * 4
    var[:3] = torch.tensor([0.0, -1.0, 1e-30])
    x = torch.randn(3, c, 5, 7, generator=gen) * torch.logspace(-3, 3, 3).view(3, 1, 1, 1)
    x.view(-1)[:5] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-40])
    eps = 1e-5
    invstd = (1 / (ieee_sqrt((var + eps).double()).float()).double()).float()  # IEEE float32 sqrt, division
    alpha = invstd * weight
    beta = (-mean.double() * alpha.double() + bias.double()).float()
    want = (x.double() * alpha.double().view(c, 1, 1) + beta.double().view(c, 1, 1)).float()
    got = torch.nn.functional.batch_norm(x, mean, var, weight, bias, False, 0.1, eps)
    return same_bits(got, want, nan_payloads=False)


def same_bits(a: torch.Tensor, b: torch.Tensor, nan_payloads: bool = True) -> bool:
    """float32 tensors equal bit for bit (with `nan_payloads` False: NaN where the other has NaN,
    whatever its sign and payload)."""
    if not nan_payloads:
        nan = a.isnan()
        if not torch.equal(nan, b.isnan()):
            return False
        a, b = a.masked_fill(nan, 0), b.masked_fill(nan, 0)
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def _impl(t: torch.Tensor) -> int:
    """The address of t's c10::TensorImpl, where native code finds it."""
    return ctypes.c_void_p.from_address(id(t) + TENSOR_OFFSET).value


def dispatch_keys(t: torch.Tensor) -> int:
    """The raw dispatch key set of `t`, read where native code reads it."""
    return ctypes.c_uint64.from_address(_impl(t) + KEYSET_OFFSET).value


def tls_dispatch_words() -> tuple[int, int]:
    """This thread's dispatch state, raw (included and excluded keys), as native code reads it."""
    c10 = _torch_lib("libc10.so")
    guard = (ctypes.c_uint64 * 2)()
    getattr(c10, TLS_GUARD)(ctypes.byref(guard), ctypes.c_uint64(0))
    state = (ctypes.c_uint64 * 2).from_address(guard[0])
    words = (state[0], state[1])
    getattr(c10, TLS_GUARD_END)(ctypes.byref(guard))
    return words


@functools.cache
def shim_constant(name: str) -> int:
    """A constant of ATen's C shim, e.g. shim_constant('dtype_float32')."""
    return getattr(_torch_lib("libtorch_cpu.so"), f"aoti_torch_{name}")()


_kernels: dict[str, int] = {}
# The passes of `kernel(light=True)`: folding what the builder wrote (instcombine) and merging
# blocks. Kernels whose loops are vector code already and run as fast so take it (the GEMM's
# blocks: 5 ms of passes where -O2's took 50, machine code in 47 ms rather than 50); the others
# lose 1.03-2.3x without -O2's hoisting (docs/limits.md, *Light passes*).
LIGHT = ("instruction_combine", "simplify_cfg")
_kernel_lock = threading.Lock()


def realigned(module: ll.Module) -> ll.Module:
    """The module with each function it defines aligning the stack to 64 bytes on entry. LLVM
    spills 512-bit vectors into 16-byte aligned slots otherwise: where a thread's stack puts
    a slot across two cache lines, reading back the spill just written stalls (sleef.py's SiLU,
    which spills around each Sleef call, ran 1.7-1.8x slower than ATen's on such a thread; in
    5 of 8 thread and stack placements measured; aligned, as fast as ATen's in all 8)."""
    for fn in module.functions:
        if not fn.is_declaration:
            fn.attributes.alignstack = 64
            fn.attributes.add("nounwind")  # (llvmlite prints alignstack only beside another attribute)
    return module


def kernel(name: str, write: Callable[[ll.Module], Any], exported: tuple[str, ...] = (), light: bool = False) -> int:
    """The address of kernel `name`, which write(module) defines: compiled alone (so a model
    compiles only the kernels it uses) once per process, when a probe or program first needs it
    (a lock: two threads' first calls must not load it twice), at -O2 (`light`: LIGHT's passes
    alone), and callable by name from modules compiled later (as are the `exported` functions it
    defines beside it)."""
    with _kernel_lock:
        if name not in _kernels:
            module = ll.Module(name)
            write(module)
            names = list(dict.fromkeys([name, *exported]))
            text = str(realigned(module))
            compiled = compile_module(text, names, opt_level=2, want_text=False, keep=True, light=light)
            define_symbols(compiled.addresses)
            _kernels[name] = compiled.addresses[name]
        return _kernels[name]


def define_symbols(addresses: dict[str, int]) -> None:
    """Make already-loaded functions callable by name from modules compiled later."""
    for name, address in addresses.items():
        llvm.add_symbol(name, address)


def _target_machine() -> llvm.TargetMachine:
    target = llvm.Target.from_default_triple()
    features = llvm.get_host_cpu_features().flatten()
    return target.create_target_machine(cpu=llvm.get_host_cpu_name(), features=features, opt=2)


def _engine() -> tuple[llvm.ExecutionEngine, llvm.TargetMachine]:
    """The JIT, selecting instructions at -O2 (per function: those marked optnone at -O0)."""
    if not _state:
        llvm.initialize_native_target()
        llvm.initialize_native_asmprinter()
        _bind_symbols()
        tm = _target_machine()
        engine = llvm.create_mcjit_compiler(llvm.parse_assembly(""), tm)
        engine.set_object_cache(_compiled_object, _kept_object)
        _state.append((engine, tm))
    return _state[0]


# The modules being loaded whose object code is kept on disk (kernelcache.py), by id: (their key,
# the object file found there or None). MCJIT asks for a module's object before compiling it.
_keeping: dict[int, tuple[str, bytes | None]] = {}


def _kept_object(module: llvm.ModuleRef) -> bytes | None:
    return _keeping.get(id(module), ("", None))[1]


def _compiled_object(module: llvm.ModuleRef, obj: bytes) -> None:
    name, found = _keeping.get(id(module), ("", None))
    if name and found is None:
        kernelcache.store(name, obj)


def target_machine() -> llvm.TargetMachine:
    return _engine()[1]


@dataclass
class Compiled:
    addresses: dict[str, int]  # of the functions and globals asked for
    llvm_ir: str
    optimized_ir: str
    asm: str
    timings: list[tuple[str, float]]


def compile_module(
    ir_text: str,
    names: list[str],
    opt_level: int,
    want_text: bool,
    only: Collection[str] | None = None,
    keep: bool = False,
    light: bool = False,
) -> Compiled:
    """Parse, verify, optimise and JIT-load `ir_text`; return the addresses of `names`. With
    `keep`, its object code is kept on disk (kernelcache.py), and taken from there when another
    process compiled it before (then not optimised again).

    opt_level 0 skips LLVM's optimiser: codegen already writes vector loops. Higher levels run
    the new pass manager's pipeline at that speed level (for programs with much loop work) on
    the functions named in `only` (all, if None). The functions not optimised are marked
    `optnone`: LLVM's passes skip them and select their instructions fast (FastISel), but the
    register allocator is the optimising one: the fast allocator of -O0 kept each loop's
    counter and pointers on the stack, a store and a load every step (with them in registers,
    one process each, interleaved: bert-tiny 1.05x, tv-efficientnet 1.04x, MobileNet-V3-small
    1.03x as fast; the lesson MLP's first call ~12.5 -> ~16.5 ms). `light`: LIGHT's passes in
    place of the level's pipeline (kernel).
    """
    with _lock:
        engine, tm = _engine()
        t0 = time.perf_counter()
        level = "light" if light else opt_level
        name = kernelcache.key(ir_text, level, tm) if keep and config.kernel_cache and not want_text else ""
        found = kernelcache.load(name) if name else None
        mod = llvm.parse_assembly(ir_text)
        mod.triple = tm.triple
        mod.data_layout = str(tm.target_data)
        mod.verify()
        t1 = time.perf_counter()
        if not opt_level or only is not None:
            optimised = set(only or ()) if opt_level else set()
            for fn in mod.functions:
                if not fn.is_declaration and fn.name not in optimised:
                    fn.add_function_attribute("noinline")  # (optnone requires it)
                    fn.add_function_attribute("optnone")
        if light and found is None:
            _light_passes(mod, tm)
        elif opt_level and found is None:
            pto = llvm.create_pipeline_tuning_options(speed_level=opt_level)
            # Unrolling and interleaving quadruple compile time for loops that are memory-bound.
            pto.loop_unrolling = False
            pto.loop_interleaving = False
            # The loop vectoriser turns strided loops into gathers and scatters: in timm's
            # MobileViT it took 3.0 of its 3.9 s of optimisation and machine code, and no model
            # ran faster for it (MobileViT, Swin, EfficientViT, ViT, ConvNeXt: within 1-4%).
            pto.loop_vectorization = False
            pb = llvm.create_pass_builder(tm, pto)
            pb.getModulePassManager().run(mod, pb)
        t2 = time.perf_counter()
        optimized = str(mod) if want_text else ""
        asm = tm.emit_assembly(mod) if want_text else ""
        defined = [fn.name for fn in mod.functions if not fn.is_declaration] if config.perf_map else []
        if name:
            _keeping[id(mod)] = (name, found)
        try:
            engine.add_module(mod)
            engine.finalize_object()
        finally:
            _keeping.pop(id(mod), None)
        addresses = {n: engine.get_function_address(n) or engine.get_global_value_address(n) for n in names}
        if defined:
            _write_perf_map({engine.get_function_address(n): n for n in defined})
        t3 = time.perf_counter()
    ms = lambda a, b: (b - a) * 1e3  # noqa: E731
    timings = [("llvm.parse", ms(t0, t1)), ("llvm.optimize", ms(t1, t2)), ("llvm.machine_code", ms(t2, t3))]
    return Compiled(addresses, ir_text if want_text else "", optimized, asm, timings)


def _light_passes(mod: llvm.ModuleRef, tm: llvm.TargetMachine) -> None:
    """LIGHT: what a kernel written as vector code needs of LLVM's optimiser."""
    pm = llvm.create_new_module_pass_manager()
    for name in LIGHT:
        getattr(pm, f"add_{name}_pass")()
    pm.run(mod, llvm.create_pass_builder(tm, llvm.create_pipeline_tuning_options(speed_level=2)))


_perf_symbols: dict[int, str] = {}  # every JIT function loaded so far, by address (perf_map)


def _write_perf_map(symbols: dict[int, str]) -> None:
    """Name the JIT's functions for Linux perf, which reads /tmp/perf-<pid>.map (MCJIT writes
    none). MCJIT gives no sizes: each function's is the distance to the next one with an address
    (at most 64 KiB), so it includes the padding after it, and a function MCJIT gives no address
    for is counted with the one before it."""
    _perf_symbols.update((a, n) for a, n in symbols.items() if a)
    starts = sorted(_perf_symbols)
    if not starts:
        return
    with open(f"/tmp/perf-{os.getpid()}.map", "w") as f:
        for a, b in zip(starts, [*starts[1:], starts[-1] + 4096]):
            f.write(f"{a:x} {min(b - a, 1 << 16):x} {_perf_symbols[a]}\n")


METH_FASTCALL, METH_KEYWORDS = 0x80, 0x02


class _MethodDef(ctypes.Structure):
    _fields_ = [("name", ctypes.c_void_p), ("meth", ctypes.c_void_p), ("flags", ctypes.c_int), ("doc", ctypes.c_char_p)]


_new_cfunction = ctypes.pythonapi.PyCFunction_NewEx
_new_cfunction.restype = ctypes.py_object
_new_cfunction.argtypes = [ctypes.c_void_p, ctypes.py_object, ctypes.c_void_p]
_raw_malloc = ctypes.pythonapi.PyMem_RawMalloc
_raw_malloc.restype = ctypes.c_void_p
_raw_malloc.argtypes = [ctypes.c_size_t]


def _kept(data: bytes) -> int:
    """The address of a copy of `data` in memory that is never freed. A builtin function's method
    definition must outlive the function: CPython reads it when freeing the function, which at
    exit can be after this module's objects are gone (a definition held by a ctypes object here
    was freed first, and the interpreter crashed at exit in about 1 run in 6)."""
    address = _raw_malloc(len(data))
    if not address:
        raise MemoryError
    ctypes.memmove(address, data, len(data))
    return address


def pyfunction(address: int, name: str, keywords: bool, owner: Any) -> Any:
    """A Python builtin function calling native `address` with CPython's vectorcall convention:
    (owner, args, nargs) or, with `keywords`, (owner, args, nargs, kwnames). The function keeps
    `owner` alive as its `self`; its definition, like the machine code it points at, lives until
    the process exits.
    """
    flags = METH_FASTCALL | (METH_KEYWORDS if keywords else 0)
    mdef = _MethodDef(_kept(name.encode() + b"\0"), address, flags, None)
    return _new_cfunction(_kept(bytes(mdef)), owner, None)
