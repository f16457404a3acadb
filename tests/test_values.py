"""Tensor arguments whose values, not only layouts, decide a result's shape, an index or a Python
number: each call must read them anew, never reuse the first call's values (issue 15)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import braze

from .helpers import check_model

X = torch.randn(5, 6, 7)


def calls(fn, *per_call) -> braze.CompiledModule:
    """Compile `fn` once and check every call against eager."""
    compiled = braze.compile(fn)
    for args in per_call:
        check_model(fn, args, compiled=compiled, fallback=True)
    return compiled


def test_narrow_with_a_tensor_start_reads_it_each_call():
    f = lambda x, s: torch.narrow(x, 1, s, 2)
    calls(f, *[(X, torch.tensor(v)) for v in range(4)])
    g = lambda x, s: torch.narrow(x, 1, s, 2).relu() * 2  # native code reads the narrowed view
    compiled = calls(g, *[(X, torch.tensor(v)) for v in (0, 3, 1, 3, 2)])
    assert all(p.kernel_count >= 1 for p in compiled.programs()), "the relu should stay native"
    h = lambda x, s: torch.narrow(x, 1, s, 2).t()[0] + 1  # views over the narrowed view
    calls(h, *[(torch.randn(4, 6), torch.tensor(v)) for v in (0, 3, 1)])


def test_item_in_forward_is_read_at_run_time():
    calls(lambda x, s: x * s.item(), *[(X, torch.tensor(v)) for v in (0.5, 2.0, -1.0)])
    calls(lambda x, s: x + s.item() * 2 - 1, *[(X, torch.tensor(v)) for v in (1.5, 3.0)])
    calls(lambda x, s: x * s.tolist()[1], *[(X, torch.tensor([v, v + 1])) for v in (1.0, 2.0)])
    calls(lambda x, n: x.view(n.item(), -1), *[(X, torch.tensor(v)) for v in (5, 35, 1)])


@pytest.mark.parametrize(
    "fn,values",
    [
        (lambda x, i: torch.index_select(x, 1, i), [torch.tensor([0, 2]), torch.tensor([5, 1]), torch.tensor([3, 3])]),
        (lambda x, i: torch.gather(x, 2, i), [torch.randint(0, 7, (5, 6, 2)) for _ in range(3)]),
        (lambda x, i: x[i] * 2, [torch.tensor(v) for v in (0, 4, 2)]),
        (lambda x, i: x[:, i].relu(), [torch.tensor([v, 0]) for v in (0, 4, 5)]),
        (
            lambda x, c: torch.repeat_interleave(x[0, 0, :3], c).relu(),
            [torch.tensor(v) for v in ([1, 0, 2], [3, 3, 3])],
        ),
        (lambda x, n: x[0, 0, : n.item()] + 1, [torch.tensor(v) for v in (1, 7, 3)]),
        (lambda x, n: torch.arange(n.item()) * 2.0 + x[0, 0, 0], [torch.tensor(v) for v in (3, 9, 0)]),
        (lambda x, m: torch.nonzero(m).t().float() + x[0, 0, :1], [torch.rand(3, 4) > p for p in (0.2, 0.9, 0.5)]),
        (lambda x, m: x.new_zeros(torch.nonzero(m).shape[0]) + 1, [torch.rand(6) > p for p in (0.2, 0.9, 0.5)]),
        (lambda x, m: x[0][m] * 3, [torch.rand(6, 7) > p for p in (0.2, 0.9, 0.5)]),
    ],
    ids=[
        "index_select",
        "gather",
        "int-tensor-index",
        "tensor-index-list",
        "repeat_interleave",
        "slice-to-item",
        "arange-of-item",
        "nonzero-then-view",
        "shape-of-data-dependent",
        "boolean-mask",
    ],
)
def test_values_that_decide_indices_or_shapes(fn, values):
    calls(fn, *[(X, v) for v in values])


def test_functions_of_values_and_layouts_together():
    # a value-decided view, then native work on it, then a layout query of the result
    def f(x, s):
        y = torch.narrow(x, 2, s, 3) * 2
        return F.relu(y).reshape(y.shape[0], -1)

    calls(f, *[(X, torch.tensor(v)) for v in (0, 4, 2, 4)])
