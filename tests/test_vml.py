"""braze's tanh (vml.py): MKL's generic vmsTanh kernel reproduced, fused in braze's loops where
its probe agrees with eager, vmsTanh called where it does not."""

from __future__ import annotations

import math

import pytest
import torch

from braze import jit, vml
from braze.ir import Op

from .helpers import check_model, probe_with
from .test_ops import special


def mkl_generic_tanh(x: torch.Tensor) -> torch.Tensor:
    """The kernel's arithmetic written with torch's float64 operations (each rounded once): the
    row of coefficients picked by |x|'s bits, Horner on |x|, rounded to float, x's sign or-ed in;
    NaN + NaN for NaN, +-1 from 0x7f200000 on."""
    table = torch.tensor(jit.mkl_tanh_table(), dtype=torch.float64).view(27, 8)
    bits = x.view(torch.int32)
    masked = bits & 0x7FE00000
    row = torch.where(masked > 0x3DE00000, (masked - 0x3DE00000) >> 21, 0)
    row = torch.where(masked > 0x41200000, 26, row).long()
    a = (bits & 0x7FFFFFFF).view(torch.float32).double()
    p = table[row, 7]
    for k in range(6, -1, -1):
        p = p * a + table[row, k]
    y = (p.float().view(torch.int32) | (bits & -(2**31))).view(torch.float32)
    y = torch.where(masked > 0x7F000000, torch.where(bits < 0, -1.0, 1.0), y)
    return torch.where(x.isnan(), x + x, y)


def every_interval() -> torch.Tensor:
    """Each quarter binade's ends and insides, denormals, huge values and specials, both signs."""
    edges = torch.arange(0, 0x7F800000, 0x1FFFF, dtype=torch.int64)
    edges = torch.cat([edges, torch.arange(0x3DE00000, 0x41600000, 1 << 21)]).to(torch.int32).view(torch.float32)
    special = torch.tensor([0.0, 1e-45, 1e-40, 3e38, math.inf, math.nan])
    return torch.cat([edges, -edges, special, -special, torch.randn(10000) * 3])


def test_table_is_read_from_this_wheel():
    table = jit.mkl_tanh_table()
    assert table is not None and len(table) == 216
    assert table[:2] == [0.0, 1.0000000000965834]  # tanh(x) ~ x near 0
    assert table[208:] == [1.0] + [0.0] * 7  # row 26: saturated


def test_kernel_is_mkls_generic_arithmetic_on_any_cpu():
    # Against the algorithm itself, not against this CPU's MKL: holds wherever it runs.
    x = every_interval()
    for n in (1, 7, 8, 9, 17, x.numel()):
        assert jit.same_bits(vml.run(x[:n]), mkl_generic_tanh(x[:n]))


def test_the_probe_sees_one_coefficient_off(monkeypatch):
    table = list(jit.mkl_tanh_table())
    table[8 * 20] *= 1 + 2**-24  # row 20's constant term, by about a float32 ulp
    monkeypatch.setattr(vml, "KERNEL", "braze_vml_tanh_perturbed")
    assert not probe_with(monkeypatch, jit, "mkl_tanh_table", lambda: table, vml._same, vml.why_not_tanh)


def test_another_build_of_the_library_calls_vmstanh(monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(jit, "_MKL_TANH_BUILD", "0" * 40)
        jit.mkl_tanh_table.cache_clear()
        vml.why_not_tanh.cache_clear()
        assert jit.mkl_tanh_table() is None and "build" in vml.why_not_tanh()
    jit.mkl_tanh_table.cache_clear()
    vml.why_not_tanh.cache_clear()


@pytest.mark.skipif(vml.why_not_tanh() is not None, reason=f"{vml.why_not_tanh()}: programs call vmsTanh (tested)")
@pytest.mark.parametrize("n", [1, 2])
def test_tanh_is_native_and_fused_where_its_probe_agrees(n, threads):
    threads(n)
    for length in (1, 7, 15, 16, 17, 33, 257, 32769):
        check_model(torch.tanh, (special(length) * 4,), kernels=1, externs=0)
    check_model(lambda t: torch.tanh(t * 2 + 1) - t, (special(7, 33),), kernels=1, externs=0)  # one loop
    for x in (special(257, 130).t(), special(64, 66)[:, ::2], special(7, 1, 33).expand(7, 5, 33), special(0, 7)):
        check_model(lambda t: torch.tanh(t) * 3, (x,), externs=0)
    x = every_interval().view(-1, 1)
    compiled = check_model(torch.nn.Tanh(), (x,), kernels=1, externs=0)
    assert [n.op for n in compiled.programs()[0].graph.nodes if n.op is Op.VML] == []


def test_tanh_calls_vmstanh_where_its_probe_disagrees(monkeypatch):
    monkeypatch.setattr(vml, "why_not_tanh", lambda: "a probe found MKL runs another tanh kernel here")
    gelu_new = lambda x: 0.5 * x * (1.0 + torch.tanh(0.79788456 * (x + 0.044715 * x**3)))  # noqa: E731
    compiled = check_model(gelu_new, (special(33, 65),), kernels=3, externs=0)  # loop, vmsTanh, loop
    assert [n.attrs["fn"] for n in compiled.programs()[0].graph.nodes if n.op is Op.VML] == ["vmsTanh"]
