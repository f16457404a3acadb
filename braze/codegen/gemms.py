"""Codegen of GEMMs and batched GEMMs (a part of ModuleBuilder, which mixes this class in): MKL's
sgemm_ and cblas_sgemm_batch called with the arguments ATen passes, or braze's own GEMM kernel
(gemmkernel.py) on ATen's threads, with a fused epilogue run on each thread's rows."""

from __future__ import annotations

from typing import Any, NamedTuple

import llvmlite.ir as ll

from ..dims import Dim
from ..ir import Node, Op, TensorMeta
from .loops import (
    F32,
    I8,
    I32,
    I64,
    LANES16,
    PTR,
    Access,
    counted_loop,
    lanes_below,
    masked_load,
    masked_store,
    pieces,
    smaller,
    splat,
)


class Epilogue(NamedTuple):
    """A GEMM's epilogue: its loop (table, lo, hi) over `numel` elements, its outermost loop's
    extent, and how many of its outermost steps one row of the product is where its rows are
    the product's rows in order (both dense, row-major), else None: then it cannot run with a
    thread's rows."""

    loop: ll.Function
    numel: Dim
    total: Dim
    row_step: Dim | None


class GemmEmitter:
    """ModuleBuilder's GEMM kernels (they use its loops, thread split and BLAS calls)."""

    # --- GEMM --------------------------------------------------------------------------------
    def _gemm(self, b: ll.IRBuilder, table: ll.Value, k: Node) -> None:
        # The product's own layout; an epilogue may read it through a reshape (acc_meta).
        gemm_meta = k.attrs.get("gemm_meta", k.meta)
        slot = self.slot_of(k.name).slot
        c = Access(slot, gemm_meta)
        m1, m2, bias = k.inputs[:3]
        if gemm_meta.numel == 0:
            return
        blas, own, order = k.attrs["blas"], k.attrs.get("own_kernel", 0), k.attrs.get("order")
        assert not k.attrs.get("taps") or (own and k.attrs.get("pack")), k.attrs  # (a weight BLAS cannot read)
        # the kernel reads a bias row itself (a seed, in a convolution's order: an NCHW image's a
        # value per row); where sgemm_ runs, ATen's copy of the bias into every row comes first
        row = own and bias is not None and _bias_row(self.slot_of(bias).meta, gemm_meta)
        row = row or (order is not None and order[0] and bias is not None)
        bias_row = self.slot_of(bias) if row else None

        def copy_bias() -> None:  # ATen: result.copy_(bias expanded), then sgemm with beta=1
            copy = Node(k.name, Op.COPY, (bias,), gemm_meta)
            self._loop_kernel(b, table, gemm_meta, c, (copy,), {})

        if bias is not None and not row:
            copy_bias()
        operands = (self.slot_of(m1), self.slot_of(m2), c)
        sgemm = lambda: self._sgemm_call(b, table, blas, *operands, k.attrs["beta"], self._one_thread(b, table, k))  # noqa: E731
        epilogue = self._epilogue(k) if k.body else None
        if own and isinstance(blas["n"], int):
            pack, images = k.attrs.get("pack"), k.attrs.get("images", 1)
            self._own_gemm(b, table, blas, operands, bias_row, k.attrs["beta"], epilogue, pack, order, images)
        elif own:  # a generic program: MKL's other path below `own` rows
            with b.if_else(b.icmp_signed(">=", self.dim(b, table, blas["n"]), I64(own))) as (mine, mkl):
                with mine:
                    self._own_gemm(
                        b, table, blas, operands, bias_row, k.attrs["beta"], epilogue, k.attrs.get("pack"), order
                    )
                with mkl:
                    if bias_row is not None:
                        copy_bias()
                    sgemm()
                    self._epilogue_pass(b, table, epilogue)
        else:
            if blas["k"] > 0:
                sgemm()
            elif bias is None:  # K == 0 with beta == 0: ATen zero-fills
                zero = Node(k.name, Op.MUL, (0.0, 0.0), gemm_meta)
                self._loop_kernel(b, table, gemm_meta, c, (zero,), {})
            self._epilogue_pass(b, table, epilogue)

    def _im2col(self, b: ll.IRBuilder, table: ll.Value, k: Node) -> None:
        """A convolution's patches (Op.IM2COL), their rows split between threads: of a
        channels-last input each tap's C channels copied 16 at a time from the pixel under it
        (K tap by tap), of an NCHW one (`planes`) each channel's and kernel row's KW pixels (K as
        the weight's [C, KH, KW]); zeros where they lie off the image (unsigned comparisons: a
        row or column before the first is a large number)."""
        x = self.slot_of(k.inputs[0])
        (_, c, h, w), rows = x.meta.shape, k.meta.shape[0]
        (kh, kw), (sh, sw), (ph, pw), (dh, dw) = (k.attrs[a] for a in ("kernel", "stride", "padding", "dilation"))
        planes = k.attrs.get("planes", False)
        # (lowering/conv.py's: the channels, or an NCHW input's rows, one run of memory; the rows dense)
        assert isinstance(c, int) and x.meta.stride[3 if planes else 1] == 1 and k.meta.stride == (kh * kw * c, 1), k
        assert not planes or dw == 1, k
        with self._ranged(b, table, "im2col", k.meta.numel, rows) as (kb, tbl, lo, hi):
            src, dst = self.pointer(kb, tbl, x), self.pointer(kb, tbl, self.slot_of(k.name))
            height, width = self.dim(kb, tbl, h), self.dim(kb, tbl, w)
            image_step, channel_step, row_step, col_step = (self.dim(kb, tbl, x.meta.stride[d]) for d in range(4))
            out_w = kb.add(kb.sdiv(kb.add(width, I64(2 * pw - dw * (kw - 1) - 1)), I64(sw)), I64(1))
            out_h = kb.add(kb.sdiv(kb.add(height, I64(2 * ph - dh * (kh - 1) - 1)), I64(sh)), I64(1))
            plane = kb.mul(out_h, out_w)
            with counted_loop(kb, lo, hi) as r:
                image, at = kb.sdiv(r, plane), kb.srem(r, plane)
                y0 = kb.sub(kb.mul(kb.sdiv(at, out_w), I64(sh)), I64(ph))
                x0 = kb.sub(kb.mul(kb.srem(at, out_w), I64(sw)), I64(pw))
                first = kb.gep(src, [kb.mul(image, image_step)], source_etype=F32)
                to = kb.gep(dst, [kb.mul(r, I64(kh * kw * c))], source_etype=F32)
                if planes:
                    _plane_rows(kb, first, to, (c, kh, kw, dh), (y0, x0), (height, width), (channel_step, row_step))
                else:
                    _pixel_taps(kb, first, to, (c, kh, kw, dh, dw), (y0, x0), (height, width), (row_step, col_step))

    def _epilogue(self, k: Node) -> Epilogue | None:
        """A GEMM's epilogue as a loop (none over no elements)."""
        if k.meta.numel == 0:
            return None
        acc = Access(self.slot_of(k.name).slot, k.attrs["acc_meta"])
        kern, loops = self._loop_function(k.meta, acc, k.body, {k.attrs["acc"]: acc})
        total = loops[0].size if loops else 1
        rows, n = k.attrs.get("gemm_meta", k.meta).shape  # the product's, which threads split by rows
        # The loops walk the product's memory in order (it and the result laid out alike, dense:
        # contiguous, or a channels-last convolution's pixel rows seen as [N, C, H, W]) ...
        stride = lambda d: k.meta.stride[d.axis]  # noqa: E731
        alike = (acc.meta.shape, acc.meta.stride, acc.meta.offset) == (k.meta.shape, k.meta.stride, 0)
        step = None
        if alike and len(loops) == 1 and (loops[0].size, stride(loops[0])) == (k.meta.numel, 1):
            step = n  # ... as one flat loop over the elements
        elif alike and len(loops) == 2 and [(d.size, stride(d)) for d in loops] == [(rows, n), (n, 1)]:
            step = 1  # ... as rows, then the columns
        return Epilogue(kern, k.meta.numel, total, step)

    def _epilogue_pass(self, b: ll.IRBuilder, table: ll.Value, epilogue: Epilogue | None) -> None:
        """The epilogue as a pass of its own over the product, split as loops are."""
        if epilogue is not None:
            self._split(b, table, epilogue.loop, epilogue.numel, epilogue.total)

    def _own_gemm(
        self,
        b: ll.IRBuilder,
        table: ll.Value,
        blas: dict,
        operands: tuple[Access, Access, Access],
        bias: Access | None,
        beta: float,
        epilogue: Epilogue | None,
        pack: Any = None,
        order: tuple[bool, int] | None = None,
        images: int = 1,
    ) -> None:
        """gemmkernel's kernel in place of sgemm_ (C = X @ W, BLAS's swapped call: W [K, N]
        untransposed, [N, K] transposed, or in fast mode the [N, K] weight's panels packed once:
        `pack`, a fast.GemmPack), its rows or its 32-column panels split between ATen's
        threads. The output starts as the bias row where `bias` is one, else as the copy of the
        bias into it (beta 1) or empty (beta 0). With `order`, (seeded, chunk), in the order of a
        1 x 1 convolution of oneDNN's (gemmkernel.order_of): K in blocks of `chunk`, the sums
        from the bias where seeded; with `images`, NCHW images' products one under another (rows
        split across all of them, each image's range its own call). An epilogue (_epilogue) runs
        on each thread's rows right after them, while they are in its cache, where rows are split
        and its loop follows them; otherwise as a pass of its own after the product.

        Each thread reads all of what it does not split: the weight where rows are split
        (and packs all of it, if [N, K]), the input where columns are. So a [N, K] weight's
        panels are split where there are more columns than rows (mlp-wide: 1.09x -> 1.17x
        eager; bert-tiny, deciding per call, 1.03-1.06x faster), unless an epilogue follows the
        rows (below); a [K, N] weight, read in place, splits rows (gpt2-tiny was 4-5% slower with
        its panels split: each core then reads the rows of the input the other core wrote)."""
        from .. import gemmkernel  # built on this module's helpers

        assert blas["swap"] and not blas["tb"], blas  # the kernel's form (lowering.gemm.own_kernel)
        name = gemmkernel.NAME_NK if blas["ta"] else gemmkernel.NAME  # linear's [N, K] weight, or [K, N]
        seeded, chunk = order or (False, 0)
        if seeded:
            name = gemmkernel.NAME_NK_SEEDED if blas["ta"] else gemmkernel.NAME_SEEDED
        fn = self.kernel(gemmkernel, gemmkernel.NAME_PACKED if pack else name, gemmkernel.ARGS)
        x, w, c = operands
        m, n, kk = blas["n"], blas["m"], blas["k"]

        fusable = epilogue is not None and epilogue.row_step is not None

        def split(columns: bool) -> None:
            with_rows = fusable and not columns
            total = (n + gemmkernel.NR - 1) // gemmkernel.NR if columns else m * images
            with self._ranged(b, table, "own_gemm", m * n * kk * images, total) as (kb, tbl, lo, hi):
                if columns:
                    j0 = kb.mul(lo, I64(gemmkernel.NR))
                    width = kb.sub(smaller(kb, kb.mul(hi, I64(gemmkernel.NR)), I64(n)), j0)
                    rows = (I64(0), self.dim(kb, tbl, m))
                else:
                    j0, width, rows = I64(0), I64(n), (lo, hi)
                at = lambda p, i: kb.gep(p, [i], source_etype=F32)  # noqa: E731
                ld = {d: self.dim(kb, tbl, blas[d]) for d in ("lda", "ldb", "ldc")}
                out = at(self.pointer(kb, tbl, c), j0)
                if bias is not None:  # (a seed of a value per row: the kernel finds each row's)
                    first, ldi = at(self.pointer(kb, tbl, bias), I64(0) if seeded and not blas["ta"] else j0), I64(0)
                elif beta:
                    first, ldi = out, ld["ldc"]
                else:
                    first, ldi = ll.Constant(PTR, None), I64(0)
                if pack:  # (the entry checked that the panels are the weight's as it is now)
                    panels = kb.inttoptr(I64(pack.address()), PTR)
                    weight, ldw = at(panels, kb.mul(j0, I64(pack.depth))), I64(pack.depth)
                else:
                    weight = at(self.pointer(kb, tbl, w), kb.mul(j0, ld["lda"]) if blas["ta"] else j0)
                    ldw = ld["lda"]
                inputs = [self.pointer(kb, tbl, x), ld["ldb"], weight, ldw]
                if images == 1:
                    kb.call(fn, [*inputs, out, ld["ldc"], first, ldi, width, I64(kk), *rows, I64(chunk)])
                else:  # each image's rows in the range: its pixels [K, N] and product [M, N]
                    with pieces(kb, lo, hi, I64(m)) as (image, start, first_row, last_row):
                        inputs[2] = at(weight, kb.mul(image, kb.mul(I64(kk), ldw)))
                        product = at(out, kb.mul(start, ld["ldc"]))
                        local = [first, ldi, width, I64(kk), first_row, last_row, I64(chunk)]
                        kb.call(fn, [*inputs, product, ld["ldc"], *local])
                if with_rows:  # (inside the BLAS clock of a clocked build: it cannot be told apart)
                    step = self.dim(kb, tbl, epilogue.row_step)
                    kb.call(epilogue.loop, [tbl, kb.mul(lo, step), kb.mul(hi, step)])
            if not with_rows:
                self._epilogue_pass(b, table, epilogue)

        # With an epilogue that can follow the rows, rows are split while K is at most twice the
        # rows: each thread then reads (and packs) the whole weight, K x N, but the epilogue needs
        # no pass of its own over the M x N product (bert-tiny, K = M / 2, 1.02-1.07x faster, three
        # runs; mlp-wide, K = 4 M, 0.964x as fast). Up to 2026-12-07 only to K = M / 2: vit-tiny, K
        # = 0.97 M, was 0.973x as fast then; with packed panels and K in blocks of 256 (one process
        # per model, 15 rounds, against the old bound and a copy of it) BERT and DistilBERT (K = 2 M:
        # their GELUs a pass of 36 us each) ran 1.035-1.04x as fast, the HF ViT 1.02x, ConvNeXt-atto
        # 1.01x, vit-tiny and Llama 1.005-1.01x, ResNet-18 1.00x.
        with self._clocked(b):
            if not blas["ta"] or isinstance(m, int):
                split(blas["ta"] and n > m and not (fusable and kk <= 2 * m))  # a [N, K] weight's rows are known
                return
            columns = b.icmp_signed("<", self.dim(b, table, m), I64(n))
            if fusable:
                twice = b.mul(self.dim(b, table, m), I64(2))
                columns = b.and_(columns, b.icmp_signed("<", twice, I64(kk)))
            with b.if_else(columns) as (wide, tall):
                with wide:
                    split(True)
                with tall:
                    split(False)

    def _one_thread(self, b: ll.IRBuilder, table: ll.Value, k: Node) -> bool | ll.Value:
        """Whether the GEMM runs on one thread: decided when compiling, or, in a generic program,
        per call from the sizes probed (lowering.gemm.one_thread_sizes)."""
        sizes = k.attrs.get("one_thread_sizes")
        if sizes is None:
            return k.attrs.get("one_thread", False)
        j, first, same = sizes
        bits = ll.GlobalVariable(self.module, ll.ArrayType(I8, len(same)), self.unique(f"{self.prefix}_one_thread"))
        bits.initializer = ll.Constant(ll.ArrayType(I8, len(same)), bytearray(same))
        bits.global_constant = True
        at = b.sub(b.load(b.gep(table, [I64(self.symbol_slots[j])], source_etype=PTR), typ=I64), I64(first))
        inside = b.icmp_unsigned("<", at, I64(len(same)))
        bit = b.load(b.gep(bits, [b.select(inside, at, I64(0))], source_etype=I8), typ=I8)
        return b.and_(inside, b.icmp_unsigned("!=", bit, I8(0)))

    def _sgemm_call(
        self,
        b: ll.IRBuilder,
        table: ll.Value,
        blas: dict,
        m1: Access,
        m2: Access,
        c: Access,
        beta: float,
        one_thread: bool | ll.Value,
    ) -> None:
        a, bm = (m2, m1) if blas["swap"] else (m1, m2)
        t = lambda flag: I8(ord("T" if flag else "N"))  # noqa: E731
        args = [
            _ref(b, I8, t(blas["ta"])),
            _ref(b, I8, t(blas["tb"])),
            *(_ref(b, I32, self._i32(b, table, blas[d])) for d in "mnk"),
            _ref(b, F32, F32(1.0)),
            self.pointer(b, table, a),
            _ref(b, I32, self._i32(b, table, blas["lda"])),
            self.pointer(b, table, bm),
            _ref(b, I32, self._i32(b, table, blas["ldb"])),
            _ref(b, F32, F32(beta)),
            self.pointer(b, table, c),
            _ref(b, I32, self._i32(b, table, blas["ldc"])),
        ]
        self._blas(b, "sgemm_", [PTR] * 13, args, one_thread)

    # --- BMM ---------------------------------------------------------------------------------
    def _bmm(self, b: ll.IRBuilder, table: ll.Value, k: Node) -> None:
        """ATen's bmm for float32 (see lowering.gemm.bmm_blas_args): one cblas_sgemm_batch call, one
        group, with per-matrix pointers (batch2's as A, batch1's as B: column-major BLAS); or
        braze's GEMM kernel (_own_bmm)."""
        blas = k.attrs["blas"]
        if k.attrs.get("own_kernel"):
            self._own_bmm(b, table, k)
            return
        batch, c = blas["batch"], self.slot_of(k.name)
        strides = {"a": blas["stride_a"], "b": blas["stride_b"], "c": c.meta.stride[0]}
        arrays = {}
        count = self.dim(b, table, batch)
        for name, acc in (("a", self.slot_of(k.inputs[1])), ("b", self.slot_of(k.inputs[0])), ("c", c)):
            if isinstance(batch, int):
                with b.goto_entry_block():
                    arrays[name] = b.alloca(PTR, size=I64(batch))
            else:  # run once per call: a segment holds no loop around its kernels
                arrays[name] = b.alloca(PTR, size=count)
            first = self.pointer(b, table, acc)
            stride = self.dim(b, table, strides[name])
            with counted_loop(b, I64(0), count) as i:
                matrix = b.gep(first, [b.mul(i, stride)], source_etype=F32)
                b.store(matrix, b.gep(arrays[name], [i], source_etype=PTR))
        trans = lambda flag: I32(CBLAS_TRANS if flag else CBLAS_NO_TRANS)  # noqa: E731
        args = [
            I32(CBLAS_COL_MAJOR),
            _ref(b, I32, trans(blas["ta"])),
            _ref(b, I32, trans(blas["tb"])),
            *(_ref(b, I32, self._i32(b, table, blas[d])) for d in "mnk"),
            _ref(b, F32, F32(1.0)),
            arrays["a"],
            _ref(b, I32, self._i32(b, table, blas["lda"])),
            arrays["b"],
            _ref(b, I32, self._i32(b, table, blas["ldb"])),
            _ref(b, F32, F32(0.0)),
            arrays["c"],
            _ref(b, I32, self._i32(b, table, blas["ldc"])),
            I32(1),  # one group of `batch` matrices
            _ref(b, I32, b.trunc(count, I32)),
        ]
        self._blas(b, "cblas_sgemm_batch", [I32] + [PTR] * 13 + [I32, PTR], args)

    def _own_bmm(self, b: ll.IRBuilder, table: ll.Value, k: Node) -> None:
        """gemmkernel's kernel in place of cblas_sgemm_batch (lowering.gemm._own_bmm: fixed sizes),
        matrix by matrix: batch1's rows, all matrices' one after another, split between ATen's
        threads (a thread's range may start or end inside a matrix: the kernel computes any
        rows of it), each matrix's by its batch2 matrix, [K, N] or the transpose of [N, K]."""
        from .. import gemmkernel  # built on this module's helpers

        blas = k.attrs["blas"]
        rows, cols, depth, batch = blas["n"], blas["m"], blas["k"], blas["batch"]
        fn = self.kernel(gemmkernel, gemmkernel.NAME_NK if blas["ta"] else gemmkernel.NAME, gemmkernel.ARGS)
        x, w, c = self.slot_of(k.inputs[0]), self.slot_of(k.inputs[1]), self.slot_of(k.name)
        steps = ((x, blas["stride_b"]), (w, blas["stride_a"]), (c, c.meta.stride[0]))
        with self._clocked(b), self._ranged(b, table, "own_bmm", batch * rows * cols * depth, batch * rows) as ranged:
            kb, tbl, lo, hi = ranged
            with pieces(kb, lo, hi, I64(rows)) as (i, _, first, end):
                at = lambda t, step: kb.gep(self.pointer(kb, tbl, t), [kb.mul(i, I64(step))], source_etype=F32)  # noqa: E731
                x_i, w_i, c_i = (at(t, step) for t, step in steps)
                sizes = [I64(blas["ldc"]), ll.Constant(PTR, None), I64(0), I64(cols), I64(depth)]
                kb.call(fn, [x_i, I64(blas["ldb"]), w_i, I64(blas["lda"]), c_i, *sizes, first, end, I64(0)])


