"""Fast mode's RMSNorm (passes.fuse_rms_norm, rows.py's braze_rms_norm_rows): the norm Llama's and
T5's layers write op by op becomes one row kernel, within the accuracy contract at every row
length around its vector steps, with special values, on 1 and 2 threads, at sizes that change
between calls; where the chain is not that norm, or in exact mode, it stays as it was."""

from __future__ import annotations

import copy

import pytest
import torch

import braze
from braze import rows
from braze.accuracy import measure
from braze.ir import Op

from .helpers import assert_same
from .test_ops import special

nn = torch.nn

# Row lengths around its 16-lane vectors and its 64-element steps of four chains.
LENGTHS = [1, 7, 15, 16, 17, 33, 64, 65, 257, 4099]


class RMSNorm(nn.Module):
    """Hugging Face's LlamaRMSNorm / T5LayerNorm, as they write it (weight None: no weight)."""

    def __init__(self, n: int, weight: bool = True, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n)) if weight else None
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        return x if self.weight is None else self.weight * x.to(self.weight.dtype)


class Block(nn.Module):
    """A residual around the norm, so it is not the program's first or last value."""

    def __init__(self, n: int, weight: bool = True) -> None:
        super().__init__()
        self.norm = RMSNorm(n, weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + 1.0) - x


def _ops(compiled: braze.CompiledFunction, op: Op) -> int:
    return sum(n.op is op for p in compiled.programs() for n in p.graph.nodes)


def _within(compiled, model: nn.Module, x: torch.Tensor) -> bool:
    with torch.no_grad():
        out, eager = compiled(x), model(x)
        reference = copy.deepcopy(model).double()(x.double())
    return measure(out, eager, reference).ok


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("weight", [True, False])
@pytest.mark.parametrize("n_threads", [1, 2])
def test_the_norm_is_one_row_kernel_within_the_contract(n, weight, n_threads, threads):
    threads(n_threads)
    torch.manual_seed(n)
    model = Block(n, weight).eval()
    x = special(2, 5, n) * torch.logspace(-3, 3, 5).view(1, 5, 1)  # rows at scales 1e-3..1e3
    compiled = braze.compile(model, mode="fast")
    assert _within(compiled, model, x)
    assert (_ops(compiled, Op.RMS_NORM), _ops(compiled, Op.SUM), _ops(compiled, Op.RSQRT)) == (1, 0, 0)


def test_the_kernel_alone_on_special_rows():
    """NaN spreads to its row, an infinity makes its own element NaN and the rest 0 (x * 0), a
    row of zeros stays zeros, a huge row overflows to inf squares as eager's does."""
    inf, nan = float("inf"), float("nan")
    x = torch.tensor([[1.0, nan, 2.0], [inf, 1.0, -2.0], [0.0, -0.0, 0.0], [3e19, 1.0, 2.0]]).repeat(1, 7)
    for weight in (torch.randn(21), None):
        want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
        want = want if weight is None else weight * want
        got = rows.rms_norm_rows(x, weight, 1e-5)
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
        finite = want.isfinite()
        assert torch.allclose(got[finite], want[finite], rtol=1e-6, atol=0)


def test_rows_that_change_between_calls_keep_the_kernel():
    model = Block(48).eval()
    compiled = braze.compile(model, mode="fast")
    for rows_ in (3, 9, 17, 1):
        x = torch.randn(2, rows_, 48)
        assert _within(compiled, model, x)
    assert _ops(compiled, Op.RMS_NORM) >= 1 and _ops(compiled, Op.SUM) == 0


class Variance(RMSNorm):
    """The mean of squares also returned: the chain's values are not the norm's alone."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps)), variance


class Gemma(RMSNorm):
    """Gemma's form, (1 + w) times the normalised x: the product by x is fused, the rest is not."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed * (1.0 + self.weight)


@pytest.mark.parametrize("model, fused", [(Variance(33), 0), (Gemma(33), 1)], ids=["variance-returned", "gemma"])
def test_chains_that_are_not_the_norm_alone(model, fused):
    x = special(4, 33)
    compiled = braze.compile(model.eval(), mode="fast")
    with torch.no_grad():
        out, eager = compiled(x), model(x)
        reference = copy.deepcopy(model).double()(x.double())
    for got, want, ref in zip(*(o if isinstance(o, tuple) else (o,) for o in (out, eager, reference))):
        assert measure(got, want, ref).ok
    assert _ops(compiled, Op.RMS_NORM) == fused


def test_strided_rows_and_exact_mode_are_left_as_they_were():
    model = RMSNorm(16).eval()
    strided = torch.randn(16, 8).t()  # rows 16 apart: not the kernel's layout
    compiled = braze.compile(model, mode="fast")
    assert _within(compiled, model, strided) and _ops(compiled, Op.RMS_NORM) == 0
    x = special(3, 16)
    exact = braze.compile(model)
    with torch.no_grad():
        assert_same(exact(x), model(x))
    assert _ops(exact, Op.RMS_NORM) == 0 and _ops(exact, Op.SUM) == 1
