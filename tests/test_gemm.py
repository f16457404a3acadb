"""GEMMs: braze calls MKL's sgemm_ with the arguments ATen's addmm would pass, so the bits match,
or its own kernel in MKL's order of operations where a probe shows the same bits."""

from __future__ import annotations

import functools
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import braze
from braze import config
from braze.accuracy import measure
from braze.ir import Op

from .helpers import check_model, needs_mkl_order

DIMS = [1, 7, 33, 64, 257]


@pytest.mark.parametrize("m", DIMS)
@pytest.mark.parametrize("k", [1, 7, 64, 257])
@pytest.mark.parametrize("n", [1, 10, 33, 64])
def test_linear_2d(m, k, n):
    w, b = torch.randn(n, k), torch.randn(n)
    check_model(lambda x: F.linear(x, w, b), (torch.randn(m, k),), kernels=1, externs=0)


@pytest.mark.parametrize("shape", [(2, 5, 33), (1, 1, 64), (4, 0, 8)], ids=str)
def test_linear_3d_flattens_like_aten(shape):
    w, b = torch.randn(17, shape[-1]), torch.randn(17)
    check_model(lambda x: F.linear(x, w, b), (torch.randn(*shape),), externs=0)


# Inputs of linear and matmul beside a matrix: ATen folds their leading dimensions into the rows
# of one GEMM (addmm when linear's input is contiguous and its bias a vector; else mm, then the
# bias added), unless they do not merge without a copy: then it runs bmm on a broadcast matrix.
ROWS = {
    "vector": (lambda: torch.randn(33), True),
    "3-D": (lambda: torch.randn(2, 7, 33), True),
    "4-D": (lambda: torch.randn(2, 3, 5, 33), True),
    "strided rows": (lambda: torch.randn(2, 14, 33)[:, ::2], True),
    "empty": (lambda: torch.randn(0, 3, 33), True),
    "permuted": (lambda: torch.randn(33, 5, 2).permute(2, 1, 0), False),
    "batch transposed": (lambda: torch.randn(7, 2, 33).transpose(0, 1), False),
}


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("rows", list(ROWS))
def test_linear_on_inputs_of_any_rank(rows, bias):
    make, folds = ROWS[rows]
    w, b = torch.randn(12, 33), torch.randn(12) if bias else None
    check_model(lambda x: F.linear(x, w, b), (make(),), externs=0 if folds else 1)
    layer = torch.nn.Linear(33, 12, bias=bias).eval()  # a parameter requires grad: ATen folds anyway
    check_model(layer, (make(),), externs=0)


@pytest.mark.parametrize("rows", list(ROWS))
def test_matmul_with_a_matrix_folds_as_aten_does(rows):
    make, folds = ROWS[rows]
    for w in (torch.randn(33, 10), torch.randn(10, 33).t(), torch.randn(33, 33)[:, :10]):
        check_model(torch.matmul, (make(), w), externs=0 if folds else 1)
    w = torch.randn(33, 10)
    check_model(lambda x: x @ w, (make(),), externs=0 if folds else 1)


@pytest.mark.parametrize("seed", range(4))
@torch.no_grad()
def test_a_linear_aten_folds_because_its_weight_requires_grad_keeps_eagers_bits(seed):
    # ATen's matmul folds a non-contiguous batch into one mm where the weight requires grad (a
    # parameter, even under no_grad), and otherwise takes another path with other sums: braze
    # must call it on the parameter itself, not on a tensor made over its memory
    torch.manual_seed(seed)
    layer = torch.nn.Linear(7, 1, bias=False)
    x = torch.randn(5, 2, 7).transpose(0, 1)
    check_model(lambda t: layer(t) * 1, (x,))
    check_model(torch.nn.Sequential(layer, torch.nn.ReLU()), (x,))


class _TokenMixing(torch.nn.Module):
    """MLP-Mixer's token mixing: Linear layers across the tokens, of a transposed input."""

    def __init__(self, tokens: int, hidden: int) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(16), nn.Linear(tokens, hidden), nn.Linear(hidden, tokens)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.gelu(self.fc1(self.norm(x).transpose(1, 2)))
        return x + self.fc2(y).transpose(1, 2)


