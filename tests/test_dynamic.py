"""Shape-generic programs: one program for every size of the dimensions that change between
calls (braze.compile's `dynamic`), exact at every size, its guard binding and checking sizes."""

from __future__ import annotations

import resource
import threading

import pytest
import torch
import torch.nn as nn

import braze
from braze.dims import Expr, Undecided, fit, positive

from .helpers import assert_same

SIZES = (1, 7, 15, 16, 17, 33, 257, 32769 // 64 + 1)


def lesson() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)).eval()


def calls(compiled, fn, inputs_list):
    """Call compiled and eager on each inputs tuple, requiring the same answers."""
    with torch.no_grad():
        for inputs in inputs_list:
            assert_same(compiled(*inputs), fn(*inputs))


def generic(compiled) -> list:
    return [p for p in compiled.programs() if p.family is not None]


def test_expressions_fit_and_compare():
    s0, s1 = Expr.symbol(0, 2), Expr.symbol(1, 2)
    e = 128 * s0 * s1 + 2 * s1 * s1 + 3
    grids = [[4, 5, 6], [7, 8, 9]]
    points = [(a, b) for a in grids[0] for b in grids[1]]
    assert fit(points, [e.eval(p) for p in points], grids) == e
    assert fit([(a,) for a in (2, 3, 4)], [1, 2, 4], [[2, 3, 4]]) is None  # 2**x/2 has no integer fit
    assert max(s0, 1) is s0 and s0 >= 1 and s0 * 64 + 1 > s0 and (s0 - s0) == 0
    with pytest.raises(Undecided):
        positive(s0 - 8)


def test_a_batch_stream_compiles_twice_and_stays_exact():
    model = lesson()
    compiled = braze.compile(model)
    gen = torch.Generator().manual_seed(0)
    batches = [32, 100, *SIZES, *(int(torch.randint(1, 257, (), generator=gen)) for _ in range(20))]
    calls(compiled, model, [(torch.randn(b, 64),) for b in batches])
    assert len(compiled.compilations) == 2, [c.why for c in compiled.compilations]
    assert "generic in s0 = argument 0 dim 0 (>= 1)" in compiled.compilations[1].why
    (prog,) = generic(compiled)
    assert prog.native and prog.kernel_count == 2 and not prog.externs
    assert type(compiled).__call__ is prog.entry, "the generic program's native entry serves every batch"


def test_dynamic_true_is_generic_from_the_first_call_and_false_never():
    model = lesson()
    always, never = braze.compile(model, dynamic=True), braze.compile(model, dynamic=False)
    calls(always, model, [(torch.randn(b, 64),) for b in (5, 9, 40)])
    calls(never, model, [(torch.randn(b, 64),) for b in (5, 9, 40)])
    assert len(always.compilations) == 1 and generic(always)
    assert len(never.compilations) == 3 and not generic(never)


