"""The accuracy contract of fast mode, measured: `braze.check_accuracy(model, *inputs)`.

A float64 copy of the model on float64 copies of the inputs is the reference. With e_F the
absolute error of the compiled model's output and e_E eager's own (both against the reference,
over the elements where the reference is finite), fast mode promises

    max e_F <= 4 * max(max e_E, floor)      rms e_F <= 3 * max(rms e_E, floor)

where floor = 2**-23 * max |reference| (one float32 ulp at the output's scale), and NaN where
eager has NaN, infinities where eager has them, with their sign.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

MAX_FACTOR = 4.0
RMS_FACTOR = 3.0


@dataclass(frozen=True)
class Accuracy:
    """Errors against the float64 reference: the compiled model's and eager's, and the verdict."""

    max_error: float
    rms_error: float
    eager_max_error: float
    eager_rms_error: float
    floor: float
    specials_match: bool  # NaN and signed infinities where eager has them

    @property
    def max_ratio(self) -> float:
        return _ratio(self.max_error, max(self.eager_max_error, self.floor))

    @property
    def rms_ratio(self) -> float:
        return _ratio(self.rms_error, max(self.eager_rms_error, self.floor))

    @property
    def ok(self) -> bool:
        return self.specials_match and self.max_ratio <= MAX_FACTOR and self.rms_ratio <= RMS_FACTOR

    def __str__(self) -> str:
        verdict = "within" if self.ok else "OUTSIDE"
        return (
            f"{verdict} the contract: max error {self.max_error:.3g} ({self.max_ratio:.2f}x eager's, at most "
            f"{MAX_FACTOR:g}x), rms {self.rms_error:.3g} ({self.rms_ratio:.2f}x, at most {RMS_FACTOR:g}x), "
            f"NaN and infinities {'as eager' if self.specials_match else 'NOT as eager'}"
        )


def _ratio(error: float, allowed: float) -> float:
    """error / allowed; where the reference is all zeros (no floor) and eager exact: 0 if the
    error is 0 too, else infinite."""
    if allowed > 0:
        return error / allowed
    return 0.0 if error == 0 else math.inf


def check_accuracy(model: Any, *inputs: Any, mode: str = "fast", **kwargs: Any) -> Accuracy:
    """Compile `model` in `mode`, run it and eager on the inputs, and measure both against a
    float64 copy of the model run on float64 copies of the inputs."""
    from .api import compile

    with torch.no_grad():
        compiled = compile(model, mode=mode)(*_copies(inputs), **_copies(kwargs))
        eager = model(*_copies(inputs), **_copies(kwargs))
        reference = _double(model)(*_copies(inputs, torch.float64), **_copies(kwargs, torch.float64))
    return measure(compiled, eager, reference)


def measure(actual: Any, eager: Any, reference: Any) -> Accuracy:
    """The contract's figures for outputs `actual` and `eager` against float64 `reference`."""
    trios = [
        (a.double(), e.double(), r.double())
        for a, e, r in zip(*(pytree.tree_leaves(t) for t in (actual, eager, reference)))
        if isinstance(e, torch.Tensor) and e.is_floating_point()
    ]
    errors, eager_errors, scale, specials = [], [], 0.0, True
    for a, e, r in trios:
        specials &= torch.equal(a.isnan(), e.isnan()) and torch.equal(a.isinf() & (a > 0), e.isinf() & (e > 0))
        specials &= torch.equal(a.isinf() & (a < 0), e.isinf() & (e < 0))
        finite = r.isfinite() & e.isfinite()
        errors.append((a - r)[finite].abs().flatten())
        eager_errors.append((e - r)[finite].abs().flatten())
        scale = max(scale, float(r[finite].abs().max()) if finite.any() else 0.0)
    err, eager_err = torch.cat(errors or [torch.zeros(0)]), torch.cat(eager_errors or [torch.zeros(0)])
    stat = lambda t, f: float(f(t)) if t.numel() else 0.0  # noqa: E731
    return Accuracy(
        max_error=stat(err.nan_to_num(nan=float("inf")), torch.max),
        rms_error=stat(err, lambda t: t.square().mean().sqrt()),
        eager_max_error=stat(eager_err, torch.max),
        eager_rms_error=stat(eager_err, lambda t: t.square().mean().sqrt()),
        floor=2.0**-23 * scale,
        specials_match=specials,
    )


def _double(model: Any) -> Any:
    return copy.deepcopy(model).double() if isinstance(model, torch.nn.Module) else model


def _copies(tree: Any, dtype: torch.dtype | None = None) -> Any:
    """Copies of the tensors in `tree` (floating ones in `dtype`, if given): no run sees another's."""

    def one(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        return t.to(dtype) if dtype is not None and t.is_floating_point() else t.clone()

    return pytree.tree_map(one, tree)
