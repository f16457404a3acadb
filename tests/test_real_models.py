"""The real models of `braze bench --models real` (Hugging Face configs; torchvision and timm
where they can be imported, which they are not in CI) through braze in exact mode: eager's bits at
the bench's inputs and at another batch, nothing run eagerly, and `braze.explain` reports them."""

from __future__ import annotations

import pytest
import torch

import braze
from braze import bench

from .helpers import check_model


def _other_batch(inputs: tuple) -> tuple:
    """The inputs at batch 2 and, for token ids, another length: ids 2 x 37, images 2 x 3 x 224 x 224."""
    gen = torch.Generator().manual_seed(1)
    (x,) = inputs
    if x.dtype == torch.int64:
        return (torch.randint(0, int(x.max()) + 1, (2, 37), generator=gen),)
    return (torch.randn(2, *x.shape[1:], generator=gen),)


@pytest.mark.parametrize("name", bench.REAL)
def test_real_model_is_exact(name):
    pytest.importorskip(bench.NEEDS[name])
    model, inputs = bench.build_model(name)
    compiled = braze.compile(model)
    with torch.no_grad():
        check_model(model, inputs, compiled=compiled)
        check_model(model, _other_batch(inputs), compiled=compiled)
        report = braze.explain(model, *inputs)
    lines = [ln.strip() for k, v in report.sections.items() if k.endswith("native vs ATen") for ln in v.splitlines()]
    aten = [ln.removeprefix("ATen:").split("  (")[0] for ln in lines if ln.startswith("ATen:")]  # labels
    # Row kernels and activations braze reproduces natively never run through ATen here
    native = ("layer_norm", "softmax", "rsqrt", "mean", "silu", "tanh", "batch_norm", "BatchNorm", "max_pool2d")
    assert not [label for label in aten if any(op in label for op in native)], aten
