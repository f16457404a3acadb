"""Rows that move data or only its description: views (free: new metadata), conversions that
return their input, cat and stack (copy loops), identity, dropout and stochastic depth in eval."""

from __future__ import annotations

from typing import Any

import torch

from ..ir import LOOP_DTYPES, Op
from .core import Lowerer, NotNative, Sym, is_float32, leaves, no_out


def _cat(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
    """ATen's cat of float32 tensors: a copy of each along `dim` (it skips 1-D empty tensors)."""
    no_out(kwargs)
    tensors, dim = args[0], args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if not isinstance(out, torch.Tensor) or out.dtype != torch.float32:
        raise NotNative("cat whose result is not float32")
    if not all(is_float32(t) for t in tensors):
        raise NotNative("cat of tensors that are not all float32")
    if not isinstance(dim, int):
        raise NotNative("cat along a named dimension")
    parts = [t.name for t in tensors if not (t.meta.dim() == 1 and t.meta.numel() == 0)]
    if not parts:
        raise NotNative("cat of empty tensors only")
    return lw.emit(Op.CAT, tuple(parts), out, dim=dim % out.dim())


def _stack(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
    """ATen's stack: cat of the tensors unsqueezed at `dim`."""
    tensors, dim = args[0], args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if not all(isinstance(t, Sym) and t.is_tensor for t in tensors) or not isinstance(dim, int):
        raise NotNative("stack of non-tensors or along a named dimension")
    d = dim % out.dim()
    return _cat(lw, fn, ([lw.view(t, lambda e: e.unsqueeze(d)) for t in tensors], d), kwargs, out)


def _pad(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
    """F.pad with mode "constant" (Swin's windows, EfficientViT): ATen's constant_pad_nd fills a
    new tensor with the value and copies the input into its middle, the result laid out as the
    input (channels-last stays so). Here: per padded dimension, from the last, a cat of filled
    blocks around the input (no arithmetic: eager's bits); no padding at all is a copy."""
    names = ("input", "pad", "value") if fn is torch.constant_pad_nd else ("input", "pad", "mode", "value")
    given = dict(zip(names, args)) | kwargs
    x, pad, value = given["input"], given["pad"], given.get("value")
    if given.get("mode", "constant") != "constant" or not (is_float32(x) and isinstance(out, torch.Tensor)):
        raise NotNative("padding of a tensor that is not float32, or not with a constant")
    if not (all(type(p) is int and p >= 0 for p in pad) and len(pad) % 2 == 0 and len(pad) <= 2 * x.meta.dim()):
        raise NotNative("padding that crops, or whose sizes are not constants")
    fill = 0.0 if value is None else value
    if type(fill) not in (int, float):
        raise NotNative("padding with a value that is not a number")
    steps = [(x.meta.dim() - 1 - k, pad[2 * k], pad[2 * k + 1]) for k in range(len(pad) // 2)]
    steps = [(d, lo, hi) for d, lo, hi in steps if lo or hi]
    if not steps:
        return lw.elementwise(Op.COPY, (x,), out)
    y = x
    for i, (d, lo, hi) in enumerate(steps):
        shape = list(y.meta.shape)
        shape[d] += lo + hi
        meta = out if i == len(steps) - 1 else torch.empty(shape, dtype=torch.float32, device="meta")
        parts = []
        for width in (lo, None, hi):
            if width is None:
                parts.append(y)
            elif width:
                block = torch.empty([*shape[:d], width, *shape[d + 1 :]], dtype=torch.float32, device="meta")
                parts.append(lw.elementwise(Op.COPY, (fill,), block))
        y = _cat(lw, torch.cat, (parts, d), {}, meta)
    return y


def _identity(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Any:
    return args[0]


def _conversion(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Any:
    """x.to(...), .float(), .type_as(y), ...: x itself where ATen returns x unchanged (the dtype,
    device and layout asked for are x's own: Llama's and T5's `.to(float32)` on float32), which
    depends on layouts only. A conversion that copies between float32, int32, int64 and bool
    (or within one of them: copy=True, another memory format) is a loop (RoBERTa's position
    ids, DeBERTa's mask), but float32 to an integer; others run through ATen."""
    src = args[0]
    if not (isinstance(src, Sym) and src.is_tensor):
        raise NotNative("a conversion of a non-tensor")
    example = lw.example(src)
    rest = lw.examples((args[1:], kwargs))
    if fn(example, *rest[0], **rest[1]) is example:
        return src
    if not isinstance(out, torch.Tensor) or src.meta.dtype not in LOOP_DTYPES or out.dtype not in LOOP_DTYPES:
        raise NotNative("a conversion that copies to or from a dtype other than float32, int32, int64 or bool")
    if out.dtype == torch.bool and src.meta.dtype != torch.bool:
        return lw.elementwise(Op.NE, (src, 0.0 if is_float32(src) else 0), out)
    if src.meta.dtype == torch.float32 and out.dtype != torch.float32:
        raise NotNative("a conversion of float32 to an integer (undefined in ATen for values out of range)")
    return lw.emit(Op.COPY, (src.name,), out)  # (or a copy asked for: copy=True, another layout)


def _attribute(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
    """getattr(x, "T") and its kin (TorchDynamo records Falcon's `weight.T` as a getattr call):
    the transposed view, for a tensor that is not complex (whose H and mH also conjugate)."""
    src, name = args[0], args[1] if len(args) == 2 else None
    if not (isinstance(src, Sym) and src.is_tensor and name in ("T", "mT", "H", "mH")):
        raise NotNative("an attribute that is not a transposed view")
    if src.meta.dtype.is_complex:
        raise NotNative("the conjugate transpose of a complex tensor")
    return lw.view(src, lambda t: getattr(t, name))


def _dropout(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Any:
    if isinstance(fn, torch.nn.Module):
        lw.reads_training.append(fn)  # the program is for this flag: the entry checks it
        training = fn.training
    else:
        training = kwargs.get("training", args[2] if len(args) > 2 else True)
    if training:
        raise NotNative("dropout in training mode is random")
    return args[0]


def _stochastic_depth(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Any:
    """torchvision's stochastic_depth(input, p, mode, training): its input itself when not
    training (or p is 0), as it returns it (torchvision's EfficientNet, ConvNeXt, Swin in eval)."""
    given = dict(zip(("input", "p", "mode", "training"), args)) | kwargs
    if given.get("training", True) and given["p"] != 0.0:
        raise NotNative("stochastic depth in training mode is random")
    return given["input"]


def _view_op(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
    src = args[0]
    if not isinstance(src, Sym) or not isinstance(out, torch.Tensor):
        raise NotNative("not a tensor view")
    given = [v for v in leaves((args[1:], kwargs)) if isinstance(v, Sym)]
    if given and getattr(fn, "__name__", None) not in _LAYOUT_OF:
        raise NotNative("a tensor's value decides the view")  # narrow(x, d, start_tensor, n)
    rest = lw.examples((args[1:], kwargs))
    return lw.view(src, lambda t: fn(t, *rest[0], **rest[1]))


def _views(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> tuple[Sym, ...]:
    """split, chunk, unbind (and their kin): a tuple of views of the input, each a VIEW."""
    src = args[0]
    if not isinstance(src, Sym) or not isinstance(out, (tuple, list)):
        raise NotNative("not views of a tensor")
    if any(isinstance(v, Sym) for v in leaves((args[1:], kwargs))):
        raise NotNative("a tensor's value decides the views")
    rest = lw.examples((args[1:], kwargs))
    return tuple(lw.view(src, lambda t, i=i: fn(t, *rest[0], **rest[1])[i]) for i in range(len(out)))


# Views whose other tensor argument only lends its shape.
_LAYOUT_OF = frozenset({"expand_as", "view_as", "reshape_as"})


def _getitem(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Any:
    src, idx = args
    if isinstance(src, (tuple, list)) and isinstance(idx, (int, slice)):
        return src[idx]  # one of split's views (an ATen call's tuple is a value of its own)
    items = idx if type(idx) is tuple else (idx,)  # a list index is advanced indexing: a copy
    basic = all(i is None or i is Ellipsis or isinstance(i, (int, slice)) for i in items)
    if isinstance(src, Sym) and src.is_tensor and basic and not any(isinstance(v, Sym) for v in leaves(items)):
        return lw.view(src, lambda t: t[idx])
    raise NotNative("indexing that is not a view")