@pytest.mark.parametrize("shape", [(1, 7, 16), (3, 33, 16), (2, 17, 16)], ids=str)
@pytest.mark.parametrize("n", [1, 2])
@torch.no_grad()
def test_a_linear_of_a_transposed_input_folds_where_its_weight_requires_grad(shape, n, threads):
    """ATen's matmul folds a batch whose dimensions do not merge into one mm (through a
    contiguous copy) where the weight requires grad, under no_grad too (should_fold), and runs a
    bmm on the weight broadcast where it does not. Native GEMMs for the first, an ATen call for
    the second; the entry checks the weight's requires_grad on every call: a change compiles
    again, and changed back the first program serves."""
    threads(n)
    torch.manual_seed(0)
    model = _TokenMixing(shape[1], 9).eval()
    x = torch.randn(*shape)
    x[0, 0, :3] = torch.tensor([float("nan"), float("inf"), -0.0])
    compiled = check_model(model, (x,), externs=0)
    assert compiled.programs()[-1].native
    model.fc1.weight.requires_grad_(False)
    check_model(model, (x,), compiled=compiled, externs=1)
    assert len(compiled.compilations) == 2 and "requires_grad changed" in compiled.compilations[-1].why
    model.fc1.weight.requires_grad_(True)
    check_model(model, (x,), compiled=compiled)
    assert len(compiled.compilations) == 2
    model.fc1.weight = nn.Parameter(model.fc1.weight.detach().clone(), requires_grad=False)  # replaced
    check_model(model, (x,), compiled=compiled)
    assert len(compiled.compilations) <= 3


@torch.no_grad()
def test_a_weight_given_as_an_argument_folds_by_its_own_requires_grad():
    """The same for a weight that comes as an argument (as TorchDynamo passes a model's
    parameters): the entry checks the argument's requires_grad."""
    w = torch.randn(5, 7, requires_grad=True)
    x = torch.randn(3, 7, 2).transpose(1, 2)  # [3, 2, 7], its batch and rows do not merge

    def fn(t: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.relu(F.linear(t, weight))

    compiled = braze.compile(fn)
    for weight, externs in ((w, 0), (w.detach(), 1), (w, 0)):  # (check_model's copies require no grad)
        assert torch.equal(compiled(x, weight), fn(x, weight))
        assert len(compiled.programs()[-1].externs) == externs
    assert not torch.equal(fn(x, w), fn(x, w.detach()))  # (ATen's two paths: other sums)
    assert "requires_grad changed" in compiled.compilations[-1].why and len(compiled.compilations) == 3


class _Branching(_TokenMixing):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) if x.shape[1] > 1 else x  # (torch.fx cannot trace the branch)


@torch.no_grad()
def test_token_mixing_captured_by_torchdynamo_folds_natively():
    """A model torch.fx cannot trace is TorchDynamo's graph, whose arguments are its
    parameters: their requires_grad decides, as for a module's own."""
    torch.manual_seed(0)
    model = _Branching(7, 9).eval()
    x = torch.randn(2, 7, 16)
    compiled = braze.compile(model)
    assert torch.equal(compiled(x), model(x))
    (graph,) = compiled._subgraphs
    assert [p.externs for p in graph.programs()] == [[]] and graph.programs()[0].native


def test_matmul_aten_does_not_run_as_a_gemm_runs_through_aten():
    m, v = torch.randn(10, 33), torch.randn(33)
    check_model(torch.matmul, (m, v), externs=1)  # mv
    check_model(torch.matmul, (m, torch.randn(2, 33, 4)), externs=1)  # a matrix times a batch


@pytest.mark.parametrize(
    "a_t,b_t", [(False, False), (True, False), (False, True), (True, True)], ids=["NN", "TN", "NT", "TT"]
)
def test_mm_and_addmm_layouts(a_t, b_t):
    a = torch.randn(40, 31).t() if a_t else torch.randn(31, 40)
    b = torch.randn(23, 40).t() if b_t else torch.randn(40, 23)
    check_model(torch.mm, (a, b), kernels=1, externs=0)
    bias = torch.randn(23)
    check_model(lambda x, y: torch.addmm(bias, x, y), (a, b), kernels=1, externs=0)
    check_model(lambda x, y: x @ y, (a, b), kernels=1, externs=0)


def test_sliced_operands():
    a = torch.randn(40, 64)[::2, 3:50]  # leading dimension larger than the row
    b = torch.randn(47, 30)
    check_model(torch.mm, (a, b), externs=0)
    check_model(torch.mm, (torch.randn(6, 8)[:, ::2], torch.randn(4, 3)))  # ATen clones: extern


def test_zero_sized_gemms():
    w0, b, w, z = torch.randn(5, 0), torch.randn(5), torch.randn(5, 4), torch.randn(0, 6)
    check_model(lambda x: F.linear(x, w0, b), (torch.randn(3, 0),), externs=0)  # K == 0: bias only
    check_model(lambda x: F.linear(x, w), (torch.randn(0, 4),), externs=0)
    check_model(lambda x: x @ z, (torch.randn(3, 0),), externs=0)  # K == 0, no bias: zeros


def test_epilogue_is_fused_into_the_gemm():
    w, b = torch.randn(64, 64), torch.randn(64)
    compiled = check_model(lambda x: torch.relu(F.linear(x, w, b)) * 0.5 + x, (torch.randn(32, 64),), kernels=1)
    gemm = next(n for n in compiled.programs()[0].graph.nodes if n.op.value == "gemm")
    assert [b.op.value for b in gemm.body] == ["relu", "mul", "add"]