CBLAS_COL_MAJOR, CBLAS_NO_TRANS, CBLAS_TRANS = 102, 111, 112


def _bias_row(bias: TensorMeta, out: TensorMeta) -> bool:
    """Whether the bias is one row of the output's width, elements adjacent (the kernel reads it
    in place of ATen's copy of it into every row)."""
    n = out.shape[-1]
    return bias.numel == n and (n == 1 or bias.stride[-1] == 1) and bias.shape[-1] == n


def _ref(b: ll.IRBuilder, ty: ll.Type, v: ll.Constant) -> ll.Value:
    """A scalar passed by reference (BLAS's Fortran and array-of-groups interfaces)."""
    with b.goto_entry_block():
        slot = b.alloca(ty)
    b.store(v, slot)
    return slot


def _pixel_taps(
    b: ll.IRBuilder,
    image: ll.Value,
    to: ll.Value,
    window: tuple[int, int, int, int, int],
    corner: tuple[ll.Value, ll.Value],
    size: tuple[ll.Value, ll.Value],
    steps: tuple[ll.Value, ll.Value],
) -> None:
    """One patch of a channels-last image into `to`, K tap by tap: each tap's C channels from the
    pixel under it, zeros for a tap off the image."""
    (c, kh, kw, dh, dw), (y0, x0), (height, width), (row_step, col_step) = window, corner, size, steps
    with counted_loop(b, I64(0), I64(kh * kw)) as t:
        iy = b.add(y0, b.mul(b.sdiv(t, I64(kw)), I64(dh)))
        ix = b.add(x0, b.mul(b.srem(t, I64(kw)), I64(dw)))
        tap = b.gep(to, [b.mul(t, I64(c))], source_etype=F32)
        inside = b.and_(b.icmp_unsigned("<", iy, height), b.icmp_unsigned("<", ix, width))
        with b.if_else(inside) as (on, off):
            with on:
                pixel = b.add(b.mul(iy, row_step), b.mul(ix, col_step))
                _copy_floats(b, b.gep(image, [pixel], source_etype=F32), tap, c)
            with off:
                _copy_floats(b, None, tap, c)


