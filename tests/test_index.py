"""embedding as native row copies: eager's values and layout, and eager's IndexError for an index
outside the weight, from native bodies and Python bodies, on 1 and 2 threads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import braze

from .helpers import assert_same, check_model
from .test_ops import special


class _Lookup(torch.nn.Module):
    def __init__(self, rows: int, width: int) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(rows, width)
        with torch.no_grad():
            self.emb.weight.copy_(special(rows, width))

    def forward(self, i: torch.Tensor) -> torch.Tensor:
        return self.emb(i)


INDEX_SHAPES = [(1,), (7,), (3, 17), (2, 3, 5), (33, 257)]


@pytest.mark.parametrize("shape", INDEX_SHAPES)
@pytest.mark.parametrize("rows,width", [(1, 1), (10, 7), (257, 16), (33, 33)])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_embedding_is_one_native_kernel(shape, rows, width, dtype):
    idx = torch.randint(0, rows, shape, dtype=dtype)
    check_model(_Lookup(rows, width).eval(), (idx,), kernels=1, externs=0)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randint(0, 10, (5, 4)).t(),  # transposed
        lambda: torch.randint(0, 10, (1, 6)).expand(4, 6),  # broadcast: stride 0 (BERT's token types)
        lambda: torch.randint(0, 10, (4, 12))[:, ::3],  # strided
        lambda: torch.tensor(3),  # a 0-d index: one row
    ],
)
def test_embedding_of_index_layouts(make):
    check_model(_Lookup(10, 9).eval(), (make(),), kernels=1, externs=0)


def test_embedding_of_a_weight_with_strided_rows_and_a_function_call():
    weight = special(12, 40)[:, 3:20]  # rows of 17 elements, 40 apart

    def f(i: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.embedding(i, w, padding_idx=0) * 2

    check_model(f, (torch.randint(0, 12, (6, 5)), weight), kernels=2, externs=0)


def test_embedding_with_max_norm_stays_atens_and_renormalises_as_eager():
    torch.manual_seed(0)
    model, twin = torch.nn.Embedding(10, 4, max_norm=1.0), torch.nn.Embedding(10, 4, max_norm=1.0)
    twin.load_state_dict(model.state_dict())
    idx = torch.tensor([1, 2, 2, 7])
    c = braze.compile(model)
    with torch.no_grad(), pytest.warns(braze.BrazeWarning, match="in place"):
        assert torch.equal(c(idx), twin(idx))
    assert torch.equal(model.weight, twin.weight)  # renormalised in place, as eager did


def _with_extern(emb: torch.nn.Module) -> torch.nn.Module:
    class WithExtern(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = emb

        def forward(self, i: torch.Tensor) -> torch.Tensor:
            return torch.sinh(self.emb(i))  # an ATen call native code does not make: a Python body

    return WithExtern()


@pytest.mark.parametrize("python_body", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bad", [10, -1, 2**40])
def test_an_index_out_of_range_raises_eagers_error(python_body, threads, bad):
    model = _Lookup(10, 8).eval()
    model = _with_extern(model) if python_body else model
    c = braze.compile(model)
    good = torch.randint(0, 10, (40000,))  # split between threads from 32768 elements
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            assert_same(c(good), model(good))
            for at in (0, 39999):  # in the first and in the last thread's share
                wrong = good.clone()
                wrong[at] = bad
                with pytest.raises(IndexError, match="index out of range in self"):
                    model(wrong)
                with pytest.raises(IndexError, match="index out of range in self"):
                    c(wrong)
            assert_same(c(good), model(good))  # and the next call is right again
    finally:
        torch.set_num_threads(prev)
    assert len(c.programs()[-1].externs) == int(python_body)


def test_embedding_follows_index_shapes_between_calls():
    model = _Lookup(50, 16).eval()
    c = braze.compile(model)
    with torch.no_grad():
        for n in (3, 9, 17, 1, 33):
            idx = torch.randint(0, 50, (2, n))
            assert_same(c(idx), model(idx))