def test_epilogue_reads_the_gemm_through_a_reshape():
    """A Linear of [B, T, D] is a GEMM of [B*T, D] viewed as [B, T, N]: the GELU and the residual
    add after it run in the GEMM's epilogue, as does a 1 x 1 squeeze-excite's reshape to
    [1, C, 1, 1], whose bias (of [C]) must still be laid out over the GEMM's [1, C]."""
    w1, b1, w2, b2 = torch.randn(48, 16), torch.randn(48), torch.randn(16, 48), torch.randn(16)

    def mlp(x):
        return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2) + x

    for shape in [(3, 7, 16), (1, 1, 16), (2, 33, 16)]:
        compiled = check_model(mlp, (torch.randn(*shape),), kernels=2, externs=0)
        bodies = [[b.op.value for b in n.body] for n in compiled.programs()[0].graph.nodes if n.op is Op.GEMM]
        assert bodies == [["gelu_erf"], ["add"]]
    se = lambda x: F.hardsigmoid(F.linear(x, w1, b1).view(1, 48, 1, 1)) * 2  # noqa: E731
    check_model(se, (torch.randn(1, 16),), kernels=1, externs=0)


def test_epilogue_reads_through_a_view_that_permutes_the_product():
    """Eager's elementwise result keeps a permuted view's layout, so each element is written where
    the product has it: the loop is the GEMM's epilogue (walking memory in order), and it is
    eager's; what reads it through another view after that is a loop of its own."""
    w, y = torch.randn(12, 8), torch.randn(6, 2, 12)
    compiled = check_model(lambda x: F.linear(x, w).view(6, 2, 12).transpose(0, 1) * 2, (torch.randn(12, 8),))
    gemm = next(n for n in compiled.programs()[0].graph.nodes if n.op is Op.GEMM)
    assert [b.op.value for b in gemm.body] == ["mul"]
    compiled = check_model(
        lambda x: (F.linear(x, w).view(6, 2, 12).transpose(0, 1) * 2).transpose(0, 1) + y, (torch.randn(12, 8),)
    )
    assert compiled.programs()[0].kernel_count == 2


def test_thread_counts_match_eager():
    w, b = torch.randn(300, 257), torch.randn(300)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            check_model(lambda x: F.linear(x, w, b).relu(), (torch.randn(129, 257),), kernels=1)
            check_model(torch.bmm, (torch.randn(6, 65, 257), torch.randn(6, 257, 33)), kernels=1)
    finally:
        torch.set_num_threads(before)


def _batch(b: int, r: int, c: int, transposed: bool) -> torch.Tensor:
    return torch.randn(b, c, r).transpose(1, 2) if transposed else torch.randn(b, r, c)


@pytest.mark.parametrize(
    "batch,m,k,n",
    [(2, 7, 33, 5), (4, 8, 16, 6), (3, 1, 257, 10), (5, 33, 64, 1), (12, 7, 64, 7), (2, 20, 1, 30), (3, 1, 512, 1)],
)
@pytest.mark.parametrize("a_t,b_t", [(False, False), (True, False), (False, True), (True, True)])
def test_bmm_is_mkls_batched_gemm_as_aten_calls_it(batch, m, k, n, a_t, b_t):
    # ATen's bmm calls cblas_sgemm_batch for these (checked under gdb): braze makes the same call.
    a, b = _batch(batch, m, k, a_t), _batch(batch, k, n, b_t)
    compiled = check_model(torch.bmm, (a, b), kernels=1, externs=0)
    assert [k.op.value for s in compiled.programs()[0].segments for k in s.kernels] == ["bmm"]
    check_model(lambda x, y: (x.bmm(y) * 2).relu(), (a, b), kernels=2, externs=0)
    check_model(lambda x, y: x @ y, (a, b), kernels=1, externs=0)  # matmul, equal batches: bmm


@pytest.mark.parametrize(
    "a,b",
    [
        (torch.randn(3, 2, 3), torch.randn(3, 3, 2)),  # under 400 multiply-adds: ATen's own loop
        (torch.randn(1, 8, 64), torch.randn(1, 64, 8)),  # one matrix: ATen calls sgemm_
        (torch.randn(2, 8, 128)[:, :, ::2], torch.randn(2, 64, 8)),  # strided matrices: addmm each
        (torch.randn(2, 0, 8), torch.randn(2, 8, 4)),  # empty
        (torch.randn(2, 8, 0), torch.randn(2, 0, 4)),  # K = 0: zeros
    ],
    ids=["small", "one", "strided", "empty", "k0"],
)
def test_bmm_aten_computes_otherwise_runs_through_aten(a, b):
    check_model(torch.bmm, (a, b))
    check_model(torch.matmul, (a, b))


