"""Fast mode (`braze.compile(model, mode="fast")`): library kernels faster than the ones eager
calls, within an accuracy contract (accuracy.py) instead of eager's bits.

    linear   oneDNN's GEMM on a weight packed for it (mkldnn::_linear_pointwise), where it beats
             MKL's sgemm at the layer's shape: both are timed once, when compiling (MKL takes a
             generic path on this AMD CPU; oneDNN ran 1.3-1.7x faster at 256 x 128..4096 here)
    conv2d   oneDNN's convolution on a packed weight (mkldnn::_convolution_pointwise), channels-
             last activations, an eval BatchNorm after it folded into its weight and bias (in
             float64) (cnn-small: 1.6-1.8x eager, `braze bench`)

    1 x 1    a 1 x 1 convolution of channels-last pixels is instead braze's GEMM (MKL's sgemm_)
             of those rows (lowering/conv.py): at MobileNet-V3's sizes a oneDNN call costs ~40 us,
             most of it the call; their global average pool, a GEMM of ones (lowering/pool.py)
    direct   a depthwise convolution of channels-last pixels up to 8 MFLOP, and one of an NCHW
             input of up to 4 channels (a network's first): braze's kernels (directconv.py)
    3 x 3    one of stride 1 and 16+ channels on channels-last pixels: Winograd's F(2 x 2, 3 x 3),
             braze's kernel (winograd.py, PackedWinograd) on the weight transformed once, with
             the ReLU and a residual addition after it
    sdpa     attention (causal or masked, not dropout): braze's kernel (attention.py)
    GEMM     braze's GEMM kernel (exact mode's) on linear's weight packed once (GemmPack), where
             exact mode packs it on every call; one packed again more than REPACKS times is
             read in place from then on

An activation after a packed call (gelu, silu, sigmoid) becomes oneDNN's post-op of the call; ReLU
does not (oneDNN's makes NaN 0, where eager's keeps it), but is part of winograd.py's kernel.

A packed weight is made again whenever a tensor it was made from is another tensor, moved, or
changed in place (`_version`): never a stale answer. (A change through `.data`, which bumps
another tensor's version, is not seen.)
"""

from __future__ import annotations

import time
import weakref
from typing import Any

import torch

from . import gemmkernel, jit, winograd

MIN_SPEEDUP = 1.05  # what the packed GEMM must win by to be chosen (timing noise)
# What an ATen call inside a program costs beyond a native GEMM's sgemm_ call: its line of the
# Python body, ATen's dispatch, oneDNN's primitive lookup, and the fusion it prevents (measured:
# on bert-tiny's 256 x 128 x 128..512 GEMMs, each timed 1.4x faster alone, the model ran 12% slower).
CALL_COST_S = 25e-6
# Smaller GEMMs stay MKL's without timing. Timed alone, oneDNN's packed GEMM often wins at the
# text models' sizes, but inside them it lost (`braze bench`, one run each: BERT at 128 x 256 ->
# 1024, 33.5 M multiply-adds, chose it and ran 1.14x eager against exact mode's 1.27x;
# `bert-tiny`'s 16.8 M and `gpt2-tiny`'s 67 M likewise), while `mlp-wide`'s 1.07 G won (1.16x
# against 1.02x). What loses in a model that wins alone (caches, the call, the fusion it
# prevents) is not measured per GEMM; below this size the choice is not made.
PACKED_MIN_MACS = 2**28
# A convolution below this many multiply-adds stays ATen's own (eager's arithmetic, called from
# native code): oneDNN's packed call costs ~30 us at the least (its primitive looked up per call),
# where ATen's takes 7-26 us up to ~0.6 M (one image, 3 x 3 and 1 x 1 at 8-16 pixels, 1 and 2
# threads, channels-last input: 0.61-0.80x the packed call's time; 1.2-2.4 M: 0.8-1.14x; 4.7 M and
# up: 1.14-1.8x; 2 cores of an Intel Xeon, 2026-12-06). Hugging Face's small ResNet config (one
# 32 x 32 image) ran 1.56-1.68x as fast so (fast mode 1.43-1.47x eager before, exact mode 2.46x).
PACKED_CONV_MIN_MACS = 2**20


def _stamp(tensors: tuple[Any, ...]) -> tuple[Any, ...]:
    """What identifies the tensors' values: the objects, their versions and addresses."""
    return tuple((t, t._version, t.data_ptr()) if isinstance(t, torch.Tensor) else (t,) for t in tensors)


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return len(a) == len(b) and all(x[0] is y[0] and x[1:] == y[1:] for x, y in zip(a, b))


