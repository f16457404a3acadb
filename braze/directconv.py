"""Direct convolutions, into channels-last outputs: native kernels built once per process into the
JIT, called by programs (fast mode's; and exact mode's depthwise ones of channels-last pixels,
where the taps' order is oneDNN's and the bias is added last). Zero padding and strides of any
size, no dilation.

    braze_depthwise_conv2d(x, w, bias, y, h, w_, c, oh, ow, kh, kw, sh, sw, ph, pw, has_bias, lo, hi)
        depthwise (one filter per channel): output rows lo..hi (image * oh + row) of y
        [N, OH, OW, C] from channels-last x [N, H, W, C] and the model's weight [C, 1, KH, KW];
        bias [C] where has_bias: 1, the sums start at it; 2, it is added to them (eager's
        order on channels-last pixels, oneDNN's depthwise kernel: exact mode)
    braze_conv2d_few(x, w, bias, y, h, w_, c, oh, ow, kh, kw, sh, sw, ph, pw, has_bias, lo, hi, cin)
        a convolution of few input channels (a network's first, on its NCHW image): the same
        from x [N, CIN, H, W] (contiguous) and the weight [C, CIN, KH, KW]

Why native: at batch 1 a oneDNN convolution call costs ~30 us before any arithmetic (a
[1, 16, 4, 4] one took 28-33 us here): MobileNet-V3-small has 11 depthwise convolutions of
40-90 us each. On an NCHW image of 3 channels oneDNN's packed convolution ran at 60-130 GFLOP/s.

How: output channels in 16-lane vectors, a group of up to GROUP vectors at a time, whose
filters are gathered once per group into a stack of [taps, vectors]; each output pixel's taps
clipped to the image (zero padding adds nothing). One FMA chain per vector would wait on the
FMA's latency (docs/limits.md: an earlier depthwise kernel ran 4x slower so), so pixels whose
taps all lie inside the image go BLOCK at a time: BLOCK x (vectors in the group) chains side by
side. A depthwise tap is an input vector (16 channels) times its filters; a few-channel tap an
input value broadcast, times its filters. Sums are in tap order, from the bias or from 0 with
the bias added last: oneDNN's order for depthwise convolutions (docs/aten-bits.md).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import llvmlite.ir as ll
import torch

from . import jit
from .codegen import (
    F32,
    I64,
    LANES16,
    PTR,
    VOID,
    counted_loop,
    fma,
    gather,
    lanes_below,
    masked_load,
    masked_store,
    smaller,
    splat,
)

DEPTHWISE = "braze_depthwise_conv2d"
FEW = "braze_conv2d_few"
ARGS = 14  # h, w, c, oh, ow, kh, kw, sh, sw, ph, pw, has_bias, lo, hi (FEW: then cin)
LANES = 16
# (channel vectors, pixels) at a time: at most 16 accumulators, so that they stay in registers
SHAPE = {DEPTHWISE: (4, 4), FEW: (2, 8)}
V16 = LANES16
ZERO = ll.Constant(V16, [0.0] * LANES)


def _clip(b: ll.IRBuilder, start: ll.Value, k: ll.Value, size: ll.Value) -> tuple[ll.Value, ll.Value]:
    """The taps [first, end) of a window of k from `start` that lie inside [0, size)."""
    first = b.select(b.icmp_signed("<", start, I64(0)), b.sub(I64(0), start), I64(0))
    room = b.sub(size, start)
    return first, b.select(b.icmp_signed("<", room, k), room, k)


@dataclass
class _Call:
    """The kernel's arguments and its stack: what each part of its body reads."""

    x: ll.Value
    w: ll.Value
    bias: ll.Value
    y: ll.Value
    h: ll.Value
    wd: ll.Value
    c: ll.Value
    oh: ll.Value
    ow: ll.Value
    kh: ll.Value
    kw: ll.Value
    sh: ll.Value
    sw: ll.Value
    ph: ll.Value
    pw: ll.Value
    has_bias: ll.Value
    lo: ll.Value
    hi: ll.Value
    cin: ll.Value | None = None  # FEW's input channels (depthwise: None)
    group: int = 0
    block: int = 0
    taps: ll.Value = None  # a filter's: kh * kw, times cin for FEW
    filters: ll.Value = None  # [taps, group] vectors: the group's filters
    seeds: ll.Value = None  # [group] vectors: the group's bias (or zeros)
    addends: ll.Value = None  # [group] vectors: the bias added to the sums (has_bias 2)
    acc: list = field(default_factory=list)  # block * group accumulators


