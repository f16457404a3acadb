"""Fast mode's elementwise functions. Its tanh (codegen/fastmath.py): within 1.1 ulp of tanh in
float64 on millions of values, special values as eager's, fused with its neighbours (GPT-2's GELU)
within the accuracy contract. Its sigmoid, silu and tanh GELU (Op.SLEEF: ATen's per-element
arithmetic, not in ATen's loop): fused too (Llama's gated MLP), at eager's own error. Exact mode
keeps ATen's kernels."""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch

import braze
from braze import sleef
from braze.accuracy import measure
from braze.codegen import run_elementwise
from braze.codegen.fastmath import TANH_ONE, TANH_SMALL, _quarter, fast_tanh
from braze.ir import Op

from .test_ops import special

nn = torch.nn


def _ulps(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """|y - tanh(x)| (float64) in units of the last place of tanh(x) rounded to float32."""
    want = torch.tanh(x.double())
    exponent = torch.frexp(want.float().abs().double())[1].clamp(min=-125)
    return (y.double() - want).abs() / torch.ldexp(torch.ones_like(want), (exponent - 24).to(torch.int32))


def _values() -> torch.Tensor:
    """2.6 million inputs: uniform on [-10, 10] and [-1, 1], random bits (every binade), and each
    polynomial's interval ends with their neighbours, both signs."""
    gen = torch.Generator().manual_seed(0)
    uniform = torch.cat([torch.rand(1_000_000, generator=gen) * 20 - 10, torch.rand(500_000, generator=gen) * 2 - 1])
    bits = torch.randint(0, 2**31, (1_000_000,), generator=gen, dtype=torch.int64).to(torch.int32).view(torch.float32)
    ends = torch.tensor([x for i in range(17) for x in _quarter(i)] + [TANH_SMALL, TANH_ONE])
    steps = torch.arange(-64, 65, dtype=torch.int32)
    near = (ends.view(-1, 1).view(torch.int32) + steps).view(torch.float32).flatten()
    x = torch.cat([uniform, bits[torch.isfinite(bits)], near])
    return torch.cat([x, -x])


@pytest.mark.parametrize("wide", [True, False], ids=["16 lanes", "8 lanes"])
def test_fast_tanh_is_within_1_1_ulp_of_float64(wide):
    x = _values()
    y = run_elementwise(f"test_fast_tanh_{int(wide)}", fast_tanh, x, wide=wide)  # (and one lane: the tail)
    errors = _ulps(y, x)
    assert errors.max() <= 1.1, f"{errors.max():.3f} ulp at x = {x[errors.argmax()].item()!r}"
    assert errors.mean() < 0.35
    one = run_elementwise("test_fast_tanh_0", fast_tanh, x[:1])  # a loop's scalar tail
    assert _ulps(one, x[:1]).max() <= 1.1


def test_fast_tanh_of_special_values_is_eagers():
    x = torch.tensor([0.0, -0.0, 1e-45, -1e-40, 1e-30, 3e38, -3e38, math.inf, -math.inf, TANH_ONE, -20.0, math.nan])
    y = run_elementwise("test_fast_tanh_special", fast_tanh, x, wide=True)
    want = torch.tanh(x)
    assert torch.equal(y[:-1], want[:-1]) and y[-1].isnan()
    assert torch.equal(torch.signbit(y[:-1]), torch.signbit(x[:-1]))  # tanh(-0) is -0


class _GeluNew(nn.Module):
    """GPT-2's activation (Hugging Face's NewGELUActivation), written op by op."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def _ops(compiled: braze.CompiledModule) -> list[Op]:
    nodes = [n for p in compiled.programs() for n in p.graph.nodes]
    return [n.op for n in nodes] + [b.op for n in nodes for b in n.body]


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
@torch.no_grad()
def test_gpt2s_gelu_is_one_loop_in_fast_mode_within_the_contract(n, scale, threads):
    threads(n)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), _GeluNew(), nn.Linear(256, 64)).eval()
    double = copy.deepcopy(model).double()
    compiled = braze.compile(model, mode="fast")
    for shape in [(1, 64), (17, 64), (3, 33, 64)]:
        x = torch.randn(shape) * scale
        assert measure(compiled(x), model(x), double(x.double())).ok
    ops = _ops(compiled)
    assert Op.FAST_TANH in ops and Op.VML not in ops and Op.TANH not in ops
    assert all(p.kernel_count <= 3 for p in compiled.programs())  # two GEMMs, the GELU their epilogue or a loop


@torch.no_grad()
def test_fast_tanh_on_strided_and_empty_inputs():
    for x in (special(257, 130).t(), special(64, 66)[:, ::2], special(7, 1, 33).expand(7, 5, 33), special(0, 7)):
        compiled = braze.compile(lambda t: torch.tanh(t) * 3, mode="fast")
        out, want = compiled(x), torch.tanh(x) * 3
        assert out.shape == want.shape and torch.equal(out.isnan(), want.isnan())
        error = (out - want)[~want.isnan()].abs()
        assert error.numel() == 0 or error.max() <= 3 * 2**-23  # |tanh| <= 1: within 1.1 ulp of 3 tanh
        assert Op.FAST_TANH in _ops(compiled)


@torch.no_grad()
def test_exact_mode_keeps_atens_tanh():
    compiled = braze.compile(nn.Sequential(nn.Linear(64, 256), _GeluNew()).eval())
    x = torch.randn(17, 64)
    assert torch.equal(compiled(x), compiled.fn(x))
    assert Op.FAST_TANH not in _ops(compiled)


_ACTIVATIONS = {
    "sigmoid": torch.sigmoid,
    "silu": nn.functional.silu,
    "gelu_tanh": lambda x: nn.functional.gelu(x, approximate="tanh"),
}


@pytest.mark.skipif(sleef.other_capability() is not None, reason="ATen's kernels are not the AVX512 build's here")
@pytest.mark.parametrize("fn", sorted(_ACTIVATIONS))
@pytest.mark.parametrize("n", [1, 2])
@torch.no_grad()
def test_fast_activations_fuse_at_eagers_error(fn, n, threads):
    threads(n)
    act = _ACTIVATIONS[fn]
    compiled = braze.compile(lambda x, y: act(x) * y, mode="fast")
    for length in (1, 7, 15, 16, 17, 33, 257, 32769):
        x, y = special(length) * 4, torch.randn(length)
        out, want = compiled(x, y), act(x) * y
        assert torch.equal(out.isnan(), want.isnan())
        finite = ~want.isnan()
        # each element either ATen's vector body's arithmetic or its tail's: within 2 ulp of eager's
        assert torch.allclose(out[finite], want[finite], rtol=2.5e-7, atol=1e-37)
    assert Op.SLEEF in _ops(compiled) and Op.ACTIVATION not in _ops(compiled)
    assert all(p.kernel_count == 1 for p in compiled.programs())  # one loop: the activation and the product
    x = special(4099) * 4
    for wide in (True, False):  # 16 lanes, then 8 (a narrow loop's), then one
        got = run_elementwise(f"test_sleef_{fn}_{int(wide)}", functools.partial(sleef.element, fn=fn), x, wide=wide)
        assert torch.equal(got.isnan(), act(x).isnan())
        assert torch.allclose(got[~got.isnan()], act(x)[~got.isnan()], rtol=2.5e-7, atol=1e-37)


@pytest.mark.skipif(sleef.other_capability() is not None, reason="ATen's kernels are not the AVX512 build's here")
@torch.no_grad()
def test_llamas_gated_mlp_is_one_epilogue_in_fast_mode_within_the_contract():
    class Gated(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate, self.up = nn.Linear(64, 160, bias=False), nn.Linear(64, 160, bias=False)
            self.down = nn.Linear(160, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down(nn.functional.silu(self.gate(x)) * self.up(x))

    torch.manual_seed(0)
    model = Gated().eval()
    double = copy.deepcopy(model).double()
    compiled = braze.compile(model, mode="fast")
    for scale in (1e-3, 1.0, 1e3):
        for shape in ((1, 64), (33, 64), (2, 17, 64)):
            x = torch.randn(shape) * scale
            assert measure(compiled(x), model(x), double(x.double())).ok
    for x in (special(33, 128)[:, ::2], special(0, 64)):  # strided, empty
        assert measure(compiled(x), model(x), double(x.double())).ok
    assert Op.SLEEF in _ops(compiled) and Op.ACTIVATION not in _ops(compiled)


@torch.no_grad()
def test_exact_mode_keeps_atens_activation_loop():
    x = torch.randn(4, 257)
    compiled = braze.compile(lambda t: nn.functional.silu(t) * 2)
    assert torch.equal(compiled(x), nn.functional.silu(x) * 2)
    assert Op.SLEEF not in _ops(compiled)