class Packed:
    """A oneDNN call on a weight packed for it, with `post_op` (oneDNN's unary attr and algorithm:
    relu, gelu none/tanh, swish, sigmoid) applied to its result in the same call."""

    post_op: tuple[str, str] = ("none", "")
    _state: tuple[Any, ...] = ((),)  # (the stamps of the tensors packed from, what _pack made of them...)

    def _packed(self, tensors: tuple[Any, ...]) -> tuple[Any, ...]:
        """What _pack made of `tensors`, made again if any of them is another tensor, moved, or
        changed in place since."""
        state = self._state  # one read: another thread may repack meanwhile
        if not _same(state[0], _stamp(tensors)):
            state = (_stamp(tensors), *self._pack(*tensors))
            self._state = state
        return state[1:]

    def _pack(self, *tensors: Any) -> tuple[Any, ...]:
        raise NotImplementedError

    def takes(self, attr: str) -> bool:
        """Whether the activation `attr` can become part of the call: oneDNN's post-ops but ReLU,
        which makes NaN 0 (a convolution's and a linear's, measured), where eager's keeps it."""
        return attr != "relu"

    def generic_key(self) -> tuple[Any, ...]:
        """What a program's result depends on, not the sizes the weight is packed for: lowerings at
        other sizes whose calls have equal keys can share one shape-generic program."""
        return (type(self).__name__, self.post_op, *self._config())

    def _config(self) -> tuple[Any, ...]:
        return ()


class PackedLinear(Packed):
    """`linear(x, w, b)` (`addmm(b, x, w)` if transposed) through oneDNN on w packed once (and
    again when w changes)."""

    __name__ = "packed_linear"  # a label for explain and the program's Python body

    def __init__(self, rows: int, transposed: bool = False) -> None:
        self.rows = rows  # the batch oneDNN packs for (any other works, maybe slower)
        self.transposed = transposed  # w given as [in, out] (addmm's, GPT-2's Conv1D), not linear's

    def _config(self) -> tuple[Any, ...]:
        return (self.transposed,)

    def __call__(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        (packed,) = self._packed((w,))
        attr, algorithm = self.post_op
        return torch.ops.mkldnn._linear_pointwise(x, packed, b, attr, [], algorithm)

    def _pack(self, w: torch.Tensor) -> tuple[torch.Tensor]:
        weight = w.detach().t() if self.transposed else w.detach()
        return (torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), self.rows),)