def _bmm_own(compiled, program: int = -1) -> list:
    kernels = [k for s in compiled.programs()[program].segments for k in s.kernels]
    return [k.attrs.get("own_kernel") for k in kernels if k.op is Op.BMM]


@pytest.mark.parametrize(
    "batch,m,k,n", [(2, 16, 2, 16), (3, 17, 33, 31), (16, 128, 64, 128), (5, 33, 193, 40), (2, 257, 385, 17)]
)
@pytest.mark.parametrize("b_t", [False, True])
def test_bmm_of_row_major_matrices_is_braze_kernel_with_eagers_bits(batch, m, k, n, b_t, threads):
    needs_mkl_order()
    # Matrix by matrix in MKL's order, the batch's rows split between the threads (a thread's
    # share may end inside a matrix): scores (keys transposed, b_t) and values of attention,
    # with NaN, infinities, signed zeros and denormals in the first matrices' rows.
    a, b = _batch(batch, m, k, False), _batch(batch, k, n, b_t)
    a[0, 0, :5] = torch.tensor([float("nan"), float("inf"), -0.0, 1e-41, -float("inf")])[: min(k, 5)]
    a[-1, -1] = -0.0
    for t in (1, 2):
        threads(t)
        compiled = check_model(torch.bmm, (a, b), kernels=1, externs=0)
        assert _bmm_own(compiled) == [True]
        check_model(lambda x, y: (x @ y).relu(), (a, b), kernels=2, externs=0)
    assert "braze's GEMM kernel (MKL's order), matrix by matrix" in braze.explain(torch.bmm, a, b)


def test_bmm_is_mkls_where_the_kernel_cannot_or_its_probe_disagrees(threads, monkeypatch):
    from braze import gemmkernel

    threads(2)
    a, b = _batch(4, 32, 24, False), _batch(4, 24, 40, False)
    at = _batch(4, 32, 24, True)  # row-major transposes: MKL's other operand layout
    assert _bmm_own(check_model(torch.bmm, (at, b), kernels=1, externs=0)) == [False]
    assert _bmm_own(check_model(torch.bmm, (a[:, :8], b), kernels=1, externs=0)) == [False]  # < 16 rows
    with config.patch(own_gemm=False):
        assert _bmm_own(check_model(torch.bmm, (a, b), kernels=1, externs=0)) == [False]
    monkeypatch.setattr(gemmkernel, "same_batched", lambda b1, b2: False)
    assert _bmm_own(check_model(torch.bmm, (a, b), kernels=1, externs=0)) == [False]


def test_bmm_on_the_kernel_follows_the_thread_count(threads):
    needs_mkl_order()
    # Probed at MKL's thread count: on another, a program of its own (its own probe)
    threads(2)
    a, b = _batch(4, 32, 24, False), _batch(4, 24, 40, True)
    compiled = check_model(torch.bmm, (a, b), kernels=1, externs=0)
    threads(1)
    check_model(torch.bmm, (a, b), compiled=compiled)
    assert len(compiled.programs()) == 2
    threads(2)
    check_model(torch.bmm, (a, b), compiled=compiled)
    assert len(compiled.programs()) == 2 and _bmm_own(compiled, 0) == [True]


@pytest.mark.parametrize("heads_first", [True, False])
def test_matmul_of_more_batch_dimensions_is_one_bmm(heads_first):
    # Attention written by hand: (batch, heads, seq, dim) @ its keys transposed. ATen reshapes
    # both to (batch * heads, ...) (a copy where they do not merge) and calls bmm.
    q = torch.randn(2, 4, 33, 16)
    k = torch.randn(2, 4, 33, 16) if heads_first else torch.randn(2, 33, 4, 16).transpose(1, 2)
    check_model(lambda x, y: x @ y.transpose(-1, -2), (q, k), externs=0)
    check_model(torch.matmul, (torch.randn(2, 2, 3, 20, 24), torch.randn(2, 2, 3, 24, 30)), kernels=1, externs=0)


def test_batched_matmul_that_broadcasts_runs_through_aten():
    check_model(torch.matmul, (torch.randn(4, 8, 16), torch.randn(1, 16, 6)), externs=1)


@pytest.mark.parametrize("setting", ["bf16", "tf32"])
def test_a_matmul_precision_set_after_compiling_is_followed(setting):
    # Under a reduced precision ATen may call oneDNN's GEMM (on CPUs with bf16 or AMX): the
    # compiled sgemm_ must not run then; the precision set back, it runs again.
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)).eval()
    cases = [(model, (torch.randn(32, 64),)), (lambda a: torch.bmm(a, a.transpose(1, 2)), (torch.randn(4, 16, 32),))]
    for fn, args in cases:
        compiled = check_model(fn, args, externs=0)
        before = torch.backends.mkldnn.matmul.fp32_precision
        try:
            torch.backends.mkldnn.matmul.fp32_precision = setting
            check_model(fn, args, compiled=compiled)
            assert len(compiled.programs()) == 2 and not compiled.programs()[-1]._gemms()
        finally:
            torch.backends.mkldnn.matmul.fp32_precision = before
        check_model(fn, args, compiled=compiled)
        assert len(compiled.programs()) == 2  # the first program again, not a third