class Block(nn.Module):
    """A transformer-style block on [batch, seq, hidden]: linears on the rows, broadcasting,
    a batched matmul, concatenation, exp (MKL's vector math), scratch values."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)
        self.scale = nn.Parameter(torch.randn(16))

    def forward(self, x, y):
        h = torch.relu(self.up(x)) * 0.5
        h = self.down(h) + y * self.scale
        scores = torch.bmm(h, h.transpose(1, 2))
        return torch.cat([torch.exp(h), h - 1.0], dim=1), scores


def test_two_symbols_with_a_relation_between_arguments():
    model = Block().eval()
    compiled = braze.compile(model)
    shapes = [(2, 8), (3, 5), (4, 9), (1, 1), (5, 33), (2, 17), (3, 7)]
    calls(compiled, model, [(torch.randn(b, s, 16), torch.randn(b, s, 16)) for b, s in shapes])
    assert len(compiled.compilations) <= 3, [c.why for c in compiled.compilations]
    (prog,) = generic(compiled)
    assert len(prog.family.lo) == 2 and prog.native
    # x and y share both symbols: a call whose sizes disagree fails as eager's does
    x, y = torch.randn(3, 8, 16), torch.randn(3, 9, 16)
    with pytest.raises(RuntimeError) as eager_error:
        model(x, y)
    with pytest.raises(RuntimeError) as braze_error, torch.no_grad():
        compiled(x, y)
    assert str(braze_error.value) == str(eager_error.value)


def test_layouts_outside_the_family_compile_for_themselves():
    model = lesson()
    compiled = braze.compile(model)
    xs = [torch.randn(4, 64), torch.randn(8, 64), torch.randn(64, 12).t(), torch.randn(0, 64), torch.randn(6, 64)]
    calls(compiled, model, [(x,) for x in xs])
    assert len(compiled.compilations) == 4  # first, generic, transposed, empty; the last is covered


class _Attention(nn.Module):
    def forward(self, x):
        q, k, v = x.unbind(2)
        out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return out.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1)


def test_sizes_whose_aten_layout_differs_from_the_generic_programs_compile_for_themselves():
    """ATen's attention returns size-1 batches and heads in another layout than the generic
    program expects: the program goes stale for those sizes, which then get programs of their
    own (the wrapper was handed the same generic program back until Python's recursion limit)."""
    model = _Attention()
    compiled = braze.compile(model)
    shapes = [(2, 7, 3, 3, 32), (1, 1, 3, 1, 32), (1, 1, 3, 1, 32), (3, 5, 3, 2, 32)]
    calls(compiled, model, [(torch.randn(*s),) for s in shapes])
    assert "another layout at these sizes" in compiled.compilations[2].why


def test_sizes_used_as_numbers_keep_programs_specialised():
    def fn(x):
        return x * x.shape[0]  # a size becomes a float operand: no polynomial of the batch

    compiled = braze.compile(fn)
    calls(compiled, fn, [(torch.randn(b, 3),) for b in (2, 5, 9)])
    assert not generic(compiled)
    assert "compiled for these sizes only" in compiled.compilations[1].why


@pytest.mark.parametrize("threads", [1, 2])
def test_loops_split_between_threads_where_eager_does(threads):
    def fn(x):
        return torch.relu(x * 2.0 + 1.0) - x

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        compiled = braze.compile(fn)
        # around the 32768-element threshold, and odd sizes: vector body and scalar tail
        calls(compiled, fn, [(torch.randn(b, 64),) for b in (3, 5, 511, 512, 513, 1000, 17, 1)])
        assert generic(compiled)
    finally:
        torch.set_num_threads(before)


def test_concurrent_calls_of_other_sizes():
    model = Block().eval()
    compiled = braze.compile(model)
    calls(compiled, model, [(torch.randn(2, 5, 16), torch.randn(2, 5, 16)), (torch.randn(3, 7, 16),) * 2])
    compiled_before = len(compiled.compilations)
    errors: list[str] = []

    def worker(seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for _ in range(30):
                b, s = int(torch.randint(2, 6, (), generator=gen)), int(torch.randint(5, 40, (), generator=gen))
                x, y = torch.randn(b, s, 16, generator=gen), torch.randn(b, s, 16, generator=gen)
                got, want = compiled(x, y), model(x, y)
                if not all(torch.equal(g, w) for g, w in zip(got, want)):
                    errors.append(f"sizes {b}x{s}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(compiled.compilations) == compiled_before == 2 and len(generic(compiled)) == 1


def test_explain_names_the_symbols():
    model = lesson()
    compiled = braze.compile(model)
    calls(compiled, model, [(torch.randn(b, 64),) for b in (4, 8)])
    report = braze.explain(compiled, torch.randn(4, 64))
    assert "generic in s0 = argument 0 dim 0" in report.sections["compilations of this wrapper"]


class KeywordBlock(nn.Module):
    """A forward of **kwargs (TorchDynamo captures it) with native GEMMs and ATen calls."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc, self.norm = nn.Linear(16, 16), nn.LayerNorm(16)

    def forward(self, x, **kwargs):
        h = self.norm(torch.relu(self.fc(x)) + x)
        return torch.nn.functional.softplus(h.view(h.shape[0], -1, 4)) * 2.0  # softplus: an ATen call


def test_torchdynamo_symbolic_sizes_make_one_generic_program():
    model = KeywordBlock().eval()
    compiled = braze.compile(model)
    shapes = [(2, 8), (3, 5), (4, 9), (5, 33), (2, 17), (3, 7), (6, 2)]
    with torch.no_grad():
        for b, s in shapes:
            x = torch.randn(b, s, 16)
            assert_same(compiled(x, scale=1), model(x, scale=1))
    programs = [p for sub in compiled._subgraphs for p in sub.programs()]
    (prog,) = [p for p in programs if p.family is not None]
    assert prog.externs and prog.kernel_count >= 1, "ATen calls and native kernels in one generic program"
    assert len(prog.family.lo) == 2  # batch and sequence, as TorchDynamo's symbols
    # TorchDynamo traces the arguments' sizes as symbols from the first call: one graph, one program
    assert sum(len(sub.compilations) for sub in compiled._subgraphs) == 1


class Positions(nn.Module):
    """Adds a fixed table of 16 positions, sliced to the input's length (as BERT's position ids)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.register_buffer("table", torch.randn(16, 8))

    def forward(self, x):
        return torch.relu(x + self.table[: x.shape[1]])


def test_a_view_of_a_fixed_buffer_bounds_the_family():
    model = Positions()
    compiled = braze.compile(model)
    calls(compiled, model, [(torch.randn(2, s, 8),) for s in (5, 9, 16, 3, 1)])
    # through TorchDynamo (FX cannot slice by a traced size): its graph for all sizes, then its
    # own graph for a sequence of 1 (the batch never changed: specialised)
    whys = [c.why for sub in compiled._subgraphs for c in sub.compilations]
    assert [p.family.hi for p in generic(compiled)] == [(2**62, 16)] and len(whys) == 2, whys
    x = torch.randn(2, 20, 8)  # past the table: eager's slice stops at 16, and the add fails
    with pytest.raises(RuntimeError) as eager_error:
        model(x)
    with pytest.raises(RuntimeError) as braze_error, torch.no_grad():
        compiled(x)
    assert str(braze_error.value) == str(eager_error.value)


def test_scratch_memory_grows_to_the_largest_call_and_is_kept():
    model = lesson()
    compiled = braze.compile(model)
    calls(compiled, model, [(torch.randn(b, 64),) for b in (8, 16)])
    (prog,) = generic(compiled)
    words = prog._descriptor.words
    capacity = braze.entry.W["capacity"]
    calls(compiled, model, [(torch.randn(4096, 64),)])
    grown = words[capacity]
    assert grown >= 4096 * 64 * 4, "the first GEMM's output lives in scratch"
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    calls(compiled, model, ((torch.randn(b, 64),) for b in (8, 4096) * 100))  # made one at a time
    assert words[capacity] == grown, "kept, not reallocated per call"
    assert (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024 < 64


def test_a_call_outside_the_family_it_started_is_compiled_for_itself():
    def fn(x):  # ATen's bmm of one matrix is not MKL's batched GEMM: a batch of 1 lowers otherwise
        return torch.bmm(x, x.transpose(1, 2)) * 2.0

    compiled = braze.compile(fn)
    calls(compiled, fn, [(torch.randn(b, 8, 16),) for b in (4, 1, 1, 3, 6)])
    whys = [c.why for c in compiled.compilations]
    assert len(whys) == 3 and "generic in s0 = argument 0 dim 0 (>= 2)" in whys[1], whys
    assert "outside the generic program's" in whys[2], whys
    assert [p.family.lo for p in generic(compiled)] == [(2,)]


def test_the_dynamic_setting_survives_pickling():
    import pickle

    for dynamic in (None, True, False):
        again = pickle.loads(pickle.dumps(braze.compile(lesson(), dynamic=dynamic)))
        assert again.dynamic is dynamic


class ConvKeywords(nn.Module):
    """A convolution with a forward of **kwargs: TorchDynamo captures it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x, **kwargs):
        return torch.relu(self.conv(x))


def test_an_images_batch_starts_symbolic_and_its_height_and_width_static():
    # symbolic heights and widths cost TorchDynamo's trace of a Swin 30-46 s instead of 1.2 s
    model = ConvKeywords()
    compiled = braze.compile(model)
    with torch.no_grad():
        for shape in [(2, 3, 8, 8), (3, 3, 8, 8), (5, 3, 8, 8), (2, 3, 12, 9)]:
            x = torch.randn(shape)
            assert_same(compiled(x, scale=1), model(x, scale=1))
    first, again = compiled._subgraphs  # another height and width: TorchDynamo traced again
    assert [d for places in first.symbolic for _, d in places if d >= 0] == [0]  # (-1: an int argument)
    assert len(first.compilations) == 1
