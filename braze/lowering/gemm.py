"""GEMM rows: linear, addmm, mm, matmul and bmm as native BLAS calls with the arguments ATen's own
CPU kernels pass (so sgemm_ and cblas_sgemm_batch give eager's bits), where ATen calls BLAS."""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
import torch.nn.functional as F

from .. import config, dims, fast, gemmkernel, jit
from ..ir import Op, TensorMeta, broadcast_shape, contiguous_strides
from . import conv
from .core import META_RULES, Lowerer, NotNative, Sym, is_float32, no_out, to_meta

# --- GEMMs: mirror ATen's linear/addmm/mm argument choices, so sgemm_ gets eager's arguments ---


def blas_args(c: TensorMeta, m1: TensorMeta, m2: TensorMeta) -> dict[str, Any] | None:
    """The sgemm_ call ATen's addmm_impl_cpu_ makes for these layouts, or None if it copies."""
    (rows, cols), s = c.shape, c.stride
    if s[0] == 1 and (cols == 1 or s[1] >= max(1, rows)):
        swap = False
    elif s[1] == 1 and (rows == 1 or s[0] >= max(1, cols)):
        swap = True
    else:
        return None
    a, b = (m2, m1) if swap else (m1, m2)
    m, n = (cols, rows) if swap else (rows, cols)
    k = a.shape[0] if swap else a.shape[1]
    r, q = (1, 0) if swap else (0, 1)  # the row/column axes as BLAS sees them

    def cast(t: TensorMeta, lead_n: int, lead_t: int) -> bool | None:
        # transposed for BLAS?  None where ATen would clone the operand first
        if t.stride[r] == 1 and t.stride[q] >= max(1, lead_n):
            return False
        if t.stride[q] == 1 and t.stride[r] >= max(1, lead_t):
            return True
        return None

    ta, tb = cast(a, m, k), cast(b, k, n)
    if ta is None or tb is None:
        return None
    lda = a.stride[1 if ta == swap else 0]
    ldb = b.stride[1 if tb == swap else 0]
    ldc = c.stride[0 if swap else 1]
    args = _blas_call(ta, tb, m, n, k, lda, ldb, ldc)
    return None if args is None else dict(swap=swap, **args)


def _blas_call(ta: bool, tb: bool, m: int, n: int, k: int, lda: int, ldb: int, ldc: int) -> dict[str, Any] | None:
    """cpublas's normalize_last_dims, then its use_blas_gemm test (None: ATen does not call BLAS)."""
    if n == 1:
        ldc = m
    if ta:
        lda = k if m == 1 else lda
    elif k == 1:
        lda = m
    if tb:
        ldb = n if k == 1 else ldb
    elif n == 1:
        ldb = k
    big = 2**31 - 1
    ok = max(m, n, k, lda, ldb, ldc) <= big and lda >= max(1, k if ta else m)
    ok = ok and ldb >= max(1, n if tb else k) and ldc >= max(1, m)
    return dict(ta=ta, tb=tb, m=m, n=n, k=k, lda=lda, ldb=ldb, ldc=ldc) if ok else None


BMM_MIN_MACS = 400  # ATen's bmm runs its own loop below this many multiply-adds a matrix


