"""ATen results that follow from the call's sizes alone (causal masks, position ids) are made once
per sizes and kept by the program (passes.memoize, pybody.remember)."""

from __future__ import annotations

import sys
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import braze
from braze import pybody

from .helpers import assert_same


class Causal(nn.Module):
    """Attention under a causal mask built from the sequence length, as Hugging Face's decoders
    build theirs; `keep` (a keyword: TorchDynamo captures) also returns the mask."""

    def forward(self, q, keep=False):
        n = q.shape[-2]
        pos = torch.arange(n)
        mask = pos[None, :] <= pos[:, None]
        out = F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
        return (out, mask) if keep else out


def _memoized(prog) -> list[str]:
    return [n.attrs["label"] for n in prog.graph.nodes if n.attrs.get("memo")]


def test_a_causal_mask_is_made_once_per_sizes():
    model, compiled = Causal(), braze.compile(Causal())
    with torch.no_grad():
        for n in (5, 9, 5, 33, 9):
            q = torch.randn(2, n, 8)  # (an image-like 4-D input would start static in n: backend.py)
            assert_same(compiled(q), model(q))
    for prog in compiled.programs():
        assert _memoized(prog) == ["torch.arange", "_operator.le"]  # (the indexing: native views)
        assert "made once per sizes" in " ".join(why for _, why in prog.externs)
    sizes = [key for p in compiled.programs() for key in p.memo]
    generic = [p for p in compiled.programs() if p.family is not None]
    assert generic and len(sizes) == len(set(sizes)) and len(sizes) <= 3  # one entry per sizes seen


def test_the_kept_results_are_bounded(monkeypatch):
    monkeypatch.setattr(pybody, "MEMO_ENTRIES", 2)
    compiled = braze.compile(Causal(), dynamic=True)
    with torch.no_grad():
        for n in range(3, 9):
            compiled(torch.randn(1, 1, n, 4))
    (prog,) = compiled.programs()
    assert len(prog.memo) == 2
    monkeypatch.setattr(pybody, "MEMO_BYTES", 0)  # too large: made at every call, kept nowhere
    prog.memo.clear()
    with torch.no_grad():
        compiled(torch.randn(1, 1, 5, 4))
    assert not prog.memo


def test_results_returned_changed_in_place_or_random_are_made_every_call():
    def changed(q):
        mask = torch.ones(q.shape[-2], q.shape[-2], dtype=torch.bool).tril()
        mask.logical_not_()
        return F.scaled_dot_product_attention(q, q, q, attn_mask=~mask)

    def random(q):
        noise = torch.rand(q.shape[-2]) < 2  # always True, but drawn: the generator advances
        return q * noise[:, None]

    model = Causal()
    compiled = braze.compile(model)
    q = torch.randn(2, 3, 6, 8)
    with torch.no_grad():
        first = compiled(q, keep=True)
        first[1].fill_(False)  # a caller may change what it is given
        assert_same(compiled(q, keep=True), model(q, keep=True))
        for fn in (changed, random):
            c = braze.compile(fn)
            c(q)  # compiled
            for _ in range(2):
                torch.manual_seed(1)
                want, after_eager = fn(q), torch.get_rng_state()
                torch.manual_seed(1)
                assert_same(c(q), want)
                assert torch.equal(torch.get_rng_state(), after_eager)
            # the mask changed in place (and what reads it) is made anew; the ones it came from is kept
            assert [_memoized(p) for p in c.programs()] == [["torch.ones"] if fn is changed else []]


