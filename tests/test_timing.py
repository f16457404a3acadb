"""The timing behind `braze demo`: the BLAS clock splits a call into braze's time and its BLAS
calls' time, and is compiled only when asked for."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import braze
from braze import cli, config, timing

from .helpers import check_model

W = torch.randn(256, 256)


def _linear(x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, W).relu()


def test_the_blas_clock_is_compiled_only_when_asked():
    x = torch.randn(64, 256)
    assert "readcyclecounter" not in braze.explain(_linear, x).sections["LLVM IR"]
    with config.patch(blas_clock=True):
        assert "readcyclecounter" in braze.explain(_linear, x).sections["LLVM IR"]
        check_model(_linear, (x,))


def test_a_split_puts_gemm_time_on_the_blas_side():
    with torch.no_grad():
        gemm = timing.split(_linear, (torch.randn(64, 256),), rounds=3, seconds=0.01)
        loops = timing.split(lambda x: (x * 2).relu(), (torch.randn(64, 256),), rounds=3, seconds=0.01)
    assert gemm is not None and loops is not None
    # 8 MFLOP of sgemm_ against a guard, an allocation and a 16k-element ReLU
    assert 0 < gemm.own_us < gemm.blas_us < gemm.call_us
    assert loops.blas_us == 0 and loops.own_us == loops.call_us > 0


def test_demo_prints_its_figures(capsys):
    assert cli.demo(rounds=2) == 0
    out = capsys.readouterr().out
    assert "torch.equal with eager: True" in out
    assert "braze's own time per call beside its BLAS calls" in out