def _kernel(name: str, module: ll.Module) -> None:
    few = name == FEW
    fn = ll.Function(module, ll.FunctionType(VOID, [PTR] * 4 + [I64] * (ARGS + few)), name)
    k = _Call(*fn.args)
    k.group, k.block = SHAPE[name]
    b = ll.IRBuilder(fn.append_basic_block("entry"))
    k.taps = b.mul(k.kh, k.kw) if k.cin is None else b.mul(b.mul(k.kh, k.kw), k.cin)
    k.filters = b.alloca(V16, size=b.mul(k.taps, I64(k.group)))
    k.seeds = b.alloca(V16, size=I64(k.group))
    k.addends = b.alloca(V16, size=I64(k.group))
    k.acc = [b.alloca(V16) for _ in range(k.block * k.group)]
    # The pixels whose taps all lie inside the image: ow in [inner, outer).
    inner = smaller(b, b.sdiv(b.add(k.pw, b.sub(k.sw, I64(1))), k.sw), k.ow)
    reach = b.sub(b.add(k.wd, k.pw), k.kw)
    outer = b.select(b.icmp_signed("<", reach, I64(0)), I64(0), b.add(b.sdiv(reach, k.sw), I64(1)))
    outer = smaller(b, outer, k.ow)
    outer = b.select(b.icmp_signed("<", outer, inner), inner, outer)
    blocks_end = b.add(inner, b.mul(b.sdiv(b.sub(outer, inner), I64(k.block)), I64(k.block)))
    vectors = b.sdiv(b.add(k.c, I64(LANES - 1)), I64(LANES))
    with counted_loop(b, I64(0), vectors, k.group) as first:
        # one body per group width: a narrow group computes no vectors past the channels
        done = fn.append_basic_block("group_done")
        switch = b.switch(smaller(b, b.sub(vectors, first), I64(k.group)), done)
        for n in range(1, k.group + 1):
            block = fn.append_basic_block(f"group{n}")
            switch.add_case(I64(n), block)
            b.position_at_end(block)
            masks = _group(b, k, n, first)
            _rows(b, k, n, first, masks, (inner, blocks_end))
            b.branch(done)
        b.position_at_end(done)
    b.ret_void()


def _group(b: ll.IRBuilder, k: _Call, n: int, first: ll.Value) -> list[ll.Value]:
    """The group's filters, tap by tap, into k.filters, and its bias into k.seeds (where the sums
    start from it, has_bias 1; else zeros) and k.addends (added to them, has_bias 2), each vector
    masked to the channels that exist; the masks."""
    taps = k.taps
    some = splat(b, b.icmp_signed("!=", k.has_bias, I64(0)), LANES)
    seeded = b.icmp_signed("==", k.has_bias, I64(1))
    masks = []
    for v in range(n):
        c0 = b.mul(b.add(first, I64(v)), I64(LANES))
        mask = lanes_below(b, b.sub(k.c, c0))
        masks.append(mask)
        with counted_loop(b, I64(0), taps) as t:
            filt = gather(b, k.w, b.add(b.mul(c0, taps), t), taps, mask)
            b.store(filt, b.gep(k.filters, [b.add(b.mul(t, I64(k.group)), I64(v))], source_etype=V16))
        bias = masked_load(b, b.gep(k.bias, [c0], source_etype=F32), b.and_(mask, some))  # none: no lane read
        b.store(b.select(seeded, bias, ZERO), b.gep(k.seeds, [I64(v)], source_etype=V16))
        b.store(bias, b.gep(k.addends, [I64(v)], source_etype=V16))
    return masks


def _rows(b: ll.IRBuilder, k: _Call, n: int, first: ll.Value, masks: list, cols: tuple) -> None:
    """Output rows lo..hi of the group's channels: the pixels from `inner` to `blocks_end`
    k.block at a time; then those left of `inner` and from `blocks_end` one at a time, clipped to
    the image."""
    inner, blocks_end = cols
    c_first = b.mul(first, I64(LANES))
    with counted_loop(b, k.lo, k.hi) as r:
        image, row = b.sdiv(r, k.oh), b.srem(r, k.oh)
        top = b.sub(b.mul(row, k.sh), k.ph)
        rows = _clip(b, top, k.kh, k.h)
        plane = b.mul(k.h, k.wd)
        if k.cin is None:  # the image's pixels, from the group's first channel
            src = b.gep(k.x, [b.add(b.mul(image, b.mul(plane, k.c)), c_first)], source_etype=F32)
        else:  # the image's first plane
            src = b.gep(k.x, [b.mul(image, b.mul(plane, k.cin))], source_etype=F32)
        dst = b.gep(k.y, [b.add(b.mul(b.mul(r, k.ow), k.c), c_first)], source_etype=F32)
        with counted_loop(b, inner, blocks_end, k.block) as col:
            _pixels(b, k, n, k.block, col, (src, dst, top, rows), masks)
        # the lone pixels, left and right, in one loop: a second copy of its body took LLVM ~20%
        # of the kernel's build time (few-channel ~130 -> ~100 ms, depthwise ~270 -> ~210)
        gap = b.sub(blocks_end, inner)
        with counted_loop(b, I64(0), b.sub(b.add(k.ow, inner), blocks_end)) as i:
            col = b.select(b.icmp_signed("<", i, inner), i, b.add(i, gap))
            _pixels(b, k, n, 1, col, (src, dst, top, rows), masks)


