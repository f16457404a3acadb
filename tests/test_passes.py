"""Passes on lowered graphs, without LLVM: fusion decisions and the memory plan."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import braze
from braze import capture
from braze.ir import Op
from braze.lowering import lower
from braze.passes import PIPELINE, cse, dce, fuse_elementwise, fuse_epilogue, plan_memory, run_passes

from .helpers import check_model


def lowered(fn, *inputs):
    return lower(capture.trace(fn, len(inputs)), inputs)


def test_pass_manager_records_every_pass_and_its_time():
    graph, log = run_passes(lowered(lambda x: x * 2 + 1, torch.randn(4)).graph, check=True)
    assert [r.name for r in log.records] == [p.__name__ for p in PIPELINE]
    assert all(ms >= 0 for _, ms in log.timings())
    assert graph.count(Op.FUSED) == 1


def test_dce_keeps_externs_and_drops_dead_pure_nodes():
    def f(x):
        x * 2, torch.rand_like(x)  # both dead; only the random op must stay
        return x + 1

    out = dce(lowered(f, torch.randn(4)).graph)
    assert out.count(Op.MUL) == 0 and out.count(Op.EXTERN) == 1 and out.count(Op.ADD) == 1


def test_dce_drops_dead_tensor_factories_of_constants_only():
    def f(x):
        # Llama's key/value cache makes torch.tensor([]) per layer that a forward without it never
        # reads: dropped, as are other factories of constants. One of a size that follows the
        # call's stays (in a generic program): at sizes eager rejects, it must raise eager's error.
        torch.tensor([]), torch.full((2,), 1.5), torch.rand(3), torch.zeros(x.shape[0] - 2)
        return x + 1

    graphs = []  # TorchDynamo's graph (FX runs calls of constants while it traces)

    def collect(gm, example_inputs):
        graphs.append(gm)
        return gm

    x = torch.randn(4)
    torch.compile(f, backend=collect, dynamic=False)(x)
    graph = lower(capture.from_graph_module(graphs[0]), (x,)).graph
    assert graph.count(Op.EXTERN) == 4
    assert [n.attrs["label"] for n in dce(graph).nodes if n.op is Op.EXTERN] == ["torch.rand"]
    compiled = braze.compile(f, dynamic=True)
    with torch.no_grad():
        compiled(x)
    (prog,) = compiled.programs()
    assert prog.family is not None and [label for label, _ in prog.externs] == ["torch.rand", "torch.zeros"]


def test_cse_makes_a_repeated_value_once():
    # T5 copies one view of its position bias into the attention's layout in every layer
    def f(x):
        bias = x.t()
        return bias.contiguous() * 2 + bias.contiguous() * 3, torch.tanh(x) - torch.tanh(x)

    g = cse(dce(lowered(f, torch.randn(8, 16)).graph))
    assert g.count(Op.COPY) == 1 and g.count(Op.VIEW) == 1
    assert sum(g.count(op) for op in (Op.TANH, Op.VML, Op.EXTERN)) == 1  # (vmsTanh where MKL's kernel is not braze's)
    x = torch.randn(8, 16)
    compiled = check_model(f, (x,), externs=0)
    assert compiled.programs()[0].graph.count(Op.FUSED) == 3  # the copy, and each output's loop
    # A repeat an ATen call reads stays (the call's arguments name it)
    check_model(lambda x: x.t().contiguous() * 2 + torch.cumsum(x.t().contiguous(), 0), (x,), externs=1)


def test_cse_keeps_outputs_apart_and_reads_across_a_change_in_place():
    def outputs(x):
        return x * 2, x * 2  # eager's are two tensors: the caller may change one

    g = cse(lowered(outputs, torch.randn(4)).graph)
    assert g.count(Op.MUL) == 2
    compiled = braze.compile(outputs)
    a, b = compiled(torch.ones(4))
    a.add_(1)
    assert torch.equal(b, torch.full((4,), 2.0))

    def changed(x):
        y = x + 1
        first = y * 2
        y.cumsum_(0)  # an ATen call between the two products changes what they read
        return first, y * 2 + 0

    g = cse(dce(lowered(changed, torch.randn(4)).graph))
    assert g.count(Op.MUL) == 2
    check_model(changed, (torch.randn(4),), fallback=True)


def test_chain_fuses_into_one_loop_but_shared_values_do_not():
    g = fuse_elementwise(dce(lowered(lambda x: ((x + 1) * 2).relu(), torch.randn(8)).graph))
    assert g.count(Op.FUSED) == 1 and [b.op for b in g.nodes[-1].body] == [Op.ADD, Op.MUL, Op.RELU]
    g = fuse_elementwise(dce(lowered(lambda x: (lambda t: (t.relu(), t.abs()))(x + 1), torch.randn(8)).graph))
    assert g.count(Op.FUSED) == 3  # x + 1 has two users: it is stored once, read twice


def test_broadcast_producer_is_not_fused_into_a_bigger_loop():
    g = fuse_elementwise(lowered(lambda x, y: (x * 2) + y, torch.randn(8), torch.randn(4, 8)).graph)
    assert g.count(Op.FUSED) == 2


def test_epilogue_joins_the_gemm_only_when_it_is_the_only_user():
    w, b = torch.randn(16, 16), torch.randn(16)
    g = fuse_epilogue(fuse_elementwise(dce(lowered(lambda x: F.linear(x, w, b).relu() + x, torch.randn(4, 16)).graph)))
    assert g.count(Op.GEMM) == 1 and g.count(Op.FUSED) == 0
    g = fuse_epilogue(
        fuse_elementwise(dce(lowered(lambda x: (lambda y: (y.relu(), y))(F.linear(x, w, b)), torch.randn(4, 16)).graph))
    )
    assert g.count(Op.FUSED) == 1 and not next(n for n in g.nodes if n.op is Op.GEMM).body


def test_memory_plan_reuses_scratch_buffers():
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(6)]).eval()
    graph, _ = run_passes(lowered(model, torch.randn(8, 32)).graph)
    stores = [n.attrs["store"] for n in graph.nodes if n.op is Op.GEMM]
    assert stores[-1] == "out"
    buffers = {s[1] for s in stores[:-1]}
    assert len(stores) == 6 and len(buffers) == 2  # ping-pong, not one buffer per layer


def test_elementwise_writes_over_an_input_that_dies():
    graph, _ = run_passes(lowered(lambda x: (x @ x).abs().t().contiguous().relu(), torch.randn(8, 8)).graph)
    tmp = {n.name: n.attrs["store"] for n in graph.nodes if isinstance(n.attrs["store"], tuple)}
    assert len(set(tmp.values())) == 1, tmp  # gemm result, its copy and the loop share one buffer


def test_plan_marks_views_and_outputs():
    graph = plan_memory(lowered(lambda x: (x + 1).t(), torch.randn(3, 4)).graph)
    by = {n.op: n.attrs["store"] for n in graph.nodes}
    assert by[Op.VIEW] == "alias" and by[Op.ADD] == "out" and by[Op.INPUT] == "input"


def test_a_loop_never_writes_over_a_buffer_it_reads_through_another_view():
    def f(a):
        x = a * 2
        return (x + x.t()).sum(0)  # x + x.t() is scratch: writing it over x would corrupt x.t()

    graph, _ = run_passes(lowered(f, torch.randn(33, 33)).graph)
    stores = [n.attrs["store"] for n in graph.nodes if n.op is Op.FUSED]
    assert len(set(stores)) == 2, stores
