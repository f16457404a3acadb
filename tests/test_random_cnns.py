"""Hypothesis draws random CNNs (convolutions of every kind fast mode has a kernel for, batch
norms, activations, residuals, pools): eager's bits in exact mode, the contract in fast mode."""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import braze

from .helpers import check_model, num_threads

ACTS = {
    "relu": F.relu,
    "relu6": F.relu6,
    "silu": F.silu,
    "gelu": F.gelu,
    "hardswish": F.hardswish,
    "sigmoid": torch.sigmoid,
    "none": lambda t: t,
}


class Block(nn.Module):
    def __init__(self, conv: nn.Conv2d, bn: bool, act: str, residual: bool, pool: str) -> None:
        super().__init__()
        self.conv, self.act, self.residual, self.pool = conv, act, residual, pool
        self.bn = nn.BatchNorm2d(conv.out_channels) if bn else None
        if self.bn is not None:
            self.bn.running_mean.normal_()
            self.bn.running_var.uniform_(0.5, 2)
            nn.init.normal_(self.bn.weight)
            nn.init.normal_(self.bn.bias)

    def extra_repr(self) -> str:  # (what a failing example prints)
        return f"act={self.act}, residual={self.residual}, pool={self.pool!r}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        y = y if self.bn is None else self.bn(y)
        y = ACTS[self.act](y + x if self.residual else y)
        if self.pool == "max":
            return F.max_pool2d(y, 2)
        return F.avg_pool2d(y, 2) if self.pool == "avg" else y


class Net(nn.Module):
    def __init__(self, blocks: list[Block], head: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(blocks[-1].conv.out_channels, head) if head else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x if self.head is None else self.head(x.mean((-2, -1)))


@st.composite
def cnns(draw):
    """(model, input): 1-3 blocks, each a convolution (1 x 1 to 7 x 7, stride 1 or 2, dilated,
    grouped or depthwise, 1-96 channels) on an image of 8-33 pixels a side, NCHW or channels-last,
    at a scale from 1e-3 to 1e3."""
    torch.manual_seed(draw(st.integers(0, 2**31 - 1)))
    cin = channels = draw(st.sampled_from([1, 3, 16, 48]))
    size = h, w = draw(st.sampled_from([8, 15, 17, 33])), draw(st.sampled_from([8, 16, 17, 32]))
    blocks = []
    for _ in range(draw(st.integers(1, 3))):
        k = draw(st.sampled_from([1, 3, 3, 5, 7]))
        stride, dilation = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 1, 2])) if k > 1 else 1
        depthwise = k > 1 and draw(st.booleans())
        out = channels if depthwise else draw(st.sampled_from([1, 8, 17, 32, 64, 96, 96]))
        groups = channels if depthwise else (2 if channels % 2 == out % 2 == 0 and draw(st.booleans()) else 1)
        padding = draw(st.sampled_from([0, k // 2 * dilation]))
        oh, ow = ((n + 2 * padding - dilation * (k - 1) - 1) // stride + 1 for n in (h, w))
        if min(oh, ow) < 2:
            break
        conv = nn.Conv2d(channels, out, k, stride, padding, dilation, groups, bias=draw(st.booleans()))
        residual = (oh, ow, out) == (h, w, channels) and draw(st.booleans())
        pool = draw(st.sampled_from(["", "", "max", "avg"])) if min(oh, ow) >= 4 else ""
        blocks.append(Block(conv, draw(st.booleans()), draw(st.sampled_from(sorted(ACTS))), residual, pool))
        (h, w), channels = (oh // 2, ow // 2) if pool else (oh, ow), out
    if not blocks:
        blocks.append(Block(nn.Conv2d(cin, 8, 1), False, "relu", False, ""))
    model = Net(blocks, draw(st.sampled_from([0, 10]))).eval()
    x = torch.randn(draw(st.sampled_from([1, 2, 3])), cin, *size) * draw(st.sampled_from([1e-3, 1.0, 1e3]))
    if draw(st.booleans()):
        x = x.contiguous(memory_format=torch.channels_last)
    return model, x


BOUNDED = {"sigmoid", "relu6"}
SETTINGS = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(cnns(), st.sampled_from([1, 2]))
def test_random_cnns_match_eager(case, n):
    model, x = case
    with num_threads(n):
        compiled = check_model(model, (x,))
        check_model(model, (torch.randn(x.shape[0] + 1, *x.shape[1:]),), compiled=compiled)  # another batch


@SETTINGS
@given(cnns(), st.sampled_from([1, 2]))
def test_random_cnns_keep_the_contract_in_fast_mode(case, n):
    model, x = case
    # A bounded activation (sigmoid, relu6) of pre-activations ~1e3 leaves a few outputs off its
    # bounds, so the maximum's ratio is of two draws of a few each: for one convolution and a
    # sigmoid, fast mode's median 1.4x eager's but up to 12.6x over 30 seeds (without it: at most
    # 2.4x); relu6 after a 1 x 1 one 26.6x, its RMS 2.0x. Such draws measure nothing.
    assume(x.abs().max() < 100 or not {block.act for block in model.blocks} & BOUNDED)
    with num_threads(n), warnings.catch_warnings():
        warnings.simplefilter("error", braze.BrazeWarning)  # (fast mode failing would measure exact mode's)
        report = braze.check_accuracy(model, x, mode="fast")
    assert report.ok, f"{report}\n{model}"
