"""Fast mode's 3 x 3 convolutions (stride 1, no dilation, one group) of channels-last pixels as
Winograd's F(2 x 2, 3 x 3): a native kernel built once per process into the JIT.

    braze_winograd_conv2d(x, u, bias, addend, y, flag, n, h, w, c, o, oh, ow, ph, pw, relu, chunk,
                          usize, depth, by_columns)
        y [N, OH, OW, O] = conv(x [N, H, W, C], the weight u was made from) + bias [O] (+ addend
        [N, OH, OW, O] where not null: a residual connection), relu'd where `relu`; u:
        `transformed(weight)`, 16 panels of usize floats (gemmkernel.pack's layout, depth rows
        each); threads: OpenMP's, each its share of the tiles, or with `by_columns` its share of
        the output channels (32 at a time) of every tile; *flag set where an output (before the
        ReLU) is not finite, or where a thread could not have its scratch memory

Why: oneDNN's direct convolution runs at the cores' peak (~210 GFLOP/s on two threads here), so
only fewer multiplications go faster. Each 2 x 2 block of outputs (a tile) is A^T [(G g G^T) *
(B^T d B)] A of its 4 x 4 input patch d: 16 products per channel pair where the direct form has
36, 2.25x fewer. The 16 products are 16 GEMMs, [tiles, C] @ [C, O], braze's GEMM kernel on
weights transformed (in float64) and packed once; the transforms of inputs and outputs are
additions. Each thread takes `chunk` of its tiles at a time: their 16 transformed inputs and
16 products in scratch memory of its own (aligned_alloc), then the outputs, the bias and the
ReLU in one pass. Accuracy: the transforms' additions round where the direct sums do not (the
weight's transform is exact to float32's rounding); fast mode's contract (accuracy.py) bounds
it, and tests check it on models. Infinities and NaN do not keep their places: one in a patch
reaches the tile's four outputs through the transforms, and inf - inf is NaN where the direct
sum gives an infinity. So the kernel flags a call whose outputs are not all finite, and conv2d
gives None: the caller computes that call the direct way.
"""

from __future__ import annotations

import ctypes
import functools

import llvmlite.ir as ll
import torch

from . import gemmkernel, jit
from .codegen import (
    F32,
    I32,
    I64,
    LANES16,
    PTR,
    VOID,
    counted_loop,
    declared,
    lanes_below,
    masked_load,
    masked_store,
    smaller,
    splat,
)

NAME = "braze_winograd_conv2d"
I16 = ll.IntType(16)
POINTERS = ("x", "u", "bias", "addend", "y", "flag")
SIZES = ("n", "h", "w", "c", "o", "oh", "ow", "ph", "pw", "relu", "chunk", "usize", "depth", "by_columns")
LANES = 16
NONE = ll.Constant(ll.VectorType(ll.IntType(1), LANES), [0] * LANES)  # the mask of no lane
# Tiles per step of a thread: their transformed inputs and products within SCRATCH bytes (L2 is
# 1 MB), but at least MIN_CHUNK, as the step reads all of the transformed weight (4 MB at 256
# channels in and out). Timed at ResNet-18's and cnn-small's sizes: 96 KB to 768 KB within 5%
# of each other where the weight is small; 1.5 MB 2.2x slower at 64 channels.
SCRATCH = 192 * 1024
MIN_CHUNK = 24

# F(2 x 2, 3 x 3) (Lavin and Gray): V = B^T d B, U = G g G^T, Y = A^T (U * V) A
_G = torch.tensor([[1.0, 0.0, 0.0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0.0, 0.0, 1.0]], dtype=torch.float64)
_KRON = torch.kron(_G, _G)  # [16, 9]: vec(G g G^T) = (G (x) G) vec(g), both row-major


