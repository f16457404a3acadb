"""Elementwise rows: arithmetic, comparisons, activations and clamps, each in ATen's order of
operations (the codegen's _scalar_op gives each op ATen's NaN and signed-zero behaviour)."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch

from .. import fast, jit, onednn, sleef, vml
from ..ir import Op, TensorMeta
from . import conv
from .core import Lowerer, NotNative, Sym, is_float32, no_out, to_meta


def _binary(op: Op) -> Callable[..., Sym]:
    def row(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
        no_out(kwargs)
        if kwargs.get("alpha", 1) != 1:
            raise NotNative("alpha != 1 (ATen fuses it into an FMA)")
        if kwargs.get("rounding_mode") is not None:
            raise NotNative("rounding_mode")
        a, b = args[0], args[1] if len(args) > 1 else kwargs["other"]
        if op is Op.DIV and not isinstance(a, Sym):
            # `2 / x` is Tensor.__rtruediv__: reciprocal(x) * 2 in eager, two roundings.
            recip = lw.elementwise(Op.DIV, (1.0, b), out)
            return lw.elementwise(Op.MUL, (recip, a), out)
        if op is Op.ADD and lw.fast:
            fused = conv.fuse_residual(lw, a, b, out) or conv.fuse_residual(lw, b, a, out)
            if fused is not None:
                return fused
        return lw.elementwise(op, (a, b), out)

    return row


def _rsub(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
    if kwargs.get("alpha", 1) != 1:
        raise NotNative("alpha != 1")
    return lw.elementwise(Op.SUB, (args[1], args[0]), out)


def _unary(op: Op) -> Callable[..., Sym]:
    def row(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
        no_out(kwargs)
        return lw.elementwise(op, (args[0],), out)

    return row


def _post_op(attr: str, algorithm: str, otherwise: Callable[..., Sym]) -> Callable[..., Sym]:
    """An activation: in fast mode, the post-op `attr` of the packed convolution or linear it
    follows (if nothing else reads that result, and the call takes it); else `otherwise`'s
    lowering."""

    def row(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
        x = args[0] if args else kwargs.get("input")
        at = conv.packed_call(lw, x)
        # (in place or not: nothing else reads x, so no one sees it before the activation)
        plain = not (set(kwargs) - {"input", "approximate", "inplace"}) and len(args) <= 1
        if at is None or not plain or not lw.nodes[at].attrs["fn"].takes(attr):
            return otherwise(lw, fn, args, kwargs, out)
        approximate = getattr(fn, "approximate", kwargs.get("approximate", "none"))
        return conv.fuse_post_op(lw, at, attr, approximate if attr == "gelu" else algorithm)

    return row


def _pow(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
    """ATen's pow with the exponents its CPU kernel computes with IEEE arithmetic instead of
    std::pow: x * x, x * x * x, 1 / x and 1 / (x * x), in that order of operations. (Its
    sqrt, for 0.5, is not correctly rounded: through ATen.)"""
    no_out(kwargs)
    x, e = args[0], args[1] if len(args) > 1 else kwargs["exponent"]
    if not isinstance(e, (int, float)) or isinstance(e, bool) or e not in (2, 3, -1, -2):
        raise NotNative(f"pow with exponent {e!r}")
    if e == -1:
        return lw.elementwise(Op.DIV, (1.0, x), out)
    square = lw.elementwise(Op.MUL, (x, x), out)
    if e == 2:
        return square
    return lw.elementwise(Op.MUL, (square, x), out) if e == 3 else lw.elementwise(Op.DIV, (1.0, square), out)


def _pow_by(exponent: int) -> Callable[..., Sym]:
    """square (2) and reciprocal (-1): ATen computes them as pow does."""
    return lambda lw, fn, args, kwargs, out: _pow(lw, fn, (args[0], exponent), kwargs, out)


def _masked_fill(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
    """x.masked_fill(mask, value) with a Python value: where(mask, value, x)."""
    x, mask = args[0], args[1]
    value = args[2] if len(args) > 2 else kwargs.get("value")
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise NotNative("masked_fill with a tensor value")
    return lw.elementwise(Op.WHERE, (mask, value, x), out)


def _leaky_relu(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
    slope = args[1] if len(args) > 1 else kwargs.get("negative_slope", 0.01)
    return lw.elementwise(Op.LEAKY_RELU, (args[0],), out, slope=lw._operand(slope, False))


def _clamp_bounds(lw: Lowerer, lo: Any, hi: Any, x: Any, out: Any) -> Sym:
    if isinstance(lo, Sym) or isinstance(hi, Sym):
        raise NotNative("tensor bounds")
    bound = lambda v: None if v is None else lw._operand(v, False)
    return lw.elementwise(Op.CLAMP, (x,), out, lo=bound(lo), hi=bound(hi))


def _clamp(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
    no_out(kwargs)
    lo = args[1] if len(args) > 1 else kwargs.get("min")
    hi = args[2] if len(args) > 2 else kwargs.get("max")
    return _clamp_bounds(lw, lo, hi, args[0], out)


def _hardtanh(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
    lo = args[1] if len(args) > 1 else kwargs.get("min_val", -1.0)
    hi = args[2] if len(args) > 2 else kwargs.get("max_val", 1.0)
    return _clamp_bounds(lw, lo, hi, args[0], out)


def _clamp_one(lo: bool) -> Callable[..., Sym]:
    """clamp_min (lo) or clamp_max: clamp with one bound."""

    def row(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
        no_out(kwargs)
        bound = args[1] if len(args) > 1 else kwargs.get("min" if lo else "max")
        return _clamp_bounds(lw, bound if lo else None, None if lo else bound, args[0], out)

    return row


def _relu6(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
    return _clamp_bounds(lw, 0.0, 6.0, args[0], out)


def _hardsigmoid(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
    """ATen's hardsigmoid: min(max(x + 3, 0), 6) / 6, in that order."""
    return lw.elementwise(Op.DIV, (_shifted_relu6(lw, args[0], out), 6.0), out)