def bmm_blas_args(c: TensorMeta, b1: TensorMeta, b2: TensorMeta) -> dict[str, Any] | None:
    """The cblas_sgemm_batch call ATen's bmm makes for these layouts (LinearAlgebra.cpp:
    bmm_out_or_baddbmm_, baddbmm_with_gemm_), or None where it takes another path: its own loop
    below 400 multiply-adds a matrix, per-matrix addmm for other layouts, sgemm_ for one matrix,
    oneDNN when the float32 matmul precision is reduced (see _full_precision)."""
    (batch, rows, inner), cols = b1.shape, b2.shape[2]
    if batch < 2 or rows * cols == 0 or inner * rows * cols < BMM_MIN_MACS or c.stride != contiguous_strides(c.shape):
        return None

    def items(t: TensorMeta) -> bool:  # each matrix contiguous or transposed
        (_, r, q), (_, sr, sq) = t.shape, t.stride
        return (sq == 1 and (r == 1 or sr >= q)) or (sr == 1 and (q == 1 or sq >= r))

    def transposed(t: TensorMeta) -> bool:
        return t.stride[1] == 1 and t.stride[2] >= t.shape[1]

    if not (items(b1) and items(b2)):
        return None
    ta, tb = transposed(b2), transposed(b1)  # column-major BLAS: A is batch2, B is batch1
    lda, ldb = b2.stride[2 if ta else 1], b1.stride[2 if tb else 1]
    args = _blas_call(ta, tb, cols, rows, inner, lda, ldb, c.stride[1])
    return None if args is None else dict(batch=batch, stride_a=b2.stride[0], stride_b=b1.stride[0], **args)


def _full_precision() -> None:
    """ATen's float32 matmuls call BLAS only in full precision: under a reduced one (bf16, tf32)
    they may call oneDNN's GEMM instead. Native GEMMs are compiled for the precision of the
    moment, and the entry checks it on every call."""
    if jit.matmul_precision() not in jit.FULL_PRECISION:
        raise NotNative("float32 matmul precision is reduced: ATen may call oneDNN's GEMM")


def _gemm(lw: Lowerer, m1: Sym, m2: Sym, bias: Sym | None, beta: float, weight: Sym | None = None, **attrs: Any) -> Sym:
    """m1 @ m2 (+ bias), where m2 may be linear's `weight` transposed (fast mode may keep it packed);
    `attrs` for the node besides its own."""
    _full_precision()
    for t in (m1, m2) + ((bias,) if bias is not None else ()):
        if not is_float32(t):
            raise NotNative("GEMM operands must be float32 tensors")
    if m1.meta.dim() != 2 or m2.meta.dim() != 2:
        raise NotNative("GEMM on tensors that are not 2-D")
    out = _mm_meta(m1.meta, m2.meta)
    if bias is not None and beta != 0:
        broadcast_shape(bias.meta.shape, out.shape)  # addmm's check: bias expands to (M, N)
    args = blas_args(TensorMeta.of(out), TensorMeta.of(m1.meta), TensorMeta.of(m2.meta))
    if args is None:
        raise NotNative("layout ATen copies before its GEMM")
    inputs = (m1.name, m2.name, bias.name if bias is not None and beta != 0 else None)
    beta = float(beta) if bias is not None else 0.0
    kept = _kept_pack(lw, weight, args)
    own = own_kernel(args, beta, packed="pack" in kept)
    if own == 1 and "pack" in kept:  # fast mode, a few rows (FEW_ROWS_CHUNK): the bias added after
        ends = {"beta": 0.0, "own_kernel": own, "one_thread": False, "order": (False, FEW_ROWS_CHUNK)}
        product = lw.emit(Op.GEMM, (*inputs[:2], None), out, blas=args, **ends, **kept, **attrs)
        return product if inputs[2] is None else lw.elementwise(Op.ADD, (product, bias), out)
    one = not own and _one_thread(args, beta)
    if "pack" in kept:  # (wherever the kernel runs: a generic program decides own_kernel again)
        attrs["order"] = (False, PACKED_CHUNK)
    return lw.emit(Op.GEMM, inputs, out, beta=beta, blas=args, own_kernel=own, one_thread=one, **kept, **attrs)


def _kept_pack(lw: Lowerer, weight: Sym | None, blas: dict[str, Any]) -> dict[str, Any]:
    """Fast mode: the attributes that make braze's GEMM kernel, where it runs (own_kernel, which a
    generic program decides after lowering), read linear's weight from panels packed once
    (fast.GemmPack, checked by the entry on every call), for a contiguous parameter of the
    model (a leaf of the module, or a TorchDynamo graph's input that is one) with a version
    counter; none otherwise (the kernel packs it on every call, as in exact mode)."""
    if not lw.fast or weight is None or blas["lda"] != (blas["k"] if blas["ta"] else blas["m"]):
        return {}
    real = kept_weight(lw, weight)  # (packed again and again before: read in place)
    if real is None or real.shape[0 if blas["ta"] else -1] != blas["m"] or real.numel() != blas["m"] * blas["k"]:
        return {}
    if not blas["ta"] and real.dim() != 2:  # ([N, K] also a 1 x 1 convolution's [N, C, 1, 1])
        return {}
    return {"pack": fast.GemmPack(real, transposed=not blas["ta"]), "pack_source": lw.owner(weight.name)}


