"""ATen's Sleef-based float32 activations (sigmoid, silu, gelu with approximate="tanh", and gelu's
erf form where ATen runs its own kernel rather than oneDNN's), reproduced with ATen's loop:
built once per process into the JIT, probed against ATen before use, called by programs by name.

Why a loop of its own: these kernels give different bits in the vector body (Sleef's expf16_u10,
16 lanes, two vectors a step) and in the scalar tail (glibc's expf) of ATen's vectorized_loop,
and from 32768 elements each of ATen's threads has its own tail. So the kernel takes ATen's
structure too: the contiguous elements split into min(threads, ceil(n / grain)) equal chunks
(at::parallel_for; grain 32768, gelu's n / threads above 16384 elements), each run as
32-element vector steps, then element by element.

    braze_<fn>(x, y, n)    fn: sigmoid = 1 / (1 + exp(0 - x)), silu = x / (1 + exp(-x)),
                           gelu_tanh = (0.5 x) (1 + tanh(beta fma(x x x, kappa, x))),
                           gelu_erf = (x 0.5) (1 + erf(x alpha)), erf: Vectorized's (an
                           Abramowitz-Stegun polynomial over Sleef's exp), glibc's erff

The elements are one run of memory: a contiguous input, or a permutation of one (transposed,
channels-last), which ATen's TensorIterator walks the same way.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import llvmlite.ir as ll
import torch

from . import jit
from .codegen import (
    F32,
    I64,
    PTR,
    VOID,
    counted_loop,
    declared,
    float32,
    fma,
    per_width,
    split_between_threads,
    to_lanes,
)

LANES = 16  # the AVX512 build of ATen's kernels: Vectorized<float> has 16 lanes
STEP = 2 * LANES  # vectorized_loop handles two vectors a step
GRAIN = 32768  # at::internal::GRAIN_SIZE: TensorIterator splits between threads from here
V16 = ll.VectorType(F32, LANES)
# fn -> (the Sleef function of its vector body, the libm one of its scalar tail)
FUNCTIONS = {
    "sigmoid": ("Sleef_expf16_u10", "expf"),
    "silu": ("Sleef_expf16_u10", "expf"),
    "gelu_tanh": ("Sleef_tanhf16_u10", "tanhf"),
    "gelu_erf": ("Sleef_expf16_u10", "erff"),  # ATen's own kernel: where it does not call oneDNN
}
# ATen's gelu runs its loop on one thread up to this many elements, else in one chunk per thread
# (grain n / threads); the others split from GRAIN on, in chunks of at least GRAIN.
GELU_SERIAL = 16384
CAPABILITY = "AVX512"


def name(fn: str) -> str:
    return f"braze_{fn}"


def _formula(fn: str, b: ll.IRBuilder, x: ll.Value, f: ll.Function) -> ll.Value:
    """ATen's arithmetic: the same in the body (x a vector, f Sleef's) and the tail (glibc's)."""
    vector = isinstance(x.type, ll.VectorType)
    const = lambda v: ll.Constant(x.type, [v] * LANES if vector else v)  # noqa: E731
    one = const(1.0)
    if fn == "sigmoid":  # body: (0 - x); tail: -x. Both exp(..) + 1, then 1 / that
        e = b.call(f, [b.fsub(const(0.0), x) if vector else b.fneg(x)])
        return b.fdiv(one, b.fadd(e, one) if vector else b.fadd(one, e))
    if fn == "gelu_erf":  # (x * 0.5) * (1 + erf(x * alpha))
        v = b.fmul(x, const(float32(0.5**0.5)))
        erf = _erf(b, v, f, const) if vector else b.call(f, [v])
        return b.fmul(b.fmul(x, const(0.5)), b.fadd(one, erf))
    if fn == "gelu_tanh":  # (0.5 * x) * (1 + tanh(beta * fma(x * x * x, kappa, x))): GCC fused it
        inner = fma(b, b.fmul(b.fmul(x, x), x), const(float32(0.044715)), x)
        t = b.call(f, [b.fmul(const(float32(0.5 * 2**0.5 * 2 / torch.pi**0.5)), inner)])
        return b.fmul(b.fmul(const(0.5), x), b.fadd(one, t))
    e = b.call(f, [b.fneg(x)])
    return b.fdiv(x, b.fadd(one, e))


def element(b: ll.IRBuilder, x: ll.Value, fn: str) -> ll.Value:
    """fn of x (one float or a vector) per element, through per_width: on a vector the
    arithmetic of ATen's vector body (Sleef's 16 lanes; a narrower vector widened and narrowed
    again), on one float its scalar tail's (glibc's). Fast mode's activation (Op.SLEEF): a lane
    depends on no other, so loops fuse it anywhere, at eager's own error (not in ATen's loop, so
    not eager's bits at the tails)."""
    return per_width(b, x, f"braze_sleef_{fn}", lambda body, v: _element(body, v, fn))


def _element(b: ll.IRBuilder, x: ll.Value, fn: str) -> ll.Value:
    vector, tail = FUNCTIONS[fn]
    if not isinstance(x.type, ll.VectorType):
        return _formula(fn, b, x, declared(b.module, tail, F32, [F32]))
    y = _formula(fn, b, to_lanes(b, x, LANES), declared(b.module, vector, V16, [V16]))
    return to_lanes(b, y, x.type.count)


def _erf(b: ll.IRBuilder, v: ll.Value, exp: ll.Function, const: Callable[[float], ll.Value]) -> ll.Value:
    """Vectorized<float>::erf (AVX512): Abramowitz and Stegun 7.1.26 over Sleef's exp, in FMAs:
    t = 1 / fma(p, |v|, 1); r = Horner in t; sign(v) * fma(-exp(-(v * v)) * t, r, 1)."""
    i32 = ll.VectorType(ll.IntType(32), LANES)
    sign = b.and_(b.bitcast(v, i32), ll.Constant(i32, [-(2**31)] * LANES))
    flip = lambda u: b.bitcast(b.xor(b.bitcast(u, i32), ll.Constant(i32, [-(2**31)] * LANES)), V16)  # noqa: E731
    t = b.fdiv(const(1.0), fma(b, const(0.3275911), _abs(b, v), const(1.0)))
    r = const(1.061405429)
    for c in (-1.453152027, 1.421413741, -0.284496736, 0.254829592):
        r = fma(b, r, t, const(c))
    e = flip(b.call(exp, [flip(b.fmul(v, v))]))
    erf = fma(b, b.fmul(e, t), r, const(1.0))
    return b.bitcast(b.xor(b.bitcast(erf, i32), sign), V16)


def _abs(b: ll.IRBuilder, v: ll.Value) -> ll.Value:
    return b.call(declared(b.module, "llvm.fabs.v16f32", V16, [V16]), [v])


def _chunk(module: ll.Module, fn: str) -> ll.Function:
    """ATen's vectorized_loop over one contiguous chunk: (x, y, n)."""
    f = ll.Function(module, ll.FunctionType(VOID, [PTR, PTR, I64]), f"{name(fn)}_chunk")
    f.linkage = "internal"
    x, y, n = f.args
    b = ll.IRBuilder(f.append_basic_block("entry"))
    body, tail = FUNCTIONS[fn]
    sleef, libm = declared(module, body, V16, [V16]), declared(module, tail, F32, [F32])
    at = lambda p, i: b.gep(p, [i], source_etype=F32)  # noqa: E731
    body_end = b.mul(b.sdiv(n, I64(STEP)), I64(STEP))
    with counted_loop(b, I64(0), body_end, STEP) as i:
        for k in (0, LANES):
            j = b.add(i, I64(k))
            v = b.load(at(x, j), typ=V16, align=4)
            b.store(_formula(fn, b, v, sleef), at(y, j), align=4)
    with counted_loop(b, body_end, n) as i:
        b.store(_formula(fn, b, b.load(at(x, i), typ=F32), libm), at(y, i))
    b.ret_void()
    return f


def _entry(module: ll.Module, fn: str) -> None:
    """braze_<fn>(x, y, n): ATen's split between threads, then each chunk."""

    def grain(b: ll.IRBuilder, n: ll.Value, threads: ll.Value) -> ll.Value:
        if not fn.startswith("gelu"):
            return I64(GRAIN)
        return b.select(b.icmp_signed(">", n, I64(GELU_SERIAL)), b.sdiv(n, threads), I64(GRAIN))

    split_between_threads(module, name(fn), _chunk(module, fn), grain)


def library(kernel: str) -> int:
    """The address of kernel `kernel` (name(fn); jit.kernel: built alone when first needed; light:
    as fast without -O2's passes)."""
    return jit.kernel(kernel, lambda module: _entry(module, kernel.removeprefix(name(""))), light=True)


def run(fn: str, x: torch.Tensor) -> torch.Tensor:
    """The native kernel on a contiguous float32 tensor (for the probe)."""
    kernel = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)(library(name(fn)))
    y = torch.empty_like(x)
    kernel(x.data_ptr(), y.data_ptr(), x.numel())
    return y