def transformed(weight: torch.Tensor) -> torch.Tensor:
    """The weight [O, C, 3, 3] as the kernel reads it: G g G^T in float64, rounded once, as 16
    [O, C] matrices (one per product), packed by gemmkernel.pack. One float64 product for all
    channel pairs and one pack of the 16: ResNet-18's 26 transforms while compiling (then
    packed twice where a BatchNorm joined the call) took 0.34-0.36 s as 16 einsum slices and 16
    packs each, 0.19-0.20 s so (the same bits)."""
    o, c = weight.shape[:2]
    u = (weight.detach().double().reshape(o, c, 9) @ _KRON.t()).float()  # [O, C, 16]
    out = torch.empty(16 * gemmkernel.packed_numel(o, c))
    gemmkernel.pack(u.permute(2, 0, 1), out)
    return out


def _input_transform(b: ll.IRBuilder, d: list[list[ll.Value]]) -> list[ll.Value]:
    """B^T d B of a 4 x 4 patch: its rows combined, then its columns."""

    def combine(v: list[ll.Value]) -> list[ll.Value]:
        return [b.fsub(v[0], v[2]), b.fadd(v[1], v[2]), b.fsub(v[2], v[1]), b.fsub(v[1], v[3])]

    rows = [combine([d[i][j] for i in range(4)]) for j in range(4)]  # rows[j][i]: column j's
    return [v for i in range(4) for v in combine([rows[j][i] for j in range(4)])]


def _output_transform(b: ll.IRBuilder, m: list[ll.Value]) -> list[ll.Value]:
    """A^T m A of the 4 x 4 products: a 2 x 2 block, row by row."""

    def combine(v: list[ll.Value]) -> list[ll.Value]:
        return [b.fadd(b.fadd(v[0], v[1]), v[2]), b.fsub(b.fsub(v[1], v[2]), v[3])]

    cols = [combine([m[4 * i + j] for i in range(4)]) for j in range(4)]  # cols[j][r]
    return [v for r in range(2) for v in combine([cols[j][r] for j in range(4)])]


class _Team:
    """One thread's part of a call, as IR: the call's arguments by name (POINTERS, SIZES), its
    tiles [lo, hi) and output channels [col0, col1), scratch of a chunk's 16 transformed inputs
    (vs) and products (ms), and `bad`: the lanes of outputs so far that were not finite."""

    def __init__(self, b: ll.IRBuilder, words: list[ll.Value]) -> None:
        self.b = b
        for name, v in zip(POINTERS, words):
            setattr(self, name, b.inttoptr(v, PTR))
        for name, v in zip(SIZES, words[len(POINTERS) :]):
            setattr(self, name, v)
        self.tw = b.sdiv(b.add(self.ow, I64(1)), I64(2))
        self.plane = b.mul(b.sdiv(b.add(self.oh, I64(1)), I64(2)), self.tw)  # tiles an image

    def at(self, p: ll.Value, i: ll.Value) -> ll.Value:
        return self.b.gep(p, [i], source_etype=F32)

    def tile(self, index: ll.Value) -> tuple[ll.Value, ll.Value, ll.Value]:
        """(image, first output row, first output column) of a tile (the patch's less the padding)."""
        b = self.b
        img, rest = b.sdiv(index, self.plane), b.srem(index, self.plane)
        return img, b.mul(b.sdiv(rest, self.tw), I64(2)), b.mul(b.srem(rest, self.tw), I64(2))

    def split(self, tid: ll.Value, nth: ll.Value) -> None:
        """This thread's tiles and output channels: an equal share of the tiles (all channels), or
        with by_columns of the channels' 32-wide panels (all tiles)."""
        b, nr = self.b, I64(gemmkernel.NR)

        def share(count: ll.Value) -> tuple[ll.Value, ll.Value]:
            each = b.sdiv(b.add(count, b.sub(nth, I64(1))), nth)
            first = b.mul(tid, each)
            return first, smaller(b, b.add(first, each), count)

        columns, tiles = b.icmp_signed("!=", self.by_columns, I64(0)), b.mul(self.n, self.plane)
        lo, hi = share(tiles)
        self.lo, self.hi = b.select(columns, I64(0), lo), b.select(columns, tiles, hi)
        col0, col1 = share(b.sdiv(b.add(self.o, I64(gemmkernel.NR - 1)), nr))
        self.col0 = b.select(columns, b.mul(col0, nr), I64(0))
        self.col1 = b.select(columns, smaller(b, b.mul(col1, nr), self.o), self.o)


