"""Convolution rows, and fast mode's fusions into its packed oneDNN calls. Exact mode computes a
1 x 1 convolution as braze's GEMM kernel and a depthwise one of channels-last pixels as
directconv's, each in the order ATen's path takes at its shape (found by a probe, docs/aten-
bits.md), and calls ATen's convolution for the others (oneDNN's, whose bits braze does not
reproduce); fast mode calls oneDNN's on a packed weight (fast.PackedConv), folds an eval
BatchNorm that follows it into that call, and makes an activation after a packed convolution or
linear the call's post-op. A 1 x 1 convolution of channels-last rows is a GEMM in fast mode."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.modules.utils import _pair

from .. import config, directconv, fast, gemmkernel, jit
from ..ir import Op
from . import gemm
from .core import Lowerer, NotNative, Sym, is_float32, no_out, plain_layer, to_meta

_CONV_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")


_EXACT = "exact mode: ATen's convolution (oneDNN's; its bits are not reproduced)"


def _conv2d(lw: Lowerer, fn: Any, args: tuple, kwargs: dict, out: Any) -> Sym:
    no_out(kwargs)
    if not lw.fast:
        if not _plain(fn) or kwargs or len(args) != 1:
            raise NotNative(_EXACT)
        # The layer's own call as torch.conv2d of its parameters: an ATen call that a native body
        # makes itself (codegen/calls.py), the layer's weights read and checked like any other's
        weight, bias = lw.weights(fn)
        why = _EXACT
        if (fn.kernel_size, fn.stride, fn.padding, fn.groups) == ((1, 1), (1, 1), (0, 0), 1):
            why = _exact_pointwise(lw, args[0], weight, bias, out)
        elif fn.groups == fn.in_channels == fn.out_channels and fn.dilation == (1, 1):
            why = _exact_depthwise(lw, args[0], weight, bias, fn, out)
        if isinstance(why, Sym):
            return why
        given = (args[0], weight, bias, fn.stride, fn.padding, fn.dilation, fn.groups)
        return lw.extern(torch.conv2d, given, {}, "torch.conv2d (a Conv2d layer's)", why, out)
    if isinstance(fn, torch.nn.Conv2d):
        if fn.padding_mode != "zeros":
            raise NotNative("convolution with padding other than zeros")
        weight, bias = lw.weights(fn)
        given = {"input": args[0], "weight": weight, "bias": bias}
        given |= {k: getattr(fn, k) for k in ("stride", "padding", "dilation", "groups")}
    else:
        given = dict(zip(_CONV_ARGS, args)) | kwargs
    x, w, b = given["input"], given["weight"], given.get("bias")
    padding = given.get("padding", 0)
    if not (is_float32(x) and is_float32(w) and (b is None or is_float32(b))) or x.meta.dim() != 4:
        raise NotNative("convolution of tensors that are not float32 (N, C, H, W)")
    if lw.ops.get(w.name) not in (Op.PARAM, Op.INPUT) or isinstance(padding, str):
        raise NotNative("convolution whose weight is not the model's, or with padding given by name")
    padding, stride = list(_pair(padding)), list(_pair(given.get("stride", 1)))
    groups, dilation = int(given.get("groups", 1)), list(_pair(given.get("dilation", 1)))
    if (
        pixel_rows(x.meta, out)
        and tuple(w.meta.shape[2:]) == (1, 1)
        and (padding, stride, groups) == ([0, 0], [1, 1], 1)
    ):
        return _pointwise(lw, x, w, b, out)
    direct = _direct(x, w, b, out, groups, dilation)
    if direct is not None:
        inputs = (x.name, w.name) + (() if b is None else (b.name,))
        window = {"kernel": tuple(w.meta.shape[2:]), "stride": tuple(stride), "padding": tuple(padding)}
        sym = lw.emit(Op.CONV, inputs, direct[0], depthwise=direct[1], **window)
        if direct[0] is not out:  # the example value in the layout computed (eager's is NCHW)
            real = F.conv2d(*lw.live((x, w, b)), stride=stride, padding=padding)
            lw.real[sym.name] = real.contiguous(memory_format=torch.channels_last)
        return sym
    winograd = _winograd(x, w, out, stride, dilation, groups)
    many = isinstance(out, torch.Tensor) and out.shape[0] * out.shape[2] * out.shape[3] >= WINOGRAD_PIXELS
    if not (winograd and many) and (product := _as_gemm(lw, x, w, b, out, (stride, padding, dilation, groups))):
        return product
    if winograd:
        packed: fast.PackedConv = fast.PackedWinograd(padding, stride, dilation, groups, list(x.meta.shape))
        why = "fast mode: Winograd's F(2 x 2, 3 x 3) (winograd.py), 2.25x fewer multiplications"
        label = "conv2d (Winograd, braze's kernel)"
    elif _small(x, w, out, groups):
        return _aten_conv(lw, (x, w, b, stride, padding, dilation, groups))
    else:
        pieces = _pieces(w)
        packed = fast.PackedConv(padding, stride, dilation, groups, list(x.meta.shape), pieces)
        why = "fast mode: oneDNN's convolution on a packed weight, channels-last"
        why += f", its input channels in {pieces} pieces (accuracy)" if pieces > 1 else ""
        label = "conv2d (oneDNN, packed weight)"
    # Its example value without packing, eager's: a batch_norm after it, folded into its weight,
    # has it packed again (fold_batch_norm; ResNet-18's 13 Winograd convolutions were transformed
    # 26 times); it is packed once the lowering ends, or when an op after it becomes part of it
    y = lw.eager_out
    if not (isinstance(y, torch.Tensor) and isinstance(out, torch.Tensor) and y.shape == out.shape):
        y = F.conv2d(*lw.live((x, w, b)), stride=stride, padding=padding, dilation=dilation, groups=groups)
    real = torch.empty(y.shape, memory_format=torch.channels_last).copy_(y)  # laid out as the call's
    sym = extern_of(lw, packed, (x, w, b), label, why, real)
    lw.deferred[sym.name] = lambda: packed(*lw.live((x, w, b)))
    return sym


# _as_gemm's patches take at most this many bytes: they are the input copied once per tap
# (ResNet-18's largest, 784 pixels by 3 x 3 x 64: 1.8 MB); a 7 x 7 of 64 channels over 112 x 112
# pixels would take 157 MB, scratch memory each program keeps, where oneDNN's call needs none
PATCHES_BYTES = 16 << 20


def _as_gemm(lw: Lowerer, x: Sym, w: Sym, b: Any, out: Any, window: tuple) -> Sym | None:
    """Fast mode: a convolution that oneDNN's packed call would compute in pieces (_pieces), or a
    1 x 1 one with a stride or padding (ResNet's downsampling), as one GEMM of its patches
    (Op.IM2COL) by its weight packed once (gemm.conv_gemm), K summed in blocks of
    CHANNELS_PER_PIECE channels' taps: the pieces' accuracy without their grouped call, and
    the kernel's speed. What follows it (bias, BatchNorm, ReLU, a residual) is the GEMM's
    epilogue. None where it is not such a convolution of channels-last pixels, or its patches
    would take more than PATCHES_BYTES."""
    stride, padding, dilation, groups = window
    o, c, kh, kw = w.meta.shape
    if groups != 1 or not (isinstance(out, torch.Tensor) and out.numel()):
        return None
    planes = _patchify(x, (kh, kw), window)
    pixels = x.meta.stride(1) == 1 and x.meta.permute(0, 2, 3, 1).is_contiguous()  # (one channel: any stride)
    pieces_or_strided = _pieces(w) > 1 or ((kh, kw) == (1, 1) and (stride, padding) != ([1, 1], [0, 0]))
    if not (planes or (pixels and pieces_or_strided)):
        return None
    n, _, oh, ow = out.shape
    if n * oh * ow * kh * kw * c * 4 > PATCHES_BYTES or not config.own_gemm:
        return None
    real = gemm.kept_weight(lw, w)
    if real is None:
        return None
    window_attrs = {"kernel": (kh, kw), "stride": tuple(stride), "padding": tuple(padding), "dilation": tuple(dilation)}
    meta = torch.empty(n * oh * ow, kh * kw * c, device="meta")
    patches = lw.emit(Op.IM2COL, (x.name,), meta, planes=planes, **window_attrs)
    unfolded = F.unfold(lw.example(x), (kh, kw), dilation, padding, stride)  # [N, C * KH * KW, OH * OW]
    if planes:  # K as the weight's [C, KH, KW] (unfold's), or tap by tap
        lw.real[patches.name] = unfolded.transpose(1, 2).reshape(n * oh * ow, -1)
    else:
        lw.real[patches.name] = unfolded.view(n, c, kh * kw, -1).permute(0, 3, 2, 1).reshape(n * oh * ow, -1)
    chunk = gemm.PACKED_CHUNK if planes else 0 if (kh, kw) == (1, 1) else kh * kw * CHANNELS_PER_PIECE
    product = gemm.conv_gemm(lw, patches, w, real, chunk, taps=not planes)
    layout = torch.empty(out.shape, device="meta", memory_format=torch.channels_last)
    y = lw.view(product, lambda t: t.as_strided(out.shape, layout.stride(), t.storage_offset()))
    if b is None:
        return y
    bias = lw.view(b, lambda t: t.view(-1, 1, 1))
    summed = lw.elementwise(Op.ADD, (y, bias), layout)
    # its example laid out as computed, not as eager's result (NCHW, where the image is): the
    # views after it are made on it
    lw.real[summed.name] = (lw.example(y) + lw.example(bias)).contiguous(memory_format=torch.channels_last)
    return summed


def _patchify(x: Sym, kernel: tuple[int, int], window: tuple) -> bool:
    """Whether a convolution of an NCHW image cuts it into patches: its kernel's stride, no
    padding or dilation (a ViT's stem; ConvNeXt's, of few channels, is directconv's). Its
    patches are then runs of KW pixels (Op.IM2COL's `planes`) and its product one GEMM, where
    oneDNN's call took the image into channels-last first."""
    stride, padding, dilation, _ = window
    nchw = x.meta.dim() == 4 and x.meta.is_contiguous() and x.meta.shape[1] > 1
    whole = list(kernel) == list(stride) and padding == [0, 0] and dilation == [1, 1]
    return nchw and whole and min(kernel) > 1  # (1 x 1: a value per copy, where oneDNN reorders once)


def _small(x: Sym, w: Sym, out: Any, groups: int) -> bool:
    """Whether this convolution is too small for oneDNN's packed call (fast.PACKED_CONV_MIN_MACS)
    and ATen computes it its own way (im2col and a GEMM), not with oneDNN on a weight reordered
    per call (slower than the packed call): one image of at most 20,480 values, one group, a
    kernel not larger than 3 x 3 both ways (ATen's `use_mkldnn`, Convolution.cpp; SegFormer's
    8 x 8 ones ran 0.87x so, ShuffleNet-V2's grouped ones 0.94x). Of channels-last pixels only,
    so that ATen's result is channels-last too, as the packed call's would be (on an NCHW input
    it is NCHW, and what follows converts it: SegFormer 0.84-0.91x)."""
    (n, *_), (kh, kw) = x.meta.shape, w.meta.shape[2:]
    if groups != 1 or n != 1 or x.meta.numel() > 20480 or (kh > 3 and kw > 3) or not isinstance(out, torch.Tensor):
        return False
    return (
        x.meta.permute(0, 2, 3, 1).is_contiguous()
        and out.numel() * math.prod(w.meta.shape[1:]) < fast.PACKED_CONV_MIN_MACS
    )


# oneDNN's packed convolution sums each output over all its input channels and taps in one
# chain; eager's of NCHW images (kernels larger than 1 x 1) sums blocks of 16 channels and adds
# those sums (bit for bit so at 3 of 5 shapes tried), so the packed call's error grows as about
# sqrt(channels / 16) times eager's at the RMS, more at the maximum: ResNet's 3 x 3 / 2 of 256
# channels 3.7x and 6.6x, of 512 4.9x and 6.5x; a 7 x 7 of 128 channels put a model outside the
# accuracy contract (2 images of 14-28 pixels square, /tmp scripts, 2026-12-06). Beyond this
# many channels a group, the call computes in pieces of at most this many (fast.PackedConv):
# 1.3-1.4x eager's RMS error and 1.1-1.8x its maximum, at 0.75-1.04x the one call's speed (64
# a piece: 1.9x and up to 3.3x). (Of a model eager runs channels-last the one call gives eager's
# own sums; the lowering's examples, in fast mode's layouts, do not say which it is.) _as_gemm's
# GEMMs sum K in blocks of this many channels' taps too: ResNet-18 (one image) ran 0.97x as fast
# in blocks of 16 channels (eager's), the same error as in pieces of 16 (/tmp script, 2026-12-06).
CHANNELS_PER_PIECE = 32


def _pieces(w: Sym) -> int:
    """How many pieces fast.PackedConv splits each group's input channels into: 1 for a 1 x 1
    kernel or CHANNELS_PER_PIECE channels or fewer; else the fewest that divide them into pieces
    of at most CHANNELS_PER_PIECE."""
    c, kernel = w.meta.shape[1], tuple(w.meta.shape[2:])
    if kernel == (1, 1) or c <= CHANNELS_PER_PIECE:
        return 1
    return next(s for s in range(-(-c // CHANNELS_PER_PIECE), c + 1) if c % s == 0)


def _aten_conv(lw: Lowerer, given: tuple) -> Sym:
    """Fast mode: a small convolution (_small) as ATen's own, on the channels-last input."""
    why = "fast mode: ATen's convolution; below ~1 M multiply-adds oneDNN's packed call costs more"
    return extern_of(lw, torch.conv2d, given, "torch.conv2d", why, torch.conv2d(*lw.live(given)))


# winograd.py's kernel from this many input and output channels: below, its transforms cost
# more than the multiplications it saves
WINOGRAD_CHANNELS = 16


# Below this many output pixels (all images') a convolution Winograd's kernel could take is a GEMM
# of its patches where _as_gemm takes it: for few tiles its transformed weight (16 / 9 of the
# weight), read from memory, costs more than the products it saves. (ResNet-18, one image, fast
# mode with its 512-channel 3 x 3s of 7 x 7 pixels as GEMMs: 1.028x as fast; with its 256-channel
# ones of 14 x 14 too, 0.975x; /tmp script, one process, interleaved, 15 rounds, 2026-12-06.)
WINOGRAD_PIXELS = 128


def _winograd(x: Sym, w: Sym, out: Any, stride: list[int], dilation: list[int], groups: int) -> bool:
    """Whether this convolution is winograd.py's: 3 x 3, stride 1, no dilation, one group, of
    channels-last pixels (what oneDNN's packed convolutions before it give) into some."""
    o, c = w.meta.shape[:2]
    if tuple(w.meta.shape[2:]) != (3, 3) or (stride, dilation, groups) != ([1, 1], [1, 1], 1):
        return False
    return min(c, o) >= WINOGRAD_CHANNELS and x.meta.permute(0, 2, 3, 1).is_contiguous() and out.numel() > 0


def _exact_input(x: Any, out: Any) -> str | None:
    """Why exact mode's native convolutions do not take this one, whatever its kind, or None."""
    if not config.own_gemm:
        return _EXACT + "; a generic program's sizes may change the path it takes"
    if not (isinstance(x, Sym) and is_float32(x) and x.meta.dim() == 4 and isinstance(out, torch.Tensor)):
        return _EXACT
    return None


def _exact_pointwise(lw: Lowerer, x: Any, w: Sym, b: Sym | None, out: Any) -> Sym | str:
    """Exact mode: a 1 x 1 convolution as the product ATen's path computes, where a probe at its
    shape found which (pointwise_order): of NCHW images, W [OC, IC] @ X [IC, H*W] (+ the bias
    per row) per image, MKL's (ATen's slow_conv2d: the bias copied in, then sgemm_; for one image)
    or oneDNN's; of channels-last pixels, rows [N*H*W, IC] @ W.T (+ the bias row), oneDNN's.
    oneDNN's orders are gemmkernel's (gemmkernel.order_of). Else why it stays ATen's call."""
    refused = _exact_input(x, out)
    if refused:
        return refused
    nchw = x.meta.is_contiguous() and out.is_contiguous()
    if not (nchw or pixel_rows(x.meta, out)) or not w.meta.is_contiguous():
        return _EXACT + "; a 1 x 1 one is native for contiguous NCHW images or channels-last pixels"
    (n, ic, h, wd), oc = x.meta.shape, w.meta.shape[0]
    order = pointwise_order(n, oc, ic, h, wd, b is not None, nchw)
    if order is None:
        return _EXACT + "; at this shape a probe found none of the orders braze has"
    weight = lw.view(w, lambda t: t.view(oc, ic))
    if nchw:  # the images' products one under another: [N*OC, H*W] (eager's NCHW result)
        operands = (weight, lw.view(x, lambda t: t.view(n * ic, h * wd)))
        meta = torch.empty(n * oc, h * wd, device="meta")
    else:
        operands = (lw.view(x, lambda t: t.permute(0, 2, 3, 1).reshape(-1, ic)), lw.view(weight, torch.t))
        meta = torch.empty(n * h * wd, oc, device="meta")
    if order == MKL:
        bias = None if b is None else lw.view(b, lambda t: t.view(oc, 1))
        product = gemm._gemm(lw, *operands, bias, 1.0, convolution=True)  # (the entry checks oneDNN's flag)
    else:
        # The kernel's arguments as BLAS's swapped call names them (m columns, n rows, k depth; an
        # NCHW image's [OC, H*W] product of its [IC, H*W] pixels, codegen running each image's
        # rows in turn; channels-last rows by linear's [OC, IC] weight), whatever BLAS would take
        # for degenerate sizes (a 1 x 1 image's one column)
        pixels = h * wd
        blas = {"swap": True, "tb": False, "k": ic, "ldb": ic}
        if nchw:
            blas |= {"ta": False, "m": pixels, "n": oc, "lda": pixels, "ldc": pixels}
        else:
            blas |= {"ta": True, "m": oc, "n": n * pixels, "lda": ic, "ldc": oc}
        inputs = (operands[0].name, operands[1].name, None if b is None else b.name)
        attrs = {"beta": 0.0, "blas": blas, "own_kernel": 1, "one_thread": False, "order": order, "convolution": True}
        product = lw.emit(Op.GEMM, inputs, meta, images=n if nchw else 1, **attrs)
    return lw.view(product, lambda t: t.view(out.shape) if nchw else t.view(n, h, wd, oc).permute(0, 3, 1, 2))


def _exact_depthwise(lw: Lowerer, x: Any, w: Sym, b: Sym | None, layer: torch.nn.Conv2d, out: Any) -> Sym | str:
    """Exact mode: a depthwise convolution of channels-last pixels as directconv's kernel with the
    bias added to the sums (oneDNN's order there: each output an FMA chain over the taps inside
    the image, in order), where a probe at its shape agrees (depthwise_same). Else why not."""
    refused = _exact_input(x, out)
    if refused:
        return refused
    if not pixel_rows(x.meta, out) or not w.meta.is_contiguous():
        return _EXACT + "; a depthwise one is native on channels-last pixels"
    window = {"kernel": layer.kernel_size, "stride": layer.stride, "padding": layer.padding}
    if not depthwise_same(tuple(x.meta.shape), b is not None, *window.values()):
        return _EXACT + "; at this shape a probe found another order"
    inputs = (x.name, w.name) + (() if b is None else (b.name,))
    return lw.emit(Op.CONV, inputs, out, depthwise=True, bias_last=True, convolution=True, **window)


def depthwise_same(shape: tuple[int, ...], bias: bool, kernel: tuple, stride: tuple, padding: tuple) -> bool:
    """Whether directconv's depthwise kernel, the bias added last, gives eager's bits on
    channels-last pixels of this shape (random values, NaN, infinities, -0, a denormal). Once per
    process, shape, window, thread count and oneDNN flag."""
    return _depthwise_same(shape, bias, tuple(kernel), tuple(stride), tuple(padding), *_settings())


@functools.cache
def _depthwise_same(
    shape: tuple, bias: bool, kernel: tuple, stride: tuple, padding: tuple, threads: tuple[int, int], mkldnn: bool
) -> bool:
    gen = torch.Generator().manual_seed(0)
    x = _probe_input(shape, gen).contiguous(memory_format=torch.channels_last)
    weight = torch.randn(shape[1], 1, *kernel, generator=gen)
    b = torch.randn(shape[1], generator=gen) if bias else None
    eager = F.conv2d(x, weight, b, stride, padding, groups=shape[1])
    ours = directconv.conv2d(x, weight, b, stride, padding, bias_last=True)
    return jit.same_bits(ours, eager, nan_payloads=False)


def _probe_input(shape: tuple, gen: torch.Generator) -> torch.Tensor:
    """Random values of `shape`, the first ones gemmkernel's special values (its probe's)."""
    x = torch.randn(*shape, generator=gen)
    count = min(x.numel(), len(gemmkernel.SPECIAL))
    x.view(-1)[:count] = torch.tensor(gemmkernel.SPECIAL[:count])
    return x


MKL = (False, 0)  # pointwise_order: ATen's slow_conv2d (the bias per row copied in, then sgemm_)


def pointwise_order(n: int, oc: int, ic: int, h: int, w: int, bias: bool, nchw: bool) -> tuple[bool, int] | None:
    """How ATen computes a 1 x 1 convolution at this shape and layout (its path depends on the
    sizes, the thread count and whether oneDNN is enabled, all in the key): MKL, a (seeded,
    chunk) order of gemmkernel's, or None where none gives its bits (on random values and
    NaN, infinities, -0 and a denormal)."""
    return _pointwise_order(n, oc, ic, h, w, bias, nchw, *_settings())


def _settings() -> tuple[tuple[int, int], bool]:
    """What ATen's path for a convolution depends on beside its shape, the probes' cache key: the
    thread counts (MKL's and ATen's: torch sets both) and whether oneDNN is enabled."""
    return (jit.mkl_threads(), torch.get_num_threads()), torch.backends.mkldnn.enabled


@functools.cache
def _pointwise_order(
    n: int, oc: int, ic: int, h: int, w: int, bias: bool, nchw: bool, threads: tuple[int, int], mkldnn: bool
) -> tuple[bool, int] | None:
    if ic < gemmkernel.MIN_K:
        return None
    gen = torch.Generator().manual_seed(0)
    x = _probe_input((n, ic, h, w), gen)
    if not nchw:
        x = x.contiguous(memory_format=torch.channels_last)
    weight = torch.randn(oc, ic, 1, 1, generator=gen) * 0.1
    b = torch.randn(oc, generator=gen) if bias else None
    eager, w2 = F.conv2d(x, weight, b), weight.view(oc, ic)
    if not nchw:
        return gemmkernel.order_of(
            eager.permute(0, 2, 3, 1).reshape(-1, oc), x.permute(0, 2, 3, 1).reshape(-1, ic), w2, b, True
        )
    eager, x = eager.view(n, oc, h * w), x.view(n, ic, h * w)
    if n == 1:  # (several images: oneDNN's orders only)
        mkl = torch.mm(w2, x[0]) if b is None else torch.addmm(b.view(oc, 1), w2, x[0])
        if jit.same_bits(mkl, eager[0], nan_payloads=False):
            return MKL
    order = gemmkernel.order_of(eager[0], w2, x[0], b, False)  # then the same on every image

    def same(i: int) -> bool:
        ours = gemmkernel.gemm(w2, x[i], b, chunk=order[1], seeded=order[0])
        return jit.same_bits(ours, eager[i], nan_payloads=False)

    return order if order is not None and all(same(i) for i in range(1, n)) else None


def _plain(layer: Any) -> bool:
    """An nn.Conv2d whose call is torch.conv2d of its own parameters and settings: its class's
    forward, zeros padding given by numbers, no parametrized weight."""
    return (
        plain_layer(layer, torch.nn.Conv2d)
        and type(layer)._conv_forward is torch.nn.Conv2d._conv_forward
        and layer.padding_mode == "zeros"
        and not isinstance(layer.padding, str)
    )


def pixel_rows(x: torch.Tensor, out: Any) -> bool:
    """Whether x and the result are channels-last rows, one per pixel: [N*H*W, C] matrices."""
    rows = [t.permute(0, 2, 3, 1) for t in (x, out) if isinstance(t, torch.Tensor) and t.dim() == 4]
    return len(rows) == 2 and all(r.is_contiguous() for r in rows)


# directconv.py takes an NCHW input of up to FEW_CHANNELS channels into output rows at least
# FEW_WIDTH wide: its blocks of 8 pixels run at 100-140 GFLOP/s a thread, its lone pixels (past
# a row's last block) far slower. (On one thread against oneDNN's call on two: MobileNet-V3's
# 3 x 3 stem 111 vs 147 us, cnn-small's 445 vs 719, ConvNeXt's 4 x 4 patches 111 vs 136,
# ResNet's 7 x 7 1680 vs 824: even on two; ViT's 16 x 16 patches, 14 a row, 770 vs 276.)
FEW_CHANNELS = 4
FEW_WIDTH = 32
# directconv.py keeps a group's filters on the stack of the thread that runs it (4 vectors of 64
# bytes a tap): a depthwise kernel of more taps (31 x 31 is 961) stays oneDNN's call, so that
# no thread's stack holds more than 256 KB of them (a 127 x 127 kernel would need 4 MB).
DEPTHWISE_TAPS = 1024


def _direct(x: Sym, w: Sym, b: Any, out: Any, groups: int, dilation: list[int]) -> tuple[torch.Tensor, bool] | None:
    """(the channels-last result's layout, whether depthwise) where this convolution is
    directconv.py's (no dilation, contiguous weight and bias): depthwise (one filter per
    channel) on channels-last pixels, or of up to FEW_CHANNELS input channels on an NCHW input
    into rows of FEW_WIDTH pixels or more.

    Depthwise ones are the kernel's at every size (of at most DEPTHWISE_TAPS taps). Up to
    2026-12-07 only to 8 MFLOP, measured as oneDNN's call running ~200 GFLOP/s against the
    kernel's ~120; measured again then (2 cores of an Intel Xeon, a 1 x 1 convolution, the
    depthwise one and a residual add, fast mode with and without the kernel, one process, 21
    rounds) the kernel's programs ran 1.09-2.57x as fast at 5-87 MFLOP (3 x 3, 5 x 5 and 7 x 7;
    14 x 14 to 224 x 224 pixels; 32-768 channels), and ConvNeXt-atto, whose two 12 MFLOP ones
    were oneDNN's calls in a Python body, 1.06x."""
    c = x.meta.shape[1]
    if dilation != [1, 1] or not w.meta.is_contiguous() or not (b is None or b.meta.is_contiguous()):
        return None
    depthwise = groups == c == w.meta.shape[0] and w.meta.shape[1] == 1
    if depthwise and pixel_rows(x.meta, out) and math.prod(w.meta.shape[2:]) <= DEPTHWISE_TAPS:
        return out, True
    if groups == 1 and c <= FEW_CHANNELS and out.shape[-1] >= FEW_WIDTH and x.meta.is_contiguous():
        return torch.empty(out.shape, device="meta").contiguous(memory_format=torch.channels_last), False
    return None


def _pointwise(lw: Lowerer, x: Sym, w: Sym, b: Any, out: torch.Tensor) -> Sym:
    """Fast mode: a 1 x 1 convolution (stride 1, no padding, one group) of channels-last pixel
    rows is the GEMM of those rows by the weight, through gemm.py's linear: MKL's sgemm_ (the
    weight is a view of the model's here, which oneDNN's packing does not take). What follows
    (BatchNorm, activations) are braze's elementwise kernels. At MobileNet-V3's sizes a oneDNN
    convolution call costs ~40 us, most of it the call: 1 x 1 convolutions are 41 of its 52."""
    if not is_float32(w) or not w.meta.is_contiguous():
        raise NotNative("1 x 1 convolution of a weight that is not contiguous float32")
    rows = lw.view(x, lambda t: t.permute(0, 2, 3, 1).reshape(-1, t.shape[1]))
    weight = lw.view(w, lambda t: t.view(t.shape[0], t.shape[1]))
    product = gemm._linear(lw, F.linear, (rows, weight, b), {}, None)
    # eager's layout: channels-last (size-1 dimensions' strides as eager has them)
    return lw.view(product, lambda t: t.as_strided(out.shape, out.stride(), t.storage_offset()))


def extern_of(lw: Lowerer, fn: Any, args: tuple, label: str, why: str, real: torch.Tensor) -> Sym:
    """An ATen call of `fn` on args whose example value is `real`: what it gives on lw's examples
    and the model's own weights (a packed call's packing them: see Lowerer.live), laid out as
    the call's result, which fast mode's calls lay out otherwise than eager's."""
    sym = lw.extern(fn, args, {}, label, why, to_meta(real))
    lw.real[sym.name] = real
    return sym


def packed_call(lw: Lowerer, x: Any, kind: type = fast.Packed) -> int | None:
    """Fast mode: the index in lw.nodes of the packed oneDNN call (of `kind`, without a post-op)
    that computes x, if nothing else reads x (what follows can then become part of the call)."""
    if not (lw.fast and isinstance(x, Sym) and lw.users.get(x.name) == 1):
        return None
    for i in range(len(lw.nodes) - 1, -1, -1):
        node = lw.nodes[i]
        if node.name == x.name:
            fn = node.attrs.get("fn") if node.op is Op.EXTERN else None
            return i if isinstance(fn, kind) and fn.post_op == fast.Packed.post_op else None
    return None


def fold_batch_norm(lw: Lowerer, at: int, bn: tuple[Sym, Sym, Sym, Sym], eps: float) -> Sym:
    """The packed convolution lw.nodes[at] with an eval batch_norm of its result folded in."""
    node = lw.nodes[at]
    fn = node.attrs["fn"]
    if not isinstance(fn, fast.PackedConv) or fn.eps is not None:
        raise NotNative("a second batch_norm after one convolution")
    fn.eps = eps
    args = (*node.attrs["args"], *bn)
    return _replace(lw, at, args, "+ batch_norm folded into its weight (float64)")


def fuse_residual(lw: Lowerer, x: Any, other: Any, out: Any) -> Sym | None:
    """Fast mode: x + other as part of the Winograd convolution that computes x, where nothing else
    reads x and other is float32 channels-last pixels of x's shape (a residual connection); else None."""
    at = packed_call(lw, x, fast.PackedWinograd)
    if at is None or not (isinstance(other, Sym) and is_float32(other) and isinstance(out, torch.Tensor)):
        return None
    if other.meta.shape != x.meta.shape or out.shape != x.meta.shape or not pixel_rows(other.meta, out):
        return None
    fn = lw.nodes[at].attrs["fn"]
    if fn.residual:
        return None
    fn.residual = True
    return _replace(lw, at, (*lw.nodes[at].attrs["args"], other), "+ the addition after it")


def fuse_post_op(lw: Lowerer, at: int, attr: str, algorithm: str = "") -> Sym:
    """The packed call lw.nodes[at] with an activation of its result as oneDNN's post-op."""
    lw.nodes[at].attrs["fn"].post_op = (attr, algorithm)
    return _replace(lw, at, lw.nodes[at].attrs["args"], f"+ {attr} {algorithm}".rstrip() + " as its post-op")


def _replace(lw: Lowerer, at: int, args: tuple, more: str) -> Sym:
    node = lw.nodes[at]
    why = f"{node.attrs['why']} {more}"
    inputs = tuple(dict.fromkeys(a.name for a in args if isinstance(a, Sym)))
    # last: after the nodes of its new operands (nothing read its result yet)
    del lw.nodes[at]
    lw.nodes.append(dataclasses.replace(node, inputs=inputs, attrs={**node.attrs, "args": args, "why": why}))
    lw.deferred.pop(node.name, None)
    real = node.attrs["fn"](*lw.live(args))
    lw.real[node.name] = real
    return Sym(node.name, to_meta(real))