def kept_weight(lw: Lowerer, w: Sym) -> torch.nn.Parameter | None:
    """Fast mode: the model's parameter behind w where its panels can be kept packed between calls
    (contiguous, with a version counter, not packed again and again before), else None."""
    source = lw.owner(w.name)
    real = lw.params.get(source, lw.given.get(source))
    if not isinstance(real, torch.nn.Parameter) or not real.is_contiguous() or jit.tensor_version(real) is None:
        return None
    return real if fast.steady(real) else None


def conv_gemm(lw: Lowerer, patches: Sym, w: Sym, real: torch.nn.Parameter, chunk: int, taps: bool = True) -> Sym:
    """Fast mode: a convolution's patches [M, K] (Op.IM2COL's, K tap by tap, or without `taps` in
    the weight's order) @ its weight w [O, C, KH, KW], the model's parameter `real` (what
    kept_weight gave), on its panels packed once in that order (fast.GemmPack, checked by the
    entry on every call): braze's kernel at every row count, K in blocks of `chunk`."""
    (m, k), o = patches.meta.shape, w.meta.shape[0]
    # BLAS's view of it, the kernel's form (own_kernel), also where one output channel or one
    # pixel would let blas_args take the other: C^T [O, M] = W [O, K] (transposed) @ patches^T
    args = _blas_call(True, False, o, m, k, k, k, o)
    assert args is not None
    args["swap"] = True
    pack, source = fast.GemmPack(real, taps=taps), lw.owner(w.name)
    attrs = {"blas": args, "own_kernel": 1, "one_thread": False, "order": (False, chunk), "taps": True}
    meta = torch.empty(m, o, device="meta")
    product = lw.emit(Op.GEMM, (patches.name, w.name, None), meta, beta=0.0, pack=pack, pack_source=source, **attrs)
    weight = real.detach().permute(0, 2, 3, 1) if taps else real.detach()
    lw.real[product.name] = lw.example(patches) @ weight.reshape(o, k).t()
    return product


