"""GEMMs: braze calls MKL's sgemm_ with the arguments ATen's addmm would pass, so the bits match."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from .helpers import check_model

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


def test_linear_without_bias_and_3d_non_contiguous():
    w = torch.randn(12, 33)
    check_model(lambda x: F.linear(x, w), (torch.randn(7, 33),), kernels=1, externs=0)
    x, b = torch.randn(33, 5, 2).permute(2, 1, 0), torch.randn(12)
    check_model(lambda x: F.linear(x, w, b), (x,), externs=1)  # ATen's matmul path


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


def test_thread_counts_match_eager():
    w, b = torch.randn(300, 257), torch.randn(300)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            check_model(lambda x: F.linear(x, w, b).relu(), (torch.randn(129, 257),), kernels=1)
    finally:
        torch.set_num_threads(before)