def _plane_rows(
    b: ll.IRBuilder,
    image: ll.Value,
    to: ll.Value,
    window: tuple[int, int, int, int],
    corner: tuple[ll.Value, ll.Value],
    size: tuple[ll.Value, ll.Value],
    steps: tuple[ll.Value, ll.Value],
) -> None:
    """One patch of an NCHW image (its rows unit-strided) into `to`, K as [C, KH, KW]: for each
    channel and kernel row, the KW pixels from column x0 on (16 at a time; lanes off the image
    0), zeros for a row off the image."""
    (c, kh, kw, dh), (y0, x0), (height, width), (channel_step, row_step) = window, corner, size, steps
    columns = ll.Constant(ll.VectorType(I32, 16), list(range(16)))
    with counted_loop(b, I64(0), I64(c * kh)) as q:
        iy = b.add(y0, b.mul(b.srem(q, I64(kh)), I64(dh)))
        row = b.gep(image, [b.add(b.mul(b.sdiv(q, I64(kh)), channel_step), b.mul(iy, row_step))], source_etype=F32)
        out = b.gep(to, [b.mul(q, I64(kw))], source_etype=F32)
        on_image = splat(b, b.icmp_unsigned("<", iy, height), 16)
        for j in range(0, kw, 16):
            ix = b.add(splat(b, b.trunc(b.add(x0, I64(j)), I32), 16), columns)
            inside = b.icmp_unsigned("<", ix, splat(b, b.trunc(width, I32), 16))
            mask = b.and_(b.and_(inside, on_image), lanes_below(b, I64(kw - j)))
            value = masked_load(b, b.gep(row, [b.add(x0, I64(j))], source_etype=F32), mask)
            masked_store(b, value, b.gep(out, [I64(j)], source_etype=F32), lanes_below(b, I64(kw - j)))


def _copy_floats(b: ll.IRBuilder, src: ll.Value | None, dst: ll.Value, n: int) -> None:
    """n floats from src to dst (zeros where src is None), 16 at a time, the rest masked."""
    zero = ll.Constant(LANES16, [0.0] * 16)
    if n >= 16:
        with counted_loop(b, I64(0), I64(n - n % 16), 16) as i:
            v = zero if src is None else b.load(b.gep(src, [i], source_etype=F32), typ=LANES16, align=4)
            b.store(v, b.gep(dst, [i], source_etype=F32), align=4)
    if n % 16:
        mask, at = lanes_below(b, I64(n % 16)), I64(n - n % 16)
        v = zero if src is None else masked_load(b, b.gep(src, [at], source_etype=F32), mask)
        masked_store(b, v, b.gep(dst, [at], source_etype=F32), mask)