class Buckets(nn.Module):
    """T5's relative position buckets (abs, log, min, where and an in-place add on the sizes),
    then a lookup of the model's bias table."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Embedding(32, 2)

    def forward(self, x):
        n = x.shape[1]
        rel = torch.arange(n)[None, :] - torch.arange(n)[:, None]
        buckets = (rel > 0).to(torch.long) * 16
        rel = torch.abs(rel)
        large = 8 + (torch.log(rel.float() / 8) / 2.77 * 8).to(torch.long)
        large = torch.min(large, torch.full_like(large, 15))
        buckets += torch.where(rel < 8, rel, large)
        return x + self.bias(buckets).permute(2, 0, 1).sum(0)


def test_position_buckets_follow_from_the_sizes_even_where_braze_has_kernels():
    model = Buckets().eval()
    compiled = braze.compile(model)
    with torch.no_grad():
        for n in (7, 40, 7, 129):
            x = torch.randn(3, n, n)
            assert_same(compiled(x), model(x))
    for prog in compiled.programs():
        # abs, log, the comparisons, min and where: ATen calls, so that they are kept, and
        # `buckets += ...` with the `* 16` it changes in place (nothing else reads that); made at
        # every call: the sum over the looked-up table (a parameter's rows)
        assert {"torch.abs", "torch.log", "torch.min", "torch.where"} <= set(_memoized(prog))
        assert {"_operator.mul", "_operator.iadd"} <= set(_memoized(prog))
        made = [label for label, why in prog.externs if "kept" not in why]
        assert made == [".sum"], made


def test_a_value_read_before_it_is_changed_in_place_is_made_every_call():
    def read_before(x):
        n = x.shape[-1]
        a = torch.arange(n) * 2
        b = a + 1  # reads `a` before the change: a kept `a` would be kept changed
        a += 3
        return x + a + b

    def made_each_call(x):
        n = x.shape[-1]
        a, b = torch.arange(n) * 2, torch.arange(n) * 3
        a += b  # `b` is returned, so not kept: this change is made at every call, to a fresh `a`
        return x + a, b

    for fn in (read_before, made_each_call):
        compiled = braze.compile(fn)
        with torch.no_grad():
            for n in (5, 9, 5, 5):
                x = torch.randn(3, n)
                assert_same(compiled(x), fn(x))
        for prog in compiled.programs():
            assert "_operator.iadd" not in _memoized(prog)


def test_threads_share_and_drop_kept_results(monkeypatch):
    monkeypatch.setattr(pybody, "MEMO_ENTRIES", 2)  # entries dropped while other threads read
    model = Causal()
    compiled = braze.compile(model, dynamic=True)
    inputs = [torch.randn(1, 2, n, 4) for n in range(3, 11)]
    with torch.no_grad():
        want = [model(q) for q in inputs]
        compiled(inputs[0])
    failures = []

    def work(k: int) -> None:
        with torch.no_grad():
            for i in range(60):
                j = (i * 3 + k) % len(inputs)
                if not torch.equal(compiled(inputs[j]), want[j]):
                    failures.append(j)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures and len(compiled.programs()) == 1


def test_gpt2_keeps_its_mask_and_position_calls():
    """What memoize keeps for a GPT-2 compiled afresh: TorchDynamo's sizes learnt from another
    GPT-2 compiled before in the process (its automatic dynamic shapes, kept per code object of
    Hugging Face's functions) would change the graphs."""
    transformers = pytest.importorskip("transformers")
    torch._dynamo.reset()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=100, n_positions=64, use_cache=False)
    model = transformers.GPT2Model(config).eval()
    compiled = braze.compile(model)
    with torch.no_grad():
        for shape in ((2, 9), (3, 17), (2, 9)):
            ids = torch.randint(0, 100, shape)
            assert_same(compiled(ids).last_hidden_state, model(ids).last_hidden_state)
    calls = [(label, why) for p in compiled.programs() for label, why in p.externs]
    made = {label for label, why in calls if "kept" not in why}
    assert made == {"torch._C._nn.scaled_dot_product_attention"}  # all else: once per sizes
    assert sum("kept" in why for _, why in calls) >= 10


class CausalScaled(Causal):
    def forward(self, q):
        return super().forward(q) * 2  # (a native kernel writes the output)


def test_a_native_body_reads_the_kept_results_and_holds_them_while_it_runs():
    model, compiled = CausalScaled(), braze.compile(CausalScaled())
    q = torch.randn(2, 7, 8)
    with torch.no_grad():
        for _ in range(3):
            assert_same(compiled(q), model(q))
        (prog,) = compiled.programs()
        assert prog.native and prog._body_globals is None  # no Python body made
        (kept,) = prog.memo.values()
        refs = sys.getrefcount(kept)
        for _ in range(1000):
            compiled(q)
        assert sys.getrefcount(kept) == refs  # taken for the run, given back after
        prog.memo.clear()  # made again by the next call
        assert_same(compiled(q), model(q))
        assert len(prog.memo) == 1 and next(iter(prog.memo.values())) is not kept


def test_a_native_body_runs_every_segment_around_kept_results():
    # No ATen call left per call, but the kept results split the native code into segments.
    def fn(x):
        y = torch.softmax(x, -1)  # (a row kernel: the loop after cannot take it in)
        pos = torch.arange(x.shape[-1]).to(torch.float32)
        return (y + pos).relu()

    compiled = braze.compile(fn)
    for n in (5, 9):
        x = torch.randn(3, n)
        for _ in range(2):
            assert_same(compiled(x), fn(x))
    for prog in compiled.programs():
        assert prog.native and len(prog.segments) > 1 and prog.memo
