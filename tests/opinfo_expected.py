"""Expected outcomes of the OpInfo sweep (tests/opinfo.py) other than "exact" or "eager's error,
raised the same way", each with its reason (the practice of Inductor's expected-failure lists).

    "compare": "layout"  the values are not compared (they are not defined), only structure,
                         dtypes, shapes and strides
    "outcome": kind      this outcome is expected (on "paths", default both)
"""

from __future__ import annotations

from typing import Any

_UNINITIALISED = {"compare": "layout", "why": "returns uninitialised memory, as eager does"}

EXPECTED: dict[str, dict[str, Any]] = {
    "empty": _UNINITIALISED,
    "empty_like": _UNINITIALISED,
    "empty_strided": _UNINITIALISED,
    "empty_permuted": _UNINITIALISED,
    "new_empty": _UNINITIALISED,
    "new_empty_strided": _UNINITIALISED,
    # A function of no tensors whose result is a constant: FX stores a torch.Size in its graph
    # as a plain tuple (torch.fx.node.map_aggregate), so braze returns a tuple of the same sizes.
    "broadcast_shapes": {"paths": ("fx",), "outcome": "wrong", "why": "FX stores a constant torch.Size as a tuple"},
}


def expected(name: str) -> dict[str, Any]:
    return EXPECTED.get(name, {})