def _pixels(b: ll.IRBuilder, k: _Call, n: int, pixels: int, col: ll.Value, at_row: tuple, masks: list) -> None:
    """Output pixels col..col+pixels of one row: each tap's inputs times its filters, summed onto
    the bias. A lone pixel's taps are clipped to the image; a block's lie inside."""
    src, dst, top, (kh0, kh1) = at_row
    left = b.sub(b.mul(col, k.sw), k.pw)
    kw0, kw1 = _clip(b, left, k.kw, k.wd) if pixels == 1 else (I64(0), k.kw)
    acc = [[k.acc[p * k.group + v] for v in range(n)] for p in range(pixels)]
    for v in range(n):
        seed = b.load(b.gep(k.seeds, [I64(v)], source_etype=V16), typ=V16)
        for p in range(pixels):
            b.store(seed, acc[p][v])
    with counted_loop(b, I64(0), k.cin or I64(1)) as ci:
        with counted_loop(b, kh0, kh1) as i:
            line = b.mul(b.add(b.mul(ci, k.h), b.add(top, i)), k.wd)  # (ci is 0 for depthwise)
            with counted_loop(b, kw0, kw1) as j:
                tap = b.mul(b.add(b.mul(b.add(b.mul(ci, k.kh), i), k.kw), j), I64(k.group))
                filters = [b.load(b.gep(k.filters, [b.add(tap, I64(v))], source_etype=V16), typ=V16) for v in range(n)]
                for p in range(pixels):
                    at = b.add(line, b.add(b.add(left, b.mul(I64(p), k.sw)), j))
                    for v in range(n):
                        xv = _input(b, k, src, at, v, masks[v])
                        b.store(fma(b, xv, filters[v], b.load(acc[p][v], typ=V16)), acc[p][v])
    after = b.icmp_signed("==", k.has_bias, I64(2))
    for p in range(pixels):
        at = b.mul(b.add(col, I64(p)), k.c)
        for v in range(n):
            out = b.gep(dst, [b.add(at, I64(LANES * v))], source_etype=F32)
            total = b.load(acc[p][v], typ=V16)
            added = b.fadd(total, b.load(b.gep(k.addends, [I64(v)], source_etype=V16), typ=V16))
            masked_store(b, b.select(after, added, total), out, masks[v])


def _input(b: ll.IRBuilder, k: _Call, src: ll.Value, at: ll.Value, v: int, mask: ll.Value) -> ll.Value:
    """A tap's input for channel vector v of the group: depthwise, the 16 channels of pixel `at`;
    few-channel, the value at `at` in every lane."""
    if k.cin is None:
        return masked_load(b, b.gep(src, [b.add(b.mul(at, k.c), I64(LANES * v))], source_etype=F32), mask)
    return splat(b, b.load(b.gep(src, [at], source_etype=F32), typ=F32), LANES)


def library(kernel: str) -> int:
    """The address of kernel `kernel` (jit.kernel: built alone when first needed, at -O2)."""
    return jit.kernel(kernel, lambda module: _kernel(kernel, module))


def conv2d(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, stride: tuple, padding: tuple, bias_last: bool = False
) -> torch.Tensor:
    """The native convolution of float32 x, channels-last (depthwise) or contiguous (few-channel:
    w has more than one input channel, or x one channel), into a channels-last result (tests and
    probes); `bias_last`: the bias added to the sums rather than their start."""
    n, cin, h, wd = x.shape
    c, kh, kw = w.shape[0], *w.shape[-2:]
    few = w.shape[1] > 1 or c != cin
    oh, ow = (h + 2 * padding[0] - kh) // stride[0] + 1, (wd + 2 * padding[1] - kw) // stride[1] + 1
    y = torch.empty(n, c, oh, ow).contiguous(memory_format=torch.channels_last)
    name = FEW if few else DEPTHWISE
    fn = ctypes.CFUNCTYPE(None, *[ctypes.c_void_p] * 4, *[ctypes.c_int64] * (ARGS + few))(library(name))
    has_bias = 0 if bias is None else 2 if bias_last else 1
    sizes = (h, wd, c, oh, ow, kh, kw, *stride, *padding, has_bias, 0, n * oh) + ((cin,) if few else ())
    fn(x.data_ptr(), w.contiguous().data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(), *sizes)
    return y