def _hardswish(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
    """ATen's hardswish: x * min(max(x + 3, 0), 6) / 6, in that order."""
    scaled = lw.elementwise(Op.MUL, (args[0], _shifted_relu6(lw, args[0], out)), out)
    return lw.elementwise(Op.DIV, (scaled, 6.0), out)


def _shifted_relu6(lw: Lowerer, x: Any, out: Any) -> Sym:
    return _clamp_bounds(lw, 0.0, 6.0, lw.elementwise(Op.ADD, (x, 3.0), out), out)


def _threshold(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
    """ATen's threshold: x <= threshold ? value : x (NaN stays)."""
    if isinstance(fn, torch.nn.Module):
        threshold, value = fn.threshold, fn.value
    else:
        threshold = args[1] if len(args) > 1 else kwargs["threshold"]
        value = args[2] if len(args) > 2 else kwargs["value"]
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (threshold, value)):
        raise NotNative("threshold with tensor bounds")
    below = lw.elementwise(Op.LE, (args[0], threshold), to_meta(out, torch.bool))
    return lw.elementwise(Op.WHERE, (below, value, args[0]), out)


def _prelu(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
    """ATen's prelu: the weight reshaped to lie along dimension 1, then x > 0 ? x : weight * x."""
    x = args[0]
    if isinstance(fn, torch.nn.PReLU):
        w = lw.param(fn.weight, "weight")
    else:
        w = args[1] if len(args) > 1 else kwargs["weight"]
    if not (isinstance(x, Sym) and isinstance(w, Sym) and x.is_tensor and w.is_tensor):
        raise NotNative("prelu of non-tensors")
    if w.meta.dim() == 1:
        shape = [1] * x.meta.dim()
        if len(shape) > 1:
            shape[1] = w.meta.numel()
        w = lw.view(w, lambda t: t.reshape(shape))
    above = lw.elementwise(Op.GT, (x, 0.0), to_meta(out, torch.bool))
    return lw.elementwise(Op.WHERE, (above, x, lw.elementwise(Op.MUL, (w, x), out)), out)


def _where(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
    no_out(kwargs)
    if len(args) != 3:
        raise NotNative("where with one argument")
    return lw.elementwise(Op.WHERE, args, out)


def _logical_not(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
    """logical_not(x), and ~x of a bool tensor: x == 0 (NaN counts as true); a bool x is cast to
    float32 first, as any bool operand of a comparison with a float (one fused loop)."""
    no_out(kwargs)
    x = args[0]
    if fn in _BITWISE_NOT and not (isinstance(x, Sym) and x.is_tensor and x.meta.dtype == torch.bool):
        raise NotNative("bitwise not of a tensor that is not bool")
    return lw.elementwise(Op.EQ, (x, 0.0), out)


_BITWISE_NOT = (operator.invert, torch.bitwise_not, torch.Tensor.bitwise_not, torch.Tensor.__invert__)


def _leaky_relu_any(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
    if isinstance(fn, torch.nn.Module):
        return _leaky_relu(lw, fn, (args[0], fn.negative_slope), {}, out)
    return _leaky_relu(lw, fn, args, kwargs, out)


def _hardtanh_any(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
    if isinstance(fn, torch.nn.Module):
        return _clamp_bounds(lw, fn.min_val, fn.max_val, args[0], out)
    return _hardtanh(lw, fn, args, kwargs, out)


def _rsqrt(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
    """torch.rsqrt, natively where a probe shows ATen computes it as 1 / sqrt with IEEE operations
    (jit.rsqrt_is_ieee)."""
    no_out(kwargs)
    if not jit.rsqrt_is_ieee():
        raise NotNative("a probe found ATen's rsqrt is not 1 / sqrt in IEEE arithmetic here")
    return lw.elementwise(Op.RSQRT, (args[0],), out)


def _one_run_float32(name: str, args: tuple, kwargs: dict, out: Any) -> Sym:
    """The input of an op whose bits depend on the position in ATen's loop (sleef.py), or on
    which kernel ATen picks by layout (onednn.py): float32 in one run of memory (TensorMeta.dense),
    its result laid out alike."""
    no_out(kwargs)
    x = args[0] if args else kwargs.get("input")
    if not (is_float32(x) and TensorMeta.of(x.meta).dense):
        raise NotNative(f"{name} of a tensor that is not float32 in one run of memory (ATen loops over it otherwise)")
    if not isinstance(out, torch.Tensor) or out.dtype != torch.float32 or out.numel() >= 2**31:
        raise NotNative(f"{name} with a result that is not float32 or has 2**31 elements or more")
    if any(a != b for a, b, n in zip(out.stride(), x.meta.stride(), out.shape) if n != 1):
        raise NotNative(f"{name} with a result laid out unlike its input")
    return x


def _sleef(name: str) -> Callable[..., Sym]:
    """sigmoid, silu, gelu_tanh, gelu (erf form, ATen's own kernel): sleef.py's kernels, which
    take ATen's loop (Sleef in the vector body, glibc in the scalar tails, the threads' chunks),
    on an input in one run of memory, where a probe shows they give ATen's bits. Fast mode's
    sigmoid, silu and gelu_tanh: the same arithmetic per element (Op.SLEEF), fused anywhere."""

    def row(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
        x = args[0] if args else kwargs.get("input")
        if lw.fast and name != "gelu_erf" and is_float32(x) and not sleef.other_capability():
            no_out(kwargs)
            return lw.elementwise(Op.SLEEF, (x,), out, fn=name)  # (any layout: each lane alone)
        x = _one_run_float32(name, args, kwargs, out)
        why = sleef.why_not(name)
        if why:
            raise NotNative(why)
        return lw.emit(Op.ACTIVATION, (x.name,), out, fn=name)

    return row


def _gelu(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
    """gelu. approximate="tanh": sleef.py's kernel (Sleef's tanh in ATen's loop). The erf form
    takes the kernel ATen picks: for a contiguous input of 2 or more elements oneDNN's polynomials
    (onednn.py), an elementwise op fused with its neighbours; for one element or another layout
    in one run of memory (channels-last), ATen's own (sleef.py). Fast mode takes oneDNN's on any
    layout (within the accuracy contract), but for one element: there ATen's own is eager's,
    costs nothing more, and a model of one output has that one error as its contract's figure
    (random 7 -> 1 -> 1 MLPs with oneDNN's there: 5 of 3,000 outside it, one 7.9x eager's)."""
    approximate = fn.approximate if isinstance(fn, torch.nn.GELU) else kwargs.get("approximate", "none")
    kwargs = {k: v for k, v in kwargs.items() if k != "approximate"}
    if approximate == "tanh":
        return _sleef("gelu_tanh")(lw, fn, args, kwargs, out)
    x = args[0] if args else kwargs.get("input")
    if lw.fast and is_float32(x) and not sleef.other_capability() and x.meta.numel() != 1:
        no_out(kwargs)
        return lw.elementwise(Op.GELU_ERF, (x,), out)
    x = _one_run_float32("gelu", args, kwargs, out)
    if not x.meta.is_contiguous() or x.meta.numel() == 1:
        return _sleef("gelu_erf")(lw, fn, args, kwargs, out)
    why = onednn.why_not_gelu()
    if why:
        raise NotNative(why)
    return lw.elementwise(Op.GELU_ERF, (x,), out)


def _vml(name: str) -> Callable[..., Sym]:
    """exp, tanh, erf, log, sin, cos, ... (jit.VML_FUNCTIONS): MKL's vector math function with
    ATen's mode, the function ATen's float32 kernel calls here (on contiguous runs, or on copies
    of strided ones: its results depend on no position, alignment or thread count), where a
    probe shows ATen gives its bits. tanh is an elementwise op (Op.TANH, vml.py's arithmetic)
    where a probe shows braze reproduces MKL's kernel here. Fast mode's tanh is its own
    (Op.FAST_TANH: codegen/fastmath.py), an elementwise op on any layout."""

    def row(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
        no_out(kwargs)
        x = args[0]
        if lw.fast and name == "tanh" and is_float32(x) and not sleef.other_capability():
            return lw.elementwise(Op.FAST_TANH, (x,), out)
        if not is_float32(x):
            raise NotNative(f"{name} of a tensor that is not float32")
        if not isinstance(out, torch.Tensor) or out.dtype != torch.float32 or out.numel() >= 2**31:
            raise NotNative(f"{name} with a result that is not float32 or has 2**31 elements or more")
        if not jit.vml_same(name):
            raise NotNative(f"a probe found ATen's {name} does not give MKL's {jit.VML_FUNCTIONS[name]} bits here")
        if name == "tanh" and vml.why_not_tanh() is None:
            return lw.elementwise(Op.TANH, (x,), out)
        return lw.emit(Op.VML, (x.name,), out, fn=jit.VML_FUNCTIONS[name])

    return row


_BATCH_NORM_ARGS = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")


def _batch_norm(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
    """Eval-mode batch_norm of a contiguous input with running statistics, weight and bias, in
    ATen's arithmetic (batch_norm_kernel.cpp, GCC's FMAs): per channel invstd = 1 / sqrt(var +
    eps), alpha = invstd * weight, beta = fma(-mean, alpha, bias); then y = fma(x, alpha, beta).
    The channel terms are recomputed each call from the live buffers (a few elementwise ops over
    the channels); y is one elementwise op, fused with what follows (ReLU). Fast mode takes any
    layout (a channels-last input, after a 1 x 1 convolution made a GEMM) in this arithmetic."""
    no_out(kwargs)
    if isinstance(fn, torch.nn.modules.batchnorm._BatchNorm):
        lw.reads_training.append(fn)  # the program is for this flag: the entry checks it
        if fn.training or not fn.track_running_stats:
            raise NotNative("batch_norm with batch statistics (training, or no running statistics)")
        given = {"input": args[0], "eps": fn.eps}
        given |= {k: fn.get_buffer(k) if k.startswith("running") else getattr(fn, k) for k in _BATCH_NORM_ARGS[1:5]}
        given = {k: lw.param(v, k) if isinstance(v, torch.Tensor) else v for k, v in given.items()}
    else:
        given = dict(zip(_BATCH_NORM_ARGS, args)) | kwargs
        if given.get("training", False):
            raise NotNative("batch_norm with batch statistics (training)")
    x, eps = given["input"], given.get("eps", 1e-5)
    channels = [given.get(k) for k in _BATCH_NORM_ARGS[1:5]]
    at = conv.packed_call(lw, x, fast.PackedConv)
    if at is not None and lw.nodes[at].attrs["fn"].residual:
        at = None  # (x is the sum of the convolution and another tensor: the batch_norm is of both)
    if at is not None and all(isinstance(t, Sym) for t in channels) and isinstance(eps, float):
        return conv.fold_batch_norm(lw, at, tuple(channels), eps)
    if not (is_float32(x) and x.meta.dim() >= 2):
        raise NotNative("batch_norm of a tensor that is not float32 with a channel dimension")
    if not isinstance(out, torch.Tensor) or not (lw.fast or (x.meta.is_contiguous() and out.is_contiguous())):
        raise NotNative("batch_norm of a strided or channels-last input (ATen's other loop)")
    c = x.meta.shape[1]
    for t in channels:
        if not (is_float32(t) and tuple(t.meta.shape) == (c,)):
            raise NotNative("batch_norm without float32 running statistics, weight and bias of one value per channel")
    if not isinstance(eps, float):
        raise NotNative("batch_norm with an eps that is not a float")
    if not (jit.rsqrt_is_ieee() and jit.batch_norm_same()):
        raise NotNative("a probe found ATen's batch_norm is not fma(x, alpha, beta) in IEEE arithmetic here")
    mean, var, weight, bias = channels
    per_channel = torch.empty(c, device="meta")
    invstd = lw.elementwise(Op.RSQRT, (lw.elementwise(Op.ADD, (var, eps), per_channel),), per_channel)
    alpha = lw.elementwise(Op.MUL, (invstd, weight), per_channel)
    beta = lw.elementwise(Op.FMA, (lw.elementwise(Op.NEG, (mean,), per_channel), alpha, bias), per_channel)
    along = (c,) + (1,) * (x.meta.dim() - 2)
    alpha, beta = (lw.view(v, lambda t: t.view(along)) for v in (alpha, beta))
    return lw.elementwise(Op.FMA, (x, alpha, beta), out)
