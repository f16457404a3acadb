"""Hypothesis draws sequences of calls of one compiled wrapper, each with another input layout,
dtype, mode, model state, float32 matmul precision or thread count; each call must answer as
eager does (the same values, or the same kind of exception). The native guard decides, call by
call, whether machine code may run."""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import braze

from .helpers import assert_same


class Net(nn.Module):
    """Native GEMMs and loops, a dropout a lowering decides on, a forward that branches on its
    own flag."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.drop, self.fc2 = nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 4)

    def forward(self, x):
        h = self.drop(torch.relu(self.fc1(x)))
        return self.fc2(h) * (2.0 if self.training else 1.0)


def _input(rows: int, layout: str, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(rows)
    base = torch.randn(rows, 8, generator=g, dtype=dtype)
    return {
        "contiguous": lambda: base,
        "transposed": lambda: base.t().contiguous().t(),
        "strided": lambda: torch.randn(rows, 16, generator=g, dtype=dtype)[:, ::2],
        "broadcast": lambda: base[:1].expand(rows, 8),
        "negated": lambda: torch._neg_view(base),
        "wide": lambda: torch.randn(rows, 9, generator=g, dtype=dtype),  # eager raises
    }[layout]()


_MODES = {
    "no_grad": torch.no_grad,
    "inference": torch.inference_mode,
    "grad": contextlib.nullcontext,
    "autocast": lambda: torch.autocast("cpu"),
}

calls = st.lists(
    st.tuples(
        st.sampled_from([0, 1, 3, 7, 33]),
        st.sampled_from(["contiguous", "transposed", "strided", "broadcast", "negated", "wide"]),
        st.sampled_from([torch.float32, torch.float32, torch.float64]),
        st.sampled_from(list(_MODES)),
        st.sampled_from(["eval", "train-dropout", "train-all", "new-weights", "bf16-matmul", "three-threads"]),
    ),
    min_size=2,
    max_size=8,
)


def _outcome(fn, x, mode):  # noqa: ANN001, ANN202
    torch.manual_seed(0)  # dropout in training draws the same numbers for both
    try:
        with _MODES[mode]():
            return fn(x)
    except Exception as e:  # noqa: BLE001 - the kind of exception is what is compared
        return type(e)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(calls)
def test_every_call_answers_as_eager_does(sequence):
    torch.manual_seed(0)
    model = Net().eval()
    compiled = braze.compile(model)
    for rows, layout, dtype, mode, state in sequence:
        model.eval()
        if state == "train-dropout":
            model.drop.train()
        elif state == "train-all":
            model.train()
        elif state == "new-weights":
            with torch.no_grad():
                model.fc1.weight.copy_(torch.randn(16, 8))
        x = _input(rows, layout, dtype)
        precision, threads = torch.backends.mkldnn.matmul.fp32_precision, torch.get_num_threads()
        torch.backends.mkldnn.matmul.fp32_precision = "bf16" if state == "bf16-matmul" else "none"
        torch.set_num_threads(3 if state == "three-threads" else 2)
        try:
            expected = _outcome(model, x, mode)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", braze.BrazeWarning)  # grad mode, autocast: eager, said once
                actual = _outcome(compiled, x, mode)
        finally:
            torch.backends.mkldnn.matmul.fp32_precision = precision
            torch.set_num_threads(threads)
        if isinstance(expected, type):
            assert actual is expected, (rows, layout, dtype, mode, state, actual)
        else:
            assert_same(actual, expected)
