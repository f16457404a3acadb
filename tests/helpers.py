"""The test oracle: braze must give what eager gives, bit for bit, with eager's layout."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
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


def differs(actual: Any, expected: Any, values: bool = True) -> str:
    """Why `actual` is not eager's `expected` ('' if it is): structure, each tensor's layout kind,
    dtype, shape, strides, requires_grad and (with `values`) values; other leaves equal."""
    a_leaves, a_spec = pytree.tree_flatten(actual)
    e_leaves, e_spec = pytree.tree_flatten(expected)
    if a_spec != e_spec or type(actual) is not type(expected):
        return f"output structure {type(actual).__name__} {a_spec} != {type(expected).__name__} {e_spec}"
    for i, (a, e) in enumerate(zip(a_leaves, e_leaves)):
        if not isinstance(e, torch.Tensor):
            same = a == e or (isinstance(e, float) and e != e and a != a)
            if not same and values:
                return f"output {i}: {a!r} != {e!r}"
            continue
        if not isinstance(a, torch.Tensor) or a.layout != e.layout:
            return f"output {i}: {type(a).__name__} where eager gives a {e.layout} tensor"
        if (a.dtype, a.shape) != (e.dtype, e.shape):
            return f"output {i}: {a.dtype}{tuple(a.shape)} != {e.dtype}{tuple(e.shape)}"
        if e.layout == torch.strided and e.numel() > 1 and a.stride() != e.stride():
            return f"output {i}: strides {a.stride()} != {e.stride()}"
        if a.requires_grad != e.requires_grad:
            return f"output {i}: requires_grad differs"
        if values and not _same(a, e):
            return f"output {i}: values differ (max |diff| {(a.double() - e.double()).abs().max()})"
    return ""


def _same(a: torch.Tensor, e: torch.Tensor) -> bool:
    if e.layout != torch.strided:
        a, e = a.to_dense(), e.to_dense()
    if e.is_complex():
        a, e = torch.view_as_real(a.resolve_conj()), torch.view_as_real(e.resolve_conj())
    return same_values(a, e)


def assert_same(actual: Any, expected: Any) -> None:
    why = differs(actual, expected)
    assert not why, why


def _clone(x: Any) -> Any:
    return pytree.tree_map(copy, x)


def copy(t: Any) -> Any:
    """A copy of tensor `t` with its sizes and strides (anything else as it is). (clone() makes
    a strided or broadcast tensor contiguous, and ATen's GEMMs may round differently on another
    layout: eager must see the layout braze sees.)"""
    if not isinstance(t, torch.Tensor):
        return t
    if t.numel() == 0 or t.layout != torch.strided:
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


def probe_with(monkeypatch: Any, owner: Any, name: str, wrong: Any, probe: Callable[[], bool], cached: Any) -> bool:
    """What `probe` says while owner.<name> is `wrong` (its cache, `cached`, cleared around it, so
    the real answer is found again after)."""
    monkeypatch.setattr(owner, name, wrong)
    cached.cache_clear()
    try:
        return probe()
    finally:
        monkeypatch.undo()
        cached.cache_clear()


def mkl_order() -> bool:
    """Whether MKL's sgemm_ takes, on this CPU and at two threads, the path whose order braze's
    GEMM kernel reproduces (its generic one, which it takes on AMD CPUs; on Intel CPUs it runs
    kernels of its own)."""
    from braze import gemmkernel

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        return gemmkernel.same(()) and gemmkernel.same((), linear=True)
    finally:
        torch.set_num_threads(before)


def needs_mkl_order() -> None:
    """Skip a test of braze's GEMM kernel giving eager's bits inside programs where it cannot
    (mkl_order): its probe then keeps it out of every exact program, which
    test_own_kernel_falls_back_to_sgemm_where_its_probe_disagrees checks on any CPU."""
    import pytest

    if not mkl_order():
        pytest.skip("MKL's sgemm_ does not take the path braze's GEMM kernel reproduces on this CPU")


@contextlib.contextmanager
def num_threads(n: int) -> Iterator[None]:
    """torch's thread count for a block, put back after (where a fixture cannot: each of a
    hypothesis test's examples, each OpInfo case)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