class PackedConv(Packed):
    """`conv2d(x, w, b)`, then eval batch_norm(mean, var, gamma, beta) if given (folded into w and
    b in float64), through oneDNN on the folded weight packed once (and again when any tensor it
    came from changes). Its result is channels-last.

    With `pieces` > 1, each group's input channels are split into that many pieces: one call of
    groups * pieces groups (the pieces' weights side by side) gives each piece's sums, added
    after. oneDNN sums an output over all its channels and taps in one chain, where eager's
    convolution of NCHW images sums 16 channels at a time: the pieces keep fast mode's error
    near eager's (lowering.conv.CHANNELS_PER_PIECE)."""

    __name__ = "packed_conv2d"

    def __init__(
        self, padding: list[int], stride: list[int], dilation: list[int], groups: int, size: list[int], pieces: int = 1
    ):
        self.padding, self.stride, self.dilation, self.groups = padding, stride, dilation, groups
        self.size = size  # the input size oneDNN packs for (others work, maybe slower)
        self.pieces = pieces
        self.eps: float | None = None  # batch_norm's, once one is folded in
        self.residual = False  # a tensor added to the result is the call's last argument (Winograd's)

    def _config(self) -> tuple[Any, ...]:
        return (self.padding, self.stride, self.dilation, self.groups, self.pieces, self.eps, self.residual)

    def takes(self, attr: str) -> bool:
        return self.pieces == 1 and super().takes(attr)  # (in pieces, an activation follows the sum)

    def __call__(self, x: torch.Tensor, *params: torch.Tensor | None) -> torch.Tensor:
        w, b = self._packed(params)
        attr, algorithm = self.post_op
        args = (self.padding, self.stride, self.dilation, self.groups * self.pieces, attr, [], algorithm)
        y = torch.ops.mkldnn._convolution_pointwise(x, w, b, *args)
        if self.pieces == 1:
            return y
        n, _, oh, ow = y.shape
        sums = y.permute(0, 2, 3, 1).reshape(n, oh, ow, self.groups, self.pieces, -1).sum(4)
        return sums.view(n, oh, ow, -1).permute(0, 3, 1, 2)

    def _pack(self, w: torch.Tensor, b: torch.Tensor | None, *bn: torch.Tensor) -> tuple[torch.Tensor, Any]:
        w, b = self._folded(w, b, *bn)
        if self.pieces > 1:
            w, b = self._in_pieces(w, b)
        args = (self.padding, self.stride, self.dilation, self.groups * self.pieces, self.size)
        return torch.ops.mkldnn._reorder_convolution_weight(w.contiguous(), *args), b

    def _in_pieces(self, w: torch.Tensor, b: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The weight of groups * pieces groups, [group, piece, output, channels of the piece, kh,
        kw], and its bias: each group's bias in its first piece, 0 in the others."""
        o, c, kh, kw = w.shape
        g, s = self.groups, self.pieces
        w = w.view(g, o // g, s, c // s, kh, kw).transpose(1, 2).reshape(g * s * (o // g), c // s, kh, kw)
        bias = torch.zeros(g, s, o // g)
        if b is not None:
            bias[:, 0] = b.view(g, o // g)
        return w, bias.view(-1)

    def _folded(self, w: torch.Tensor, b: torch.Tensor | None, *bn: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """The weight and bias with the batch_norm after the convolution (if any) folded in."""
        w = w.detach()
        if not bn:
            return w, None if b is None else b.detach()
        mean, var, gamma, beta = (t.detach().double() for t in bn)
        scale = gamma / torch.sqrt(var + self.eps)
        shift = beta - mean * scale + (0.0 if b is None else b.detach().double() * scale)
        return (w.double() * scale.view(-1, *[1] * (w.dim() - 1))).float(), shift.float()


class PackedWinograd(PackedConv):
    """A 3 x 3 convolution (stride 1, one group) of channels-last pixels as winograd.py's kernel,
    on the weight (BatchNorm folded in) transformed and packed once; ReLU its one post-op; a
    tensor added to its result (a residual connection) part of the call too."""

    __name__ = "winograd_conv2d"

    def takes(self, attr: str) -> bool:
        return attr == "relu"

    def __call__(self, x: torch.Tensor, *params: torch.Tensor | None) -> torch.Tensor:
        addend = params[-1] if self.residual else None
        u, b, w = self._packed(params[:-1] if self.residual else params)
        relu = self.post_op[0] == "relu"
        y = winograd.conv2d(x, u, b, self.padding, relu, addend)
        if y is None:  # an output not finite (where eager's would be, the direct way finds), or no scratch
            y = torch.nn.functional.conv2d(x, w, b, padding=self.padding)
            y = y if addend is None else y + addend
            y = (torch.relu(y) if relu else y).contiguous(memory_format=torch.channels_last)
        return y

    def _pack(self, w: torch.Tensor, b: torch.Tensor | None, *bn: torch.Tensor) -> tuple[torch.Tensor, ...]:
        w, b = self._folded(w, b, *bn)
        b = torch.zeros(w.shape[0]) if b is None else b.float().contiguous()
        return winograd.transformed(w), b, w


REPACKS = 8  # a GemmPack packed again more often keeps changing: its weight is read in place
_UNSTEADY: dict[int, weakref.ref] = {}  # such weights, by id


def unsteady(weight: torch.Tensor) -> None:
    """Pack `weight` no more (programs compiled from now on read it in place)."""
    key = id(weight)
    _UNSTEADY[key] = weakref.ref(weight, lambda _: _UNSTEADY.pop(key, None))


def steady(weight: torch.Tensor) -> bool:
    ref = _UNSTEADY.get(id(weight))
    return ref is None or ref() is not weight


class GemmPack:
    """Linear's weight [N, K] packed once for braze's GEMM kernel (gemmkernel.pack), and what it
    was packed from: the tensor (held, so that no other takes its address), its data pointer,
    version counter and count. The entry compares them on every call (a mismatch misses, and
    Program.rearm packs again); the panels are made when the program is built, into memory
    whose address its code holds. (A weight changed while another thread runs the program is
    read half old, half new, as eager's GEMM would read it.)"""

    def __init__(self, weight: torch.Tensor, taps: bool = False, transposed: bool = False) -> None:
        self.layout = (tuple(weight.shape), weight.stride())  # a 1 x 1 convolution's [N, C, 1, 1] too
        rows = weight.shape[-1] if transposed else weight.shape[0]
        self.shape = (rows, weight.numel() // max(rows, 1))
        self.taps = taps  # a convolution's weight [O, C, KH, KW], K taken tap by tap: (kh, kw, c)
        self.transposed = transposed  # a [K, N] weight (GPT-2's Conv1D: addmm(bias, x, weight))
        self.depth = gemmkernel.packed_depth(self.shape[1])
        self.panels: torch.Tensor | None = None
        self.stamp: tuple[Any, ...] = (weight,)  # (what `address` packs from first)
        self.repacks = 0  # packed again since the first time (Program.rearm: the weight changed)

    def __repr__(self) -> str:
        form = ", taps" if self.taps else ", transposed" if self.transposed else ""
        return f"GemmPack({self.shape[0]}x{self.shape[1]}{form})"

    def generic_key(self) -> tuple[Any, ...]:
        """One pack serves every size of a generic program (its rows vary, not its weight)."""
        return ("GemmPack", self.shape, self.taps, self.transposed)

    def address(self) -> int:
        """Where the panels are (packed the first time: a program is built only from the packs
        it uses)."""
        if self.panels is None:
            self.panels = torch.empty(gemmkernel.packed_numel(*self.shape))
            self.repack(self.stamp[0])
        assert self.panels is not None
        return self.panels.data_ptr()

    def stale(self, weight: torch.Tensor) -> bool:
        return self.stamp[0] is not weight or self.stamp != stamp(weight)

    def fits(self, weight: torch.Tensor) -> bool:
        return (tuple(weight.shape), weight.stride()) == self.layout and jit.tensor_version(weight) is not None

    def repack(self, weight: torch.Tensor) -> None:
        """Pack `weight` (one that fits) into the panels."""
        assert self.panels is not None
        w = weight.detach()
        with torch.no_grad():
            rows = w.permute(0, 2, 3, 1) if self.taps else w.t() if self.transposed else w
            gemmkernel.pack(rows.reshape(self.shape), self.panels)
        if len(self.stamp) > 1:  # (not the first packing)
            self.repacks += 1
        self.stamp = stamp(weight)


def stamp(weight: torch.Tensor) -> tuple[Any, ...]:
    """(weight, data pointer, version counter, count): the entry's words for a GemmPack; the
    weight alone where it has no counter (an inference tensor: no pack fits it)."""
    return (weight, weight.data_ptr(), *(jit.tensor_version(weight) or ()))


def packed_linear(packed: PackedLinear, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> Any:
    """packed(x, w, b) where oneDNN's packed GEMM beats ATen's linear (MKL) at x's rows by w, else
    None: from PACKED_MIN_MACS up, timed once per shape, layout and thread count, on these tensors (the program's own
    weight: `packed` keeps what it packed, which the program's first call then finds in place)."""
    if x.numel() // max(x.shape[-1], 1) * w.numel() < PACKED_MIN_MACS:
        return None
    key = (x.numel() // max(x.shape[-1], 1), *w.shape, b is not None, packed.transposed, torch.get_num_threads())
    out = None
    if key not in _TIMED:
        _TIMED[key], out = _timed(packed, x, w, b) if x.numel() * w.numel() else (False, None)
    if not _TIMED[key]:
        return None
    return packed(x, w, b) if out is None else out


_TIMED: dict[tuple[Any, ...], bool] = {}


def _timed(packed: PackedLinear, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> tuple[bool, Any]:
    """Whether oneDNN won both of two interleaved pairs of calls after the one that packs (a pair
    costs two GEMMs: 16 ms at mlp-wide's sizes), and its last result. Where the pairs disagree
    the two are within the timing's noise of each other, and MKL's GEMM (eager's) stays."""
    weight = w.t() if packed.transposed else w  # linear(x, w.t(), b) is addmm(b, x, w)
    wins = []
    with torch.no_grad():
        out = packed(x, w, b)  # packs
        for _ in range(2):
            t0 = time.perf_counter()
            torch.nn.functional.linear(x, weight, b)
            t1 = time.perf_counter()
            out = packed(x, w, b)
            wins.append(t1 - t0 >= MIN_SPEEDUP * (time.perf_counter() - t1 + CALL_COST_S))
    return all(wins), out