def _gemm_attr(attr: str, compiled, program: int = -1) -> list:
    """Attribute `attr` of each GEMM kernel of a compiled wrapper's program (the last: -1)."""
    kernels = [k for s in compiled.programs()[program].segments for k in s.kernels]
    return [k.attrs.get(attr, 0) for k in kernels if k.op is Op.GEMM]


_one_thread = functools.partial(_gemm_attr, "one_thread")
_own = functools.partial(_gemm_attr, "own_kernel")  # the fewest rows it runs at; 0: sgemm_


@pytest.mark.parametrize("rows", [1, 7, 32, 33, 257])
def test_small_gemms_run_on_one_thread_only_where_mkl_gives_the_same_bits(rows, threads):
    # The oracle is eager's own addmm on one thread and on two: where they differ (here 7 rows,
    # where MKL orders the sums differently on two threads), braze keeps MKL's two threads.
    w, b, x = torch.randn(64, 64), torch.randn(64), torch.randn(rows, 64)
    eager = []
    for n in (1, 2):
        threads(n)
        eager.append(F.linear(x, w, b).view(torch.int32))
    compiled = check_model(lambda x: F.linear(x, w, b), (x,), kernels=1)
    small = 2 * rows * 64 * 64 < config.one_thread_gemm_flops
    assert _one_thread(compiled) == [small and torch.equal(*eager)]


def test_a_thread_count_set_after_compiling_is_followed(threads):
    # GEMMs probed for two threads run on one; on three threads eager's MKL may order its sums
    # otherwise, so that program must not run (here a second one compiles); back on two, the
    # first runs again.
    threads(2)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)).eval()
    x = torch.randn(32, 64)
    compiled = check_model(model, (x,), externs=0)
    if _one_thread(compiled) != [True, True]:  # on this machine they are (README)
        pytest.skip("MKL orders these GEMMs' sums differently on one thread on this CPU")
    threads(3)
    check_model(model, (x,), compiled=compiled)
    assert len(compiled.programs()) == 2
    threads(2)
    check_model(model, (x,), compiled=compiled)
    assert len(compiled.programs()) == 2


def test_one_thread_gemms_are_a_knob(threads):
    threads(2)
    with config.patch(one_thread_gemm_flops=0):
        compiled = check_model(torch.nn.Linear(64, 64), (torch.randn(32, 64),), kernels=1)
    assert _one_thread(compiled) == [False]


def test_the_probe_draws_float32_under_any_default_dtype(threads, monkeypatch):
    # float64 memory read as float32 by sgemm_ is mostly huge, tiny or NaN values: it could hide
    # an order that changed.
    from braze import jit

    seen, sgemm = [], jit._sgemm

    def recording(call, a, b, beta, c):  # noqa: ANN001, ANN202
        seen.extend((a, b, c))
        return sgemm(call, a, b, beta, c)

    monkeypatch.setattr(jit, "_sgemm", recording)
    threads(2)
    jit._PROBED.clear()
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        jit.one_thread_same(dict(ta=True, tb=False, m=64, n=32, k=64, lda=64, ldb=64, ldc=64), 1.0)
    finally:
        torch.set_default_dtype(before)
    assert len(seen) == 12 and all(t.dtype == torch.float32 for t in seen)  # 2 alignments x 2 calls


# --- braze's own GEMM kernel (gemmkernel.py): MKL's order of operations, X @ W of a weight ---


@pytest.mark.parametrize("rows", [32, 33, 257])
@pytest.mark.parametrize("k", [2, 7, 17, 192, 193, 383, 385, 1000])
@pytest.mark.parametrize("n", [16, 33, 100])
@pytest.mark.parametrize("layout", ["KN", "NK", "packed"])
def test_own_kernel_matches_mkl_bit_for_bit(rows, k, n, layout, threads):
    needs_mkl_order()
    # The kernel on its own, against eager's addmm and mm (linear, for a [N, K] weight, packed
    # per call or, as fast mode keeps it, once) on both thread counts: K across MKL's blocks of
    # 192 (and its halves below 384) and the 16 x 16 transposes, N across the 32-column panels,
    # rows across the 6-row blocks; values of many scales with NaN, infinities, signed zeros and
    # denormals.
    from braze import gemmkernel, jit

    linear, packed = layout != "KN", layout == "packed"

    x, w, bias = torch.randn(rows, k) * torch.logspace(-3, 3, rows).unsqueeze(1), torch.randn(k, n), torch.randn(n)
    x[0, : min(k, 5)] = torch.tensor([float("nan"), float("inf"), -0.0, 1e-41, -float("inf")])[: min(k, 5)]
    x[1] = -0.0
    if linear:
        w = w.t().contiguous()
    for t in (1, 2):
        threads(t)
        eager = (F.linear(x, w, bias), F.linear(x, w)) if linear else (torch.addmm(bias, x, w), x @ w)
        assert jit.same_bits(gemmkernel.gemm(x, w, bias, linear, packed), eager[0], nan_payloads=False)
        assert jit.same_bits(gemmkernel.gemm(x, w, None, linear, packed), eager[1], nan_payloads=False)