def _inputs(k: _Team, t0: ll.Value, rows: ll.Value) -> None:
    """B^T d B of each of the chunk's tiles, 16 channels at a time, into vs [16, chunk, C]; a
    patch's pixels outside the image are zeros."""
    b = k.b
    with counted_loop(b, I64(0), rows) as t:
        img, r0, c0 = k.tile(b.add(t0, t))
        with counted_loop(b, I64(0), k.c, LANES) as cv:
            mask = lanes_below(b, b.sub(k.c, cv))
            patch = []
            for i in range(4):
                row = b.sub(b.add(r0, I64(i)), k.ph)
                row_in = b.and_(b.icmp_signed(">=", row, I64(0)), b.icmp_signed("<", row, k.h))
                base = b.mul(b.add(b.mul(img, k.h), row), k.w)
                patch.append([])
                for j in range(4):
                    col = b.sub(b.add(c0, I64(j)), k.pw)
                    inside = b.and_(row_in, b.and_(b.icmp_signed(">=", col, I64(0)), b.icmp_signed("<", col, k.w)))
                    # (outside the image, no lane is read, from x itself: see _outputs)
                    ptr = k.at(k.x, b.select(inside, b.add(b.mul(b.add(base, col), k.c), cv), I64(0)))
                    patch[i].append(masked_load(b, ptr, b.select(inside, mask, NONE)))
            for xi, v in enumerate(_input_transform(b, patch)):
                masked_store(b, v, k.at(k.vs, b.add(b.mul(b.add(b.mul(I64(xi), k.chunk), t), k.c), cv)), mask)


def _products(k: _Team, gemm: ll.Function, rows: ll.Value) -> None:
    """The 16 GEMMs, vs[xi] [rows, C] @ the weight's xi-th [C, col0:col1] into ms [16, chunk, O]
    (the packed panels of columns col0.. start at col0 * depth)."""
    b, null = k.b, ll.Constant(PTR, None)
    with counted_loop(b, I64(0), I64(16)) as xi:
        src = k.at(k.vs, b.mul(b.mul(xi, k.chunk), k.c))
        dst = k.at(k.ms, b.add(b.mul(b.mul(xi, k.chunk), k.o), k.col0))
        panels = k.at(k.u, b.add(b.mul(xi, k.usize), b.mul(k.col0, k.depth)))
        width = b.sub(k.col1, k.col0)
        b.call(gemm, [src, k.c, panels, k.depth, dst, k.o, null, I64(0), width, k.c, I64(0), rows, I64(0)])


