"""The test oracle: braze must give what eager gives, bit for bit, with eager's layout."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

import braze


def same_values(a: torch.Tensor, e: torch.Tensor) -> bool:
    """torch.equal, with NaN equal to NaN.

    Neither NaN payloads nor the sign of a zero that max/min pick are compared: for those,
    eager itself answers differently in the vectorised body and the scalar tail of ATen's loop.
    """
    if a.is_floating_point():
        nan = e.isnan()
        return torch.equal(a.isnan(), nan) and torch.equal(a.masked_fill(nan, 0), e.masked_fill(nan, 0))
    return torch.equal(a, e)


def assert_same(actual: Any, expected: Any) -> None:
    a_leaves, a_spec = pytree.tree_flatten(actual)
    e_leaves, e_spec = pytree.tree_flatten(expected)
    assert a_spec == e_spec, f"output structure {a_spec} != {e_spec}"
    for i, (a, e) in enumerate(zip(a_leaves, e_leaves)):
        if not isinstance(e, torch.Tensor):
            assert a == e, f"output {i}: {a!r} != {e!r}"
            continue
        assert isinstance(a, torch.Tensor), f"output {i} is {type(a)}, not a tensor"
        assert a.dtype == e.dtype, f"output {i}: dtype {a.dtype} != {e.dtype}"
        assert a.shape == e.shape, f"output {i}: shape {tuple(a.shape)} != {tuple(e.shape)}"
        if e.numel() > 1:
            assert a.stride() == e.stride(), f"output {i}: strides {a.stride()} != {e.stride()}"
        assert a.requires_grad == e.requires_grad, f"output {i}: requires_grad differs"
        assert same_values(a, e), f"output {i}: values differ (max |diff| {(a - e).abs().max()})"


def _clone(x: Any) -> Any:
    return pytree.tree_map(lambda t: _copy(t) if isinstance(t, torch.Tensor) else t, x)


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` with its sizes and strides. (clone() makes a strided or broadcast tensor
    contiguous, and ATen's GEMMs may round differently on another layout: eager must see the
    layout braze sees.)"""
    if t.numel() == 0:
        return t.clone()
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return t.as_strided((span,), (1,)).clone().as_strided(t.shape, t.stride())


def check_model(
    fn: Callable[..., Any],
    inputs: tuple,
    *,
    kernels: int | None = None,
    externs: int | None = None,
    grad: bool = False,
    compiled: Any = None,
    fallback: bool = False,
) -> braze.CompiledModule:
    """Run `fn` eagerly and through braze on the same inputs; outputs must match exactly.

    kernels / externs: how many native kernels / ATen calls the program must have, so a test
    asserts that fusion happened rather than only that the answer is right.
    fallback: whether braze may run the model eagerly (else its warning fails the test).
    """
    compiled = compiled or braze.compile(fn)
    with torch.set_grad_enabled(grad), warnings.catch_warnings():
        if not fallback:
            warnings.simplefilter("error", braze.BrazeWarning)
        expected = fn(*_clone(inputs))
        before = _clone(inputs)
        actual = compiled(*inputs)
    assert_same(actual, expected)
    for b, a in zip(pytree.tree_leaves(before), pytree.tree_leaves(inputs)):
        if isinstance(a, torch.Tensor):
            assert same_values(a, b), "braze changed an input"
    progs = compiled.programs()
    if kernels is not None:
        assert progs and progs[-1].kernel_count == kernels, f"kernels: {[p.kernel_count for p in progs]} != {kernels}"
    if externs is not None:
        assert progs and len(progs[-1].externs) == externs, f"externs: {progs[-1].externs if progs else None}"
    return compiled
