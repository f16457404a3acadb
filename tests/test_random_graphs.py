"""Hypothesis draws random MLP-family graphs; every one must match eager exactly."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import braze

from .helpers import assert_same, check_model

ACTS = {
    "relu": torch.relu,
    "leaky": lambda t: F.leaky_relu(t, 0.05),
    "clamp": lambda t: t.clamp(-0.3, 0.4),
    "hardtanh": F.hardtanh,
    "neg_abs": lambda t: -t.abs(),
    "scale": lambda t: t * 0.25 + 1,
    "square": lambda t: t**2 * 0.1,
    "cat": lambda t: torch.cat([t, -t], -1)[..., ::2],
    "masked": lambda t: t.masked_fill(t > 0.5, 0.5),
    "where": lambda t: torch.where(t >= 0, t, t * 0.1),
    "hardswish": F.hardswish,
    "hardsigmoid": F.hardsigmoid,
    "threshold": lambda t: F.threshold(t, 0.1, -1.0),
    "rsqrt": lambda t: torch.rsqrt(t * t + 0.5),
    "exp": lambda t: torch.exp(t * 0.1),
    "erf": torch.erf,
    "gelu": F.gelu,  # oneDNN's polynomials, as ATen calls them (onednn.py)
    "tanh": torch.tanh,  # MKL's vmsTanh, as ATen calls it
    "softmax": lambda t: torch.softmax(t * 3, -1),  # braze's row kernels
    "log_softmax": lambda t: F.log_softmax(t, -1),
    "mean": lambda t: t - t.mean(-1, keepdim=True),
    "silu": F.silu,  # ATen's loop: Sleef in the body, glibc in the tail
    "sigmoid": torch.sigmoid,
    "sin_log": lambda t: torch.sin(t) + torch.log(t.abs() + 1),  # MKL's VML
    "rms_norm": lambda t: t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6),  # Llama's, op by op
    "layer_norm": None,  # the layer's own nn.LayerNorm (braze's row kernel)
    "bool_mask": lambda t: t * (t > 0.2) + ~(t.bool()),  # bools in float32 arithmetic: cast first
    "integers": lambda t: t + (t > 0).long() * 3 - (t < -1).int(),  # integer loops, then cast
    "pad": lambda t: F.pad(t, (1, 0), value=0.5)[..., :-1],  # filled blocks and a copy
}
VOCAB = 50


def _input(model: RandomMLP, batch: tuple[int, ...]) -> torch.Tensor:
    """Token ids of shape `batch`, or floats of shape (*batch, width)."""
    if model.embed is not None:
        return torch.randint(0, VOCAB, batch)
    return torch.randn(*batch, model.layers[0].in_features)


class RandomMLP(nn.Module):
    def __init__(
        self, widths: list[int], acts: list[str], bias: list[bool], residual: list[bool], embed: bool = False
    ) -> None:
        super().__init__()
        # token ids looked up in an embedding first (its rows: native copies), else float inputs
        self.embed = nn.Embedding(VOCAB, widths[0]) if embed else None
        self.layers = nn.ModuleList(nn.Linear(a, b, bias=c) for a, b, c in zip(widths, widths[1:], bias))
        # a residual where the layer keeps the width (decided here: FX traces no shape test)
        self.acts, self.residual = acts, [r and a == b for r, a, b in zip(residual, widths, widths[1:])]
        self.norms = nn.ModuleList(nn.LayerNorm(w) for w in widths[1:])
        for norm in self.norms:
            nn.init.normal_(norm.weight)
            nn.init.normal_(norm.bias)

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x)
        for layer, norm, act, res in zip(self.layers, self.norms, self.acts, self.residual):
            y = norm(layer(x)) if act == "layer_norm" else ACTS[act](layer(x))
            x = y + x if res else y
        return x


@st.composite
def mlps(draw, among: tuple[str, ...] = tuple(sorted(ACTS))):
    depth = draw(st.integers(1, 4))
    widths = draw(st.lists(st.sampled_from([1, 7, 33, 64]), min_size=depth + 1, max_size=depth + 1))
    acts = draw(st.lists(st.sampled_from(among), min_size=depth, max_size=depth))
    bias = draw(st.lists(st.booleans(), min_size=depth, max_size=depth))
    residual = draw(st.lists(st.booleans(), min_size=depth, max_size=depth))
    batch = draw(st.sampled_from([(1,), (7,), (33,), (2, 5), (2, 3, 5)]))
    transpose = draw(st.booleans()) and len(batch) <= 2  # a matrix transposed, or a batch permuted
    embed = draw(st.booleans())
    torch.manual_seed(draw(st.integers(0, 2**31 - 1)))  # (the weights: hypothesis can draw them again)
    return RandomMLP(widths, acts, bias, residual, embed).eval(), batch, transpose


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mlps(), st.integers(0, 2**31 - 1))
def test_random_mlps_match_eager(case, seed):
    model, batch, transpose = case
    torch.manual_seed(seed)
    width = model.layers[0].in_features
    if model.embed is not None:  # ids: a transposed matrix of them where there are two dimensions
        x = torch.randint(0, VOCAB, batch[::-1]).t() if transpose and len(batch) == 2 else _input(model, batch)
    elif not transpose:
        x = _input(model, batch)
    elif len(batch) == 1:
        x = torch.randn(width, *batch).t()  # a transposed matrix
    else:
        x = torch.randn(batch[1], batch[0], width).transpose(0, 1)  # batch dimensions swapped
    check_model(model, (x,))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mlps(), st.lists(st.sampled_from([1, 2, 3, 7, 16, 33, 100, 600]), min_size=3, max_size=5))
def test_random_mlps_stay_exact_as_the_batch_changes(case, batches):
    """One wrapper called with several batch sizes: the second size compiles a generic program,
    which every later size runs (or compiles for itself where the family leaves it out)."""
    model, batch, _ = case
    compiled = braze.compile(model)
    with torch.no_grad():
        for n in batches:
            x = _input(model, (n, *batch[1:]))
            assert_same(compiled(x), model(x))
    # One program per size at most, plus the generic one: built at a size its family may leave out
    # (a batch of 1 that ATen lowers otherwise), which is then compiled for itself too.
    assert len(compiled.compilations) <= len(set(batches)) + 1


# What models put between fast mode's GEMMs (its packed ones, with post-ops, from 2**28
# multiply-adds: not at these sizes).
FAST_ACTS = ("gelu", "relu", "layer_norm", "softmax", "tanh")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mlps(FAST_ACTS), st.integers(0, 2**31 - 1), st.sampled_from([1e-3, 1.0, 1e3]))
def test_random_mlps_keep_the_contract_in_fast_mode(case, seed, scale):
    """Fast mode within the accuracy contract, float inputs at scales from 1e-3 to 1e3."""
    model, batch, _ = case
    torch.manual_seed(seed)
    x = _input(model, batch)
    if x.is_floating_point():
        x = x * scale
    report = braze.check_accuracy(model, x, mode="fast")
    assert report.ok, str(report)