def _outputs(k: _Team, t0: ll.Value, rows: ll.Value) -> None:
    """A^T m A of each tile's products, + bias (+ addend), ReLU'd: its outputs inside the image."""
    b, zero = k.b, ll.Constant(LANES16, [0.0] * LANES)
    adds = b.icmp_unsigned("!=", k.addend, ll.Constant(PTR, None))
    # A masked load's or store's address must be mapped memory even where no lane is read or
    # written (from null + offset each took a fault's assist: the kernel ran 1.5x slower in
    # cnn-small). So without an addend its lanes are read from y (none of them), and outputs
    # outside the image (a tile's past its edge) address y's first.
    addend = b.select(adds, k.addend, k.y)
    # ReLU: lanes below 0 (not NaN, which eager's ReLU keeps) become 0; without it, none do
    floor = splat(b, b.select(b.icmp_signed("!=", k.relu, I64(0)), F32(0.0), F32(float("-inf"))), LANES)
    with counted_loop(b, I64(0), rows) as t:
        img, r0, c0 = k.tile(b.add(t0, t))
        with counted_loop(b, k.col0, k.col1, LANES) as ov:
            mask = lanes_below(b, b.sub(k.col1, ov))
            at_m = [b.add(b.mul(b.add(b.mul(I64(xi), k.chunk), t), k.o), ov) for xi in range(16)]
            shift = masked_load(b, k.at(k.bias, ov), mask)
            for i, v in enumerate(_output_transform(b, [masked_load(b, k.at(k.ms, m), mask) for m in at_m])):
                row, col = b.add(r0, I64(i // 2)), b.add(c0, I64(i % 2))
                inside = b.and_(b.icmp_signed("<", row, k.oh), b.icmp_signed("<", col, k.ow))
                at_y = b.add(b.mul(b.add(b.mul(b.add(b.mul(img, k.oh), row), k.ow), col), k.o), ov)
                at_y = b.select(inside, at_y, I64(0))
                v = b.fadd(v, shift)
                v = b.fadd(v, masked_load(b, k.at(addend, at_y), b.select(b.and_(adds, inside), mask, NONE)))
                diff = b.fsub(v, v)  # NaN where v is an infinity or NaN
                lanes = b.bitcast(b.fcmp_unordered("uno", diff, diff), I16)
                b.store(b.or_(b.load(k.bad, typ=I16), lanes), k.bad)
                v = b.select(b.fcmp_ordered("<", v, floor), zero, v)
                masked_store(b, v, k.at(k.y, at_y), b.select(inside, mask, NONE))


def _kernel(module: ll.Module) -> None:
    gemm = declared(module, gemmkernel.NAME_PACKED, VOID, gemmkernel.ARGS)
    alloc, free = declared(module, "aligned_alloc", PTR, [I64, I64]), declared(module, "free", VOID, [PTR])
    thread_num = declared(module, "omp_get_thread_num", I32, [])
    num_threads = declared(module, "omp_get_num_threads", I32, [])
    types = [PTR] * len(POINTERS) + [I64] * len(SIZES)

    team = ll.Function(module, ll.FunctionType(VOID, [PTR]), f"{NAME}_team")
    team.linkage = "internal"
    b = ll.IRBuilder(team.append_basic_block("entry"))
    k = _Team(b, [b.load(b.gep(team.args[0], [I64(i)], source_etype=I64), typ=I64) for i in range(len(types))])
    k.split(*(b.sext(b.call(f, []), I64) for f in (thread_num, num_threads)))
    with b.if_then(b.and_(b.icmp_signed("<", k.lo, k.hi), b.icmp_signed("<", k.col0, k.col1))):
        k.vs = b.call(alloc, [I64(64), b.mul(b.mul(k.chunk, b.add(k.c, I64(LANES))), I64(16 * 4))])
        k.ms = b.call(alloc, [I64(64), b.mul(b.mul(k.chunk, b.add(k.o, I64(LANES))), I64(16 * 4))])
        k.bad = b.alloca(I16)
        b.store(I16(0), k.bad)
        null = ll.Constant(PTR, None)
        with b.if_else(b.and_(b.icmp_unsigned("!=", k.vs, null), b.icmp_unsigned("!=", k.ms, null))) as (got, none):
            with got:
                with counted_loop(b, k.lo, k.hi, k.chunk) as t0:
                    rows = smaller(b, b.sub(k.hi, t0), k.chunk)
                    _inputs(k, t0, rows)
                    _products(k, gemm, rows)
                    _outputs(k, t0, rows)
            with none:  # no scratch memory: flagged, and the caller computes the call the direct way
                b.store(I16(1), k.bad)
        with b.if_then(b.icmp_unsigned("!=", b.load(k.bad, typ=I16), I16(0))):
            b.atomic_rmw("or", k.flag, I64(1), "monotonic")
        b.call(free, [k.vs])  # (free(NULL) does nothing)
        b.call(free, [k.ms])
    b.ret_void()
    _entry(module, team, types)


def _entry(module: ll.Module, team: ll.Function, types: list[ll.Type]) -> None:
    """NAME(arguments...): the arguments as words, the team run on OpenMP's threads."""
    max_threads = declared(module, "omp_get_max_threads", I32, [])
    gomp = declared(module, "GOMP_parallel", VOID, [PTR, PTR, I32, I32])
    f = ll.Function(module, ll.FunctionType(VOID, types), NAME)
    b = ll.IRBuilder(f.append_basic_block("entry"))
    args = b.alloca(I64, size=I64(len(types)))
    for i, v in enumerate(f.args):
        b.store(b.ptrtoint(v, I64) if v.type == PTR else v, b.gep(args, [I64(i)], source_etype=I64))
    b.call(gomp, [team, args, b.trunc(b.call(max_threads, []), I32), I32(0)])
    b.ret_void()


def library() -> int:
    """The kernel's address (jit.kernel: built alone when first needed, after the GEMM kernel it calls)."""
    gemmkernel.library(gemmkernel.NAME_PACKED)
    return jit.kernel(NAME, _kernel)


def chunk(c: int, o: int) -> int:
    """Tiles per step of a thread (a multiple of the GEMM kernel's 6 rows)."""
    return max(MIN_CHUNK, SCRATCH // (16 * 4 * (c + o)) // gemmkernel.MR * gemmkernel.MR)


@functools.cache
def _kernel_function() -> ctypes._CFuncPtr:
    return ctypes.CFUNCTYPE(None, *[ctypes.c_void_p] * len(POINTERS), *[ctypes.c_int64] * len(SIZES))(library())


def conv2d(
    x: torch.Tensor,
    u: torch.Tensor,
    bias: torch.Tensor,
    padding: list[int],
    relu: bool,
    addend: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The 3 x 3 convolution of float32 x [N, C, H, W] by the weight u was made from
    (`transformed`), plus bias [O] (contiguous: one per output channel), plus `addend` (of the
    result's shape) where given, ReLU'd where `relu`:
    channels-last [N, O, OH, OW]; None where an output is not finite (see above) or the kernel's
    scratch memory could not be had (the caller computes it the direct way). x is read as
    channels-last pixels (made so if it is not). Threads split the tiles, or where each would
    have fewer than 2 * MIN_CHUNK of them, the output channels (each thread then reads its part
    of the weight, not all of it: ResNet-18's 512 -> 512 at 7 x 7, 16 tiles, 1.29x faster so, the
    kernel timed alone; 1.15x at 256 -> 256 at 14 x 14, 49 tiles)."""
    n, c, h, w = x.shape
    o = bias.numel()
    if x.dtype != torch.float32 or u.numel() != 16 * gemmkernel.packed_numel(o, c):
        raise TypeError(f"winograd.conv2d: a float32 input of {c} channels for its weight, not {x.dtype} {x.shape}")
    x = x.contiguous(memory_format=torch.channels_last)
    oh, ow = h + 2 * padding[0] - 2, w + 2 * padding[1] - 2
    y = torch.empty(n, o, oh, ow, memory_format=torch.channels_last)
    if addend is not None:
        if addend.shape != y.shape or addend.dtype != torch.float32:
            raise TypeError(f"winograd.conv2d: an addend of {addend.dtype} {tuple(addend.shape)} to {tuple(y.shape)}")
        addend = addend.contiguous(memory_format=torch.channels_last)
    if y.numel() == 0:
        return y
    fn = _kernel_function()
    sizes = (n, h, w, c, o, oh, ow, *padding, int(relu), chunk(c, o))
    packing = (gemmkernel.packed_numel(o, c), gemmkernel.packed_depth(c))
    flag = ctypes.c_int64(0)
    by_columns = n * -(-oh // 2) * -(-ow // 2) < 2 * MIN_CHUNK * torch.get_num_threads()
    pointers = (
        x.data_ptr(),
        u.data_ptr(),
        bias.data_ptr(),
        None if addend is None else addend.data_ptr(),
        y.data_ptr(),
    )
    fn(*pointers, ctypes.addressof(flag), *sizes, *packing, by_columns)
    return None if flag.value else y