def own_kernel(blas: dict[str, Any], beta: float, packed: bool = False) -> int:
    """From how many rows gemmkernel's kernel computes this GEMM in place of sgemm_ (0: never):
    X @ W with W [K, N] (GPT-2's Conv1D, matmul by a weight) or [N, K] (linear's), where MKL's
    path is the one the kernel reproduces and its probe at this shape gives ATen's bits; and
    in fast mode (`packed`: the weight's panels kept, _kept_pack), whatever MKL's bits, from a
    few rows by a large weight up. A generic program's row count may vary: the call checks it."""
    if not config.own_gemm or not blas["swap"] or blas["tb"] or beta not in (0.0, 1.0):
        return 0
    m, n, k = blas["n"], blas["m"], blas["k"]  # rows, columns, depth (BLAS sees the transpose)
    if not (isinstance(n, int) and isinstance(k, int)) or n < gemmkernel.MIN_N or k < gemmkernel.MIN_K:
        return 0
    if packed and isinstance(m, int) and m < gemmkernel.MIN_ROWS and n * k >= FEW_ROWS_WEIGHT:
        return 1
    # Smaller GEMMs stay MKL's, on one thread where that gives the same bits (config)
    rows = max(gemmkernel.MIN_ROWS * jit.mkl_threads(), -(-config.one_thread_gemm_flops // (2 * n * k)))
    if isinstance(m, int) and m < rows:
        return 0
    # Fast mode, a weight packed once: the kernel on its panels, whatever MKL's order, up to
    # PACKED_OWN_K (where MKL's order is the kernel's, the probe below takes the rest)
    if packed and k <= PACKED_OWN_K:
        return rows
    # At the program's own K and N: at the fewest rows, and at its own rows (up to a cost: how
    # MKL splits the work between threads, and so which rows take its other path, depends on
    # all three sizes; with two threads no split seen up to 8192 rows changed the order)
    own_rows = m if isinstance(m, int) else 2 * rows
    probes = {(rows, k, n), (min(own_rows, max(rows, PROBE_MACS // (n * k))), k, n)}
    return rows if gemmkernel.same(tuple(probes), linear=blas["ta"]) else 0


# Fast mode's GEMMs of a weight packed once, up to this K: the kernel on the panels, whatever MKL's
# order (sgemm_ packs the weight on every call). Where MKL runs its own kernels (2 cores of an Intel
# Xeon, 2026-12-06; on AMD the probe took these GEMMs already) the kernel alone ran 1.05-1.25x
# sgemm_'s speed at the text models' shapes up to K = 768, 0.84x at K = 1024 (512 rows, 256 columns)
# and 0.89-0.97x on the largest outputs (512-1024 x 1024, K = 256) (one thread, median of 7). In the
# models, fast mode with and without it (/tmp scripts, interleaved in one process, 25 rounds,
# medians; programs that did not change differed by up to 2%): ConvNeXt-atto 1.102x as fast,
# vit-tiny 1.066x, hf-vit 1.062x, MobileNet-V3-small 1.059x, bert-tiny 1.051x, T5 encoder 1.008x,
# BERT 0.996x, transformer-layer 0.986x. On K = 1024 too, BERT ran 0.97-0.99x and hf-vit 0.96-0.99x
# as fast as with this bound, and mlp-wide (K = 1024 and 4096) 0.94x eager against exact mode's
# 1.04x. Chosen per GEMM by timing the two alone (once per shape: the kernel on one thread's rows,
# sgemm_ on all), sgemm_ took 2 of bert-tiny's 13 and 4 of BERT's 25, which then ran 0.965x and
# 0.959x: alone, sgemm_'s packing reads a weight the cache holds, in the model it does not.
# Raised from 768 after the kernel's two steps of K a turn (583d529), which run 256 x 1024 -> 256
# at 155 GFLOP/s on one thread against sgemm_'s 147 (hot panels; 2026-12-07, one process per
# model compiled with each bound and a copy of the first, 21 rounds): with K = 1024 on the kernel
# BERT 1.017x (0.998x in a first run of 15), DistilBERT 1.027x, transformer-layer 1.017x, T5
# encoder 1.011x as fast as the copy, HF ViT 0.994x, mlp-wide 0.995x (MKL split K = 1024 between
# the threads and added the halves: 5% of BERT's samples).
PACKED_OWN_K = 1024

# ... whose K the kernel sums in blocks of this many (not MKL's: 192, or K // 2 below 384), the
# blocks' sums added in turn onto the bias: a 256 x 32 panel (32 KB) stays in L1 beside a block's
# rows, and each output is loaded and stored once per block (K = 256 was two passes, K = 1024
# six). A/B in one process per model (2026-12-07, Intel Xeon, 15 rounds, against MKL's blocks
# and a copy of them): transformer-layer 1.050x / 1.055x as fast, DistilBERT 1.047x, T5 encoder
# 1.048x / 1.052x, BERT 1.037x, HF ViT 1.04-1.06x, bert-tiny 1.031x / 1.033x, Llama 1.02-1.04x,
# vit-tiny 1.00x; errors against float64 0.74-1.09x eager's at the maximum (0.75-1.00x with
# MKL's blocks). The whole of K as one block ran as fast, with longer chains of FMAs.
PACKED_CHUNK = 256

# Fast mode: from this many weights (256 KB) a product of a few rows is the kernel's on packed
# panels split between the threads, not MKL's gemv on one thread: memory-bound, it then reads the
# weight at both cores' speed (MobileNet-V3-small's classifier, 576 -> 1024 -> 1000 for one image:
# MKL's sgemv was 23% of its fast calls)
FEW_ROWS_WEIGHT = 1 << 16
# ... whose K it sums in blocks of this many, the blocks' sums added in turn, the bias after them:
# a classifier head's error was most of fast mode's on the CNNs' outputs (timm's RegNetX-002,
# 368 -> 1000 for one image, K in MKL's two blocks of 184 onto the bias: 1.15-3.80x eager's
# largest error over 40 seeds of its weights). In blocks of 64 with the bias after (/tmp
# scripts, 2026-12-06): RegNetX 0.63-2.07x (median 1.2x, 40 seeds), and 4 seeds each:
# torchvision's RegNet 0.80-1.60x (from 1.9-3.0x), RepViT 0.93-1.34x (from 1.6-2.7x), GhostNet
# 0.66-0.97x (from 1.2-1.4x), MobileNet-V2 1.0-1.25x (from 0.9-1.1x). In blocks of 64 onto
# the bias GhostNet went to 1.6-2.3x, of 16 to 3.5-5.1x: its bias outweighs the product, and
# every block's sum added onto it rounds at the bias's scale. Speed unchanged (A/B in one
# process, 21 rounds: MobileNet-V3-small 1.016x, ResNet-18 1.019x, ConvNeXt-atto 1.038x,
# vit-tiny 1.029x).
FEW_ROWS_CHUNK = 64

PROBE_MACS = 1 << 26  # the most multiply-adds of a probe at a GEMM's own rows (~10 ms)


def _one_thread(blas: dict[str, Any], beta: float) -> bool:
    """Whether this small GEMM may call sgemm_ on one thread: only where MKL gives the bits it
    gives on its own thread count (the entry then checks that count on every call)."""
    flops = 2 * blas["m"] * blas["n"] * blas["k"]
    if not 0 < flops < config.one_thread_gemm_flops or jit.mkl_threads() == 1:
        return False
    return jit.one_thread_same(blas, beta)


# A generic GEMM probes one-thread sizes up to this many values of its symbol (10 ms per 128).
ONE_THREAD_SIZES = 128


def one_thread_sizes(
    blas: dict[str, Any], beta: float, lo: tuple[int, ...]
) -> tuple[int, int, tuple[bool, ...]] | None:
    """For a generic GEMM whose sizes depend on one symbol: (the symbol, its first value, whether
    each value from there may run on one thread), for the values where its flops are below
    config.one_thread_gemm_flops; None where none may (the GEMM then runs on MKL's threads)."""
    flops = 2 * blas["m"] * blas["n"] * blas["k"]
    symbols = set().union(*(x.symbols() for x in blas.values() if isinstance(x, dims.Expr)))
    if len(symbols) != 1 or jit.mkl_threads() == 1:
        return None
    j = symbols.pop()
    at = lambda v: [v if i == j else 1 for i in range(len(lo))]  # noqa: E731
    values = [
        v for v in range(lo[j], lo[j] + ONE_THREAD_SIZES) if dims.value(flops, at(v)) < config.one_thread_gemm_flops
    ]
    calls = [{k: dims.value(x, at(v)) for k, x in blas.items()} for v in values]
    same = jit.one_thread_same_sizes(calls, beta) if calls else []
    # flops grow with the symbol: the values below the threshold are the first ones
    return (j, lo[j], tuple(same)) if any(same) else None


# --- output layouts of the GEMM family, without their Python meta kernels (see _example_call) ---


def _mm_meta(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.dim() != 2 or b.dim() != 2:
        raise RuntimeError(f"self must be a matrix (got {a.dim()}-D and {b.dim()}-D)")
    if a.shape[1] != b.shape[0]:
        raise RuntimeError(
            f"mat1 and mat2 shapes cannot be multiplied ({a.shape[0]}x{a.shape[1]} and {b.shape[0]}x{b.shape[1]})"
        )
    if a.dtype != b.dtype:
        raise RuntimeError(f"expected m1 and m2 to have the same dtype, but got: {a.dtype} != {b.dtype}")
    return torch.empty((a.shape[0], b.shape[1]), dtype=a.dtype, device="meta")


def _linear_rule(fn: Any, args: tuple, kwargs: dict) -> torch.Tensor | None:
    x, w, b = _linear_parts(fn, args, kwargs)
    if isinstance(fn, torch.nn.Linear):
        w, b = to_meta(fn.weight), None if fn.bias is None else to_meta(fn.bias)
    if not isinstance(x, torch.Tensor) or x.dim() not in (2, 3) or w.dim() != 2:
        return None
    rows = 1
    for d in x.shape[:-1]:
        rows *= d
    out = _mm_meta(torch.empty((rows, x.shape[-1]), dtype=x.dtype, device="meta"), w.t())
    if b is not None:
        broadcast_shape(b.shape, out.shape)
    return out.view(*x.shape[:-1], w.shape[0])


def _mm_rule(fn: Any, args: tuple, kwargs: dict) -> torch.Tensor | None:
    a, b = args[0], args[1]
    ok = all(isinstance(t, torch.Tensor) and t.dim() == 2 for t in (a, b)) and kwargs.get("out") is None
    return _mm_meta(a, b) if ok else None


def _addmm_rule(fn: Any, args: tuple, kwargs: dict) -> torch.Tensor | None:
    out = _mm_rule(fn, args[1:], kwargs)
    if out is not None and isinstance(args[0], torch.Tensor):
        broadcast_shape(args[0].shape, out.shape)
        return out
    return None


for _k in (F.linear, torch.nn.Linear):
    META_RULES[_k] = _linear_rule
for _k in (torch.mm, "mm", torch.matmul, operator.matmul, "matmul", "__matmul__"):
    META_RULES[_k] = _mm_rule
for _k in (torch.addmm, "addmm"):
    META_RULES[_k] = _addmm_rule


def _bmm(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
    no_out(kwargs)
    _full_precision()
    b1, b2 = args[0], args[1] if len(args) > 1 else kwargs.get("mat2")
    for t in (b1, b2):
        if not (is_float32(t) and t.meta.dim() == 3):
            raise NotNative("bmm operands must be 3-D float32 tensors")
    args = bmm_blas_args(TensorMeta.of(out), TensorMeta.of(b1.meta), TensorMeta.of(b2.meta))
    if args is None:
        raise NotNative("a bmm ATen computes without MKL's batched GEMM")
    return lw.emit(Op.BMM, (b1.name, b2.name), out, blas=args, own_kernel=_own_bmm(args, b1.meta, b2.meta))


def _own_bmm(blas: dict[str, Any], b1: torch.Tensor, b2: torch.Tensor) -> bool:
    """Whether braze's GEMM kernel computes this bmm in place of cblas_sgemm_batch, matrix by
    matrix, the batch's rows split between ATen's threads: for a batch of fixed sizes and
    strides whose first operand's matrices are row-major, sizes where sgemm_'s path is the one
    the kernel reproduces, and where its probe (these layouts, MKL's thread count: the entry
    checks it) gives ATen's bits. MKL's batched GEMM ran the attention products of
    `transformer-layer` at ~110 GFLOP/s, the kernel at 140 and 180 (docs/limits.md)."""
    if not config.own_gemm or blas["tb"]:
        return False
    layouts = ((tuple(b1.shape), b1.stride()), (tuple(b2.shape), b2.stride()))
    if not all(isinstance(d, int) for shape, stride in layouts for d in (*shape, *stride)):
        return False
    rows, cols, depth = blas["n"], blas["m"], blas["k"]  # (BLAS sees the transpose)
    if rows < gemmkernel.MIN_ROWS or cols < gemmkernel.MIN_N or depth < gemmkernel.MIN_K:
        return False
    return gemmkernel.same_batched(*layouts)


def _linear_parts(fn: Any, args: tuple, kwargs: dict) -> tuple[Any, Any, Any]:
    if isinstance(fn, torch.nn.Linear):
        return args[0], None, None
    x, w = args[0], args[1] if len(args) > 1 else kwargs["weight"]
    return x, w, args[2] if len(args) > 2 else kwargs.get("bias")


def _linear(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
    """ATen's linear: addmm for a matrix with a bias; the same on the rows of a contiguous
    input of other ranks (_flatten_nd_linear) when the bias is a contiguous vector; else
    matmul(input, weight.t()), then the bias added to it in place."""
    x, w, b = _linear_parts(fn, args, kwargs)
    if isinstance(fn, torch.nn.Linear):
        w, b = lw.weights(fn)
    if not isinstance(x, Sym) or not isinstance(w, Sym) or not x.is_tensor:
        raise NotNative("linear on non-tensors")
    packed = _packed(lw, x, w, b, transposed=False)
    if packed is not None:
        return packed
    wt = lw.view(w, torch.t)
    if b is not None and x.meta.dim() == 2:
        return _gemm(lw, x, wt, b, 1.0, weight=w)
    vector = isinstance(b, Sym) and b.is_tensor and b.meta.squeeze().dim() == 1 and b.meta.is_contiguous()
    if vector and x.meta.is_contiguous():
        return _gemm_on_rows(lw, x, wt, b, 1.0, out, weight=w)
    res = _matmul_of(lw, x, wt, out, weight=w)
    return res if b is None else lw.elementwise(Op.ADD, (res, b), out)


def _packed(lw: Lowerer, x: Sym, w: Sym, b: Any, transposed: bool) -> Sym | None:
    """Fast mode: this linear (addmm if `transposed`) as an ATen call of oneDNN's GEMM on w packed
    once (fast.PackedLinear), for float32 rows, a model weight (a parameter, or an input of a
    TorchDynamo graph), a vector bias or none, at full matmul precision, where oneDNN was timed
    faster at the shape; else None."""
    if not (lw.fast and is_float32(x) and is_float32(w) and (b is None or is_float32(b))):
        return None
    if lw.ops.get(w.name) not in (Op.PARAM, Op.INPUT) or jit.matmul_precision() not in jit.FULL_PRECISION:
        return None
    if x.meta.dim() < 2 or w.meta.dim() != 2 or (b is not None and b.meta.dim() != 1):
        return None
    if x.meta.shape[-1] != w.meta.shape[0 if transposed else 1]:
        return None
    packed = fast.PackedLinear(x.meta.numel() // max(x.meta.shape[-1], 1), transposed)
    real = fast.packed_linear(packed, *lw.live((x, w, b)))
    if real is None:
        return None
    why = "fast mode: oneDNN's GEMM on a packed weight, timed faster than MKL's at this shape"
    return conv.extern_of(lw, packed, (x, w, b), "linear (oneDNN, packed weight)", why, real)


def _addmm(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
    no_out(kwargs)
    if kwargs.get("alpha", 1) != 1 or kwargs.get("beta", 1) not in (0, 1):
        raise NotNative("alpha != 1 or beta not in {0, 1}")
    bias, x, w = args[:3]
    packed = _packed(lw, x, w, bias, transposed=True) if kwargs.get("beta", 1) == 1 else None
    if packed is not None:
        return packed
    return _gemm(lw, x, w, bias, float(kwargs.get("beta", 1)), weight=w)  # (GPT-2's Conv1D: w [K, N])


def _mm(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
    no_out(kwargs)
    a, b = args[0], args[1]
    if not (isinstance(a, Sym) and isinstance(b, Sym) and a.is_tensor and b.is_tensor):
        raise NotNative("matmul of non-tensors")
    return _gemm(lw, a, b, None, 0.0)


def _matmul(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
    no_out(kwargs)
    a, b = args[0], args[1]
    if not all(isinstance(t, Sym) and t.is_tensor for t in (a, b)):
        raise NotNative("matmul of non-tensors")
    return _matmul_of(lw, a, b, out)


def _matmul_of(lw: Lowerer, a: Sym, b: Sym, out: Any, weight: Sym | None = None) -> Sym:
    """ATen's _matmul_impl, where it calls mm or bmm on views of its operands."""
    da, db = a.meta.dim(), b.meta.dim()
    if da == db == 2:
        return _gemm(lw, a, b, None, 0.0, weight)
    if da == 1 and db == 2:  # a.unsqueeze(0).mm(b).squeeze_(0)
        row = lw.view(a, lambda t: t.unsqueeze(0))
        return lw.view(_gemm(lw, row, b, None, 0.0), lambda t: t.squeeze(0))
    if da >= 3 and db == 2 and _folds(a.meta):
        # should_fold: the leading dimensions merge without a copy, so ATen folds them into the
        # rows of one mm (whether or not b requires grad), then views the result
        return _gemm_on_rows(lw, a, b, None, 0.0, out, weight)
    if da >= 3 and db == 2 and _requires_grad(lw, b):
        # should_fold again: where b requires grad (a parameter does, under no_grad too) ATen
        # folds a whose leading dimensions do not merge all the same, its reshape a copy where
        # it cannot be a view (a Linear of a transposed input: MLP-Mixer, SegFormer, LeViT)
        return _gemm_on_rows(lw, a, b, None, 0.0, out, weight)
    if da >= 3 and db >= 3 and a.meta.shape[:-2] == b.meta.shape[:-2]:
        # Equal batches: ATen's matmul calls bmm on t.expand(shape).reshape(batches, rows, cols),
        # which may give size-1 dimensions other strides (and so other BLAS arguments) or copy
        # (a batch that does not merge): take its layouts; then it views the result.
        batches = math.prod(a.meta.shape[:-2])
        a, b = (lw.view(t, lambda e: e.expand(e.shape).reshape(batches, *e.shape[-2:])) for t in (a, b))
        if not (isinstance(out, torch.Tensor) and out.is_contiguous()):
            raise NotNative("a batched matmul whose result is not laid out as bmm's")
        product = _bmm(lw, torch.bmm, (a, b), {}, out.view(batches, *out.shape[-2:]))
        return lw.view(product, lambda t: t.view(out.shape))
    raise NotNative("matmul ATen computes with a matrix-vector product, a copy or a broadcast batch")


def _gemm_on_rows(
    lw: Lowerer, x: Sym, w: Sym, bias: Sym | None, beta: float, out: Any, weight: Sym | None = None
) -> Sym:
    """A GEMM on x's leading dimensions merged into rows (x.reshape: a view where x is
    contiguous or folds, else a copy), its result viewed with `out`'s shape: ATen's
    _flatten_nd_linear and matmul's fold."""
    rows = lw.view(x, lambda t: t.reshape(math.prod(t.shape[:-1]), t.shape[-1]))
    return lw.view(_gemm(lw, rows, w, bias, beta, weight), lambda t: t.view(out.shape))


def _requires_grad(lw: Lowerer, b: Sym) -> bool:
    """Whether b is (a view of) a parameter of the model or an argument (a TorchDynamo graph's
    parameters are its arguments) that requires grad. The program is then for its requires_grad,
    which the entry checks on every call (Lowerer.grad_read)."""
    source = lw.owner(b.name)
    real = lw.params.get(source, lw.given.get(source)) if lw.ops.get(source) in (Op.PARAM, Op.INPUT) else None
    if not isinstance(real, torch.Tensor):
        return False
    lw.grad_read[source] = real.requires_grad  # (either way: set later, a native fold is compiled)
    return real.requires_grad


def _folds(t: torch.Tensor) -> bool:
    """Whether ATen's matmul folds t @ matrix (t of 3 or more dimensions) into one mm whatever
    requires grad (should_fold): t is empty, or its leading dimensions merge without a copy."""
    return t.numel() == 0 or all(t.stride(i) == t.stride(i + 1) * t.shape[i + 1] for i in range(t.dim() - 2))