def other_capability() -> str | None:
    """Why kernels written for ATen's AVX512 build (16-lane Sleef calls) cannot run here, if so."""
    cap = torch.backends.cpu.get_cpu_capability()
    return None if cap == CAPABILITY else f"ATen runs its {cap} kernels here; braze reproduces the {CAPABILITY} ones"


def why_not(fn: str) -> str | None:
    """None where braze's `fn` gives ATen's bits here, else why it is not used. Probed once per
    process and thread count: lengths around the 32-element step, the 32768-element split and
    the threads' chunks; special values; magnitudes where exp overflows and underflows."""
    other = other_capability()
    if other:
        return other
    if not _same(fn, torch.get_num_threads()):
        return f"a probe found braze's {fn} does not give ATen's bits here"
    return None


def _aten_gelu(x: torch.Tensor) -> torch.Tensor:
    """ATen's own gelu kernel over x's elements in order, not the oneDNN kernel it calls for a
    contiguous input of 2 or more: on a transposed [2, n / 2] view (not contiguous, but walked
    as one run of memory, as a contiguous input is), n even; one element as it is."""
    if x.numel() == 1:
        return torch.nn.functional.gelu(x)
    return torch.nn.functional.gelu(x.view(2, -1).t()).t().reshape(-1)


@functools.cache
def _same(fn: str, threads: int) -> bool:  # threads: in the cache key
    aten = {
        "sigmoid": torch.sigmoid,
        "silu": torch.nn.functional.silu,
        "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
        "gelu_erf": _aten_gelu,
    }[fn]
    gen = torch.Generator().manual_seed(0)
    special = [0.0, -0.0, 1e-45, -1e-40, 88.7, -88.8, 104.0, -104.0, 3e38, float("inf"), -float("inf")]
    for n in (1, 31, 32, 33, 63, 64, 65, 1000, 16384, 16385, 20001, 32767, 32768, 32769, 65536 + 57, 3 * 32768 + 5):
        n += n % 2 if fn == "gelu_erf" and n > 1 else 0  # _aten_gelu's view
        x = (torch.rand(n, generator=gen) - 0.5) * 40
        x[: min(n, len(special))] = torch.tensor(special[:n])
        if not jit.same_bits(run(fn, x), aten(x), nan_payloads=False):
            return False
    nan = torch.tensor([float("nan"), 1.0] * 20)
    return jit.same_bits(run(fn, nan), aten(nan), nan_payloads=False)