def test_native_code_reads_a_tensors_version_where_python_does():
    from braze import jit

    t = torch.nn.Parameter(torch.randn(4, 3))
    counter, count = jit.tensor_version(t)
    with torch.no_grad():
        view = t[1:]
        for _ in range(3):
            view.mul_(2.0)  # a view's changes move its base's version
    assert jit.tensor_version(t) == jit.tensor_version(view) == (counter, count + 3) == (counter, t._version)
    t.data.mul_(2.0)  # `.data` has a counter of its own: not seen (fast mode's documented limit)
    assert jit.tensor_version(t) == (counter, t._version)
    with torch.inference_mode():
        assert jit.tensor_version(torch.ones(2)) is None


@pytest.mark.parametrize("bias", ["row", "column", "none"])
@pytest.mark.parametrize("linear", [False, True], ids=["conv1d", "linear"])
@pytest.mark.parametrize("n", [80, 300])
def test_gemms_of_a_weight_run_braze_kernel(bias, linear, n, threads):
    needs_mkl_order()
    # GPT-2's Conv1D (addmm(bias, x, W) with W [K, N]) and linear (W [N, K]), with a GELU
    # epilogue; 64 rows split between the threads, or 300 columns (in 32-column panels, the last
    # narrower). A bias row is read by the kernel; another bias is copied into the output first,
    # as ATen does.
    threads(2)
    w = torch.randn(96, n) * 0.1
    b = {"row": torch.randn(n), "column": torch.randn(64, 1), "none": None}[bias]
    if linear:
        wt = w.t().contiguous()
        fn = (lambda x: F.gelu(F.linear(x, wt) + b)) if bias == "column" else (lambda x: F.gelu(F.linear(x, wt, b)))
    else:
        fn = (lambda x: F.gelu(torch.addmm(b, x, w))) if b is not None else (lambda x: F.gelu(x @ w))
    compiled = check_model(fn, (torch.randn(64, 96),), kernels=1, externs=0)
    assert _own(compiled)[0] > 0


@pytest.mark.parametrize("linear", [False, True], ids=["conv1d", "linear"])
def test_own_kernel_serves_every_row_count_of_a_generic_program(linear, threads):
    needs_mkl_order()
    # Below 16 rows per MKL thread MKL takes another path: a generic program checks the row count
    # on each call and calls sgemm_ there. With linear's weight it splits columns between the
    # threads while there are fewer rows than columns (here up to 79), else rows.
    threads(2)
    w, b = torch.randn(96, 80) * 0.1, torch.randn(80)
    wt = w.t().contiguous()

    def fn(x: torch.Tensor) -> torch.Tensor:
        rows = x.view(-1, 96)
        y = F.linear(rows, wt, b) if linear else torch.addmm(b, rows, w)
        return y.view(*x.shape[:-1], 80)

    compiled = braze.compile(fn)
    for t in (40, 41, 3, 17, 100, 16, 15, 257, 1, 39):
        check_model(fn, (torch.randn(2, t, 96),), compiled=compiled)
    generic = [i for i, p in enumerate(compiled.programs()) if p.family is not None]
    assert generic and _own(compiled, generic[0])[0] > 0
    assert _kernel_first(compiled, generic[0])


def _kernel_first(compiled, i: int) -> bool:
    """Whether generic program i's body decides between the kernel and sgemm_ (by the row count)
    before anything runs: the kernel reads the bias row itself, and only sgemm_'s path copies
    it into the output first (it was copied before the branch, on every call)."""
    body = re.search(r'define void @"\w+_seg0".*?\n}\n', compiled.programs()[i].llvm_ir, re.S).group(0)
    return re.search(r"icmp \w+ i64 %\S+, (\d+)", body).group(1) == str(_own(compiled, i)[0])


