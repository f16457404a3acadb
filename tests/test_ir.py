"""The IR alone: printing and verify (no LLVM, no torch ops run)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from braze.ir import Graph, Node, Op, TensorMeta, VerifyError, broadcast_shape, verify


def meta(*shape: int) -> TensorMeta:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= s
    return TensorMeta(shape, tuple(reversed(strides)), 0, torch.float32)


def small_graph() -> Graph:
    x = Node("x0", Op.INPUT, (), meta(4, 8), {"index": 0})
    y = Node("v1", Op.MUL, ("x0", 2.0), meta(4, 8))
    z = Node("v2", Op.RELU, ("v1",), meta(4, 8))
    return Graph(("x0",), (x, y, z), ("v2",))


def test_prints_readable_text():
    text = str(small_graph())
    assert text.splitlines()[0] == "graph(x0):"
    assert "v1: float32[4,8] = mul(x0, 2.0)" in text
    assert text.splitlines()[-1] == "  return v2"
    assert str(TensorMeta((4, 8), (1, 4), 2, torch.float32)) == "float32[4,8](1,4)+2"


def test_verify_accepts_a_good_graph():
    assert verify(small_graph()) is not None


@pytest.mark.parametrize(
    "broken,message",
    [
        (lambda g: Graph(g.inputs, (g.nodes[0], g.nodes[2], g.nodes[1]), g.outputs), "before it is defined"),
        (lambda g: Graph(g.inputs, g.nodes + (g.nodes[2],), g.outputs), "assigned twice"),
        (lambda g: Graph(g.inputs, g.nodes, ("nope",)), "not defined"),
        (lambda g: Graph((), g.nodes, g.outputs), "missing from graph.inputs"),
        (
            lambda g: Graph(g.inputs, g.nodes + (Node("v3", Op.ADD, ("v2", "x0"), meta(3, 8)),), g.outputs),
            "do not broadcast",
        ),
        (
            lambda g: Graph(g.inputs, g.nodes[:2] + (replace(g.nodes[2], attrs={"alias_of": "v2"}),), g.outputs),
            "not an earlier value",
        ),
    ],
)
def test_verify_rejects(broken, message):
    with pytest.raises(VerifyError, match=message):
        verify(broken(small_graph()))


def test_verify_checks_fused_bodies():
    g = small_graph()
    body = (Node("v1", Op.MUL, ("x0", 2.0), meta(4, 8)), Node("v2", Op.RELU, ("v9",), meta(4, 8)))
    bad = Graph(g.inputs, (g.nodes[0], Node("v2", Op.FUSED, ("x0",), meta(4, 8), {"body": body})), ("v2",))
    with pytest.raises(VerifyError, match="unbound v9"):
        verify(bad)


def test_broadcast_shape():
    assert broadcast_shape((3, 1), (1, 4)) == (3, 4)
    assert broadcast_shape((5,), (2, 1, 5)) == (2, 1, 5)
    with pytest.raises(RuntimeError):
        broadcast_shape((3,), (4,))


def test_span_covers_strided_views():
    assert TensorMeta((4, 8), (8, 1), 0, torch.float32).span == 32
    assert TensorMeta((8, 4), (1, 8), 3, torch.float32).span == 35
    assert TensorMeta((0, 4), (4, 1), 0, torch.float32).span == 0