def _epilogue_with_rows(fn, *inputs, mode: str = "exact") -> bool:
    """Whether the program for these sizes (not a generic one, which decides per call) has its
    own-kernel GEMM call its epilogue's loop itself (on each thread's rows), rather than the
    epilogue running as a pass of its own."""
    ir = braze.explain(braze.compile(fn, mode=mode, dynamic=False), *inputs).sections["LLVM IR"]
    gemm = re.search(r'define internal void @"own_gemm\d*"\(.*?\n}\n', ir, re.S)
    return bool(gemm and re.search(r'call void @"loop\d+"', gemm.group(0)))


@pytest.mark.parametrize("tokens", [33, 64, 257])
def test_epilogue_runs_on_each_threads_rows_right_after_them(tokens, threads):
    needs_mkl_order()
    # A [K, N] weight splits the product's rows between the threads; each thread takes its rows
    # through the epilogue (tanh, a residual add) as soon as the kernel has them. A positional
    # term [T, N] makes the epilogue's loops [B, T * N], which do not follow the product's rows:
    # there it is a pass of its own. A generic program does the same at every size.
    threads(2)
    w, b, pos = torch.randn(96, 80) * 0.1, torch.randn(80), torch.randn(tokens, 80)

    def fused(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return torch.tanh(torch.addmm(b, x.reshape(-1, 96), w).view(*x.shape[:-1], 80)) + r

    def apart(x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(b, x.reshape(-1, 96), w).view(*x.shape[:-1], 80) + pos

    x, r = torch.randn(2, tokens, 96), torch.randn(2, tokens, 80)
    check_model(fused, (x, r), kernels=1, externs=0)
    check_model(apart, (x,), kernels=1, externs=0)
    assert _epilogue_with_rows(fused, x, r) and not _epilogue_with_rows(apart, x)
    compiled = braze.compile(fused)
    for t in (tokens, tokens + 1, 40, 100, 17):
        check_model(fused, (torch.randn(2, t, 96), torch.randn(2, t, 80)), compiled=compiled)
    assert any(p.family is not None for p in compiled.programs())


@pytest.mark.parametrize("mode", ["exact", "fast"])
@pytest.mark.parametrize("depth,with_rows", [(64, True), (256, True), (320, False)])
def test_linear_with_an_epilogue_splits_rows_while_k_is_at_most_twice_the_rows(depth, with_rows, mode, threads):
    # linear's [N, K] weight with more columns than rows would split its panels; with an epilogue
    # that follows the rows it splits rows while K <= 2 M (each thread packs all of the weight,
    # or in fast mode reads all of its panels, and the epilogue runs on its rows). Also per call
    # in a generic program. (Exact mode's kernel only where it gives MKL's bits; fast mode's on
    # the weight packed once, on any CPU.)
    if mode == "exact":
        needs_mkl_order()
    threads(2)
    torch.manual_seed(depth)
    layer = nn.Linear(depth, 300).eval()

    def fn(x: torch.Tensor) -> torch.Tensor:
        return F.gelu(layer(x))

    compiled = braze.compile(fn, mode=mode)
    for rows in (128, 129, 40, 300, 63, 64, 65):
        x = torch.randn(rows, depth)
        if mode == "exact":
            check_model(fn, (x,), compiled=compiled, kernels=None if rows != 128 else 1, externs=0)
        else:
            with torch.no_grad():
                reference = F.gelu(F.linear(x.double(), layer.weight.double(), layer.bias.double()))
                assert measure(compiled(x), fn(x), reference).ok
    assert _epilogue_with_rows(fn, torch.randn(128, depth), mode=mode) is with_rows
    generic = [i for i, p in enumerate(compiled.programs()) if p.family is not None]
    assert generic and _kernel_first(compiled, generic[0])


def test_own_kernel_falls_back_to_sgemm_where_its_probe_disagrees(threads, monkeypatch):
    from braze import gemmkernel

    threads(2)
    monkeypatch.setattr(gemmkernel, "same", lambda shapes, linear=False: False)
    w = torch.randn(96, 80)
    compiled = check_model(lambda x: x @ w, (torch.randn(64, 96),), kernels=1, externs=0)
    assert _own(compiled) == [0]
    assert "braze's GEMM kernel" not in braze.explain(lambda x: x @ w, torch.randn(64, 96))


def test_own_kernel_is_a_knob_and_skips_small_gemms(threads):
    needs_mkl_order()
    threads(2)
    w = torch.randn(96, 80)
    with config.patch(own_gemm=False):
        assert _own(check_model(lambda x: x @ w, (torch.randn(64, 96),), kernels=1)) == [0]
    assert _own(check_model(lambda x: x @ w, (torch.randn(64, 96),), kernels=1)) != [0]
    big = torch.randn(1024, 512)
    assert _own(check_model(lambda x: x @ big, (torch.randn(31, 1024),), kernels=1)) == [0]  # < 16 rows a thread
    assert _own(check_model(lambda x: x @ w[:16, :16], (torch.randn(40, 16),), kernels=1)) == [0]  # < 0.5 MFLOP
    assert _own(check_model(lambda x: x @ big[:, :8], (torch.randn(64, 1024),), kernels=1)) == [0]  # < 16 columns
    assert _own(check_model(lambda x: x @ big[:1], (torch.randn(4096, 1),), kernels=1)) == [0]  # K = 1


def test_own_kernel_programs_follow_the_thread_count(threads):
    needs_mkl_order()
    # Probed at MKL's thread count: on another one a program that uses the kernel must not run
    # (MKL may split rows so that some take its other path); a second program compiles, with
    # its own probe (on three threads here it disagrees: MKL's own path), and the first runs
    # again back on two threads.
    threads(2)
    w = torch.randn(96, 80)
    compiled = check_model(lambda x: x @ w, (torch.randn(64, 96),), kernels=1)
    assert _own(compiled)[0] == 35  # 0.5 MFLOP at K 96, N 80
    threads(3)
    check_model(lambda x: x @ w, (torch.randn(64, 96),), compiled=compiled)
    assert len(compiled.programs()) == 2
    threads(2)
    check_model(lambda x: x @ w, (torch.randn(64, 96),), compiled=compiled)
    assert len(compiled.programs()) == 2


def _chains(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, chunk: int, seeded: bool, linear: bool):
    """The blocked order gemmkernel's kernels follow, in float64 per step (an FMA rounds once: a
    float32 product is exact in float64, and the sums here are far from double rounding's rare
    ties): K in blocks of `chunk`, each an FMA chain from 0 added to the output so far, which
    starts as the bias row; seeded: the first block's chain starts at the bias instead (a value
    per row for w [K, N], a row for linear's)."""
    w = w.t() if linear else w
    m, (k, n) = x.shape[0], w.shape
    rows = None if bias is None else bias.view(-1, 1) if seeded and not linear else bias.view(1, -1)
    out = None if seeded or rows is None else rows.expand(m, n)
    for k0 in range(0, k, chunk):
        acc = rows.expand(m, n) if seeded and k0 == 0 and rows is not None else torch.zeros(m, n)
        for kk in range(k0, min(k, k0 + chunk)):
            acc = (x[:, kk : kk + 1].double() * w[kk : kk + 1].double() + acc.double()).float()
        out = acc if out is None else out + acc
    return out


@pytest.mark.parametrize("linear", [False, True])
@pytest.mark.parametrize("seeded", [False, True])
@pytest.mark.parametrize("k,chunk", [(40, 40), (40, 16), (33, 16), (640, 80), (700, 256), (17, 200)])
@pytest.mark.parametrize("m", [1, 13, 64])
def test_the_kernels_block_size_and_seed_give_the_blocked_order(m, k, chunk, seeded, linear):
    """gemmkernel's drivers with a block of K given and the sums seeded (oneDNN's 1 x 1 convolution
    orders, docs/aten-bits.md) against a reference of the order itself, not eager's: blocks of
    16 to 256 (over KC: a panel on the heap), K not a multiple of them or of the block kernels'
    two steps a turn, odd N; rows in blocks of 1, of 4 and 5, of 5 and 6."""
    from braze import gemmkernel

    torch.manual_seed(k + chunk)
    n = 37
    x, w = torch.randn(m, k), torch.randn(n, k) if linear else torch.randn(k, n)
    bias = torch.randn(m if seeded and not linear else n)
    got = gemmkernel.gemm(x, w, bias, linear, chunk=chunk, seeded=seeded)
    assert torch.equal(got, _chains(x, w, bias, chunk, seeded, linear))


_NO_PANEL_MEMORY = """
import torch
from braze import gemmkernel
torch.manual_seed(0)
cases = [(700, l, s, b) for l in (0, 1) for s in (0, 1) for b in (0, 1) if b or not s]
for k, linear, seeded, bias in cases + [(193, 1, 0, 1)]:
    x, w = torch.randn(13, k), torch.randn(37, k) if linear else torch.randn(k, 37)
    b = torch.randn(13 if seeded and not linear else 37) if bias else None
    # one block of K either way; of 2^55, the panel's 2^62 bytes, which aligned_alloc refuses
    one = gemmkernel.gemm(x, w, b, bool(linear), chunk=k, seeded=bool(seeded))
    print(torch.equal(gemmkernel.gemm(x, w, b, bool(linear), chunk=1 << 55, seeded=bool(seeded)), one))
"""


def test_a_block_whose_panel_the_heap_refuses_is_computed_in_pieces_with_the_same_bits():
    # (a subprocess: the kernel wrote the panel through a null pointer)
    proc = subprocess.run([sys.executable, "-c", _NO_PANEL_MEMORY], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.split() == ["True"] * 7, (proc.stdout, proc.stderr[-2000:])
