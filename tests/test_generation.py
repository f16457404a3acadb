"""Hugging Face models called as their users call them (needs transformers, a dev dependency):
keyword calls, **kwargs forwards and greedy generation with a KV cache, whose decode step
changes shape every step: compiled a bounded number of times, the tokens eager's."""

from __future__ import annotations

import warnings

import pytest
import torch

import braze

transformers = pytest.importorskip("transformers")


def tiny_gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=100, n_positions=64)
    return transformers.GPT2LMHeadModel(config).eval()


def test_greedy_generate_matches_eager_with_bounded_compilations():
    model, eager = tiny_gpt2(), tiny_gpt2()
    compiled = braze.compile(model.forward)
    model.forward = compiled
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", braze.BrazeWarning)  # nothing may run eagerly
        for length in (5, 9, 9):
            ids = torch.randint(0, 100, (1, length), generator=gen)
            want = eager.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
            got = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
            assert torch.equal(got, want)
    programs = [p for sub in compiled._subgraphs for p in sub.programs()]
    assert any(p.family is not None for p in programs), "the growing cache is served by a generic program"
    compilations = sum(len(sub.compilations) for sub in compiled._subgraphs)
    assert compilations <= 4, [c.why for sub in compiled._subgraphs for c in sub.compilations]


def test_batched_generate_with_a_padding_mask_compiles_a_bounded_number_of_times():
    """Each decode step reads the padding mask (the whole sequence) at positions up to the cache's
    length: the generic program's grid keeps the mask the longer, else every step compiled a
    program of its own (more steps than the cache holds: each generate compiled them all again)."""
    model, eager = tiny_gpt2(), tiny_gpt2()
    compiled = braze.compile(model.forward)
    model.forward = compiled
    ids = torch.randint(1, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # the second sequence left-padded
    counts = []
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", braze.BrazeWarning)
        want = eager.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
        for _ in range(2):
            got = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
            assert torch.equal(got, want)
            counts.append(sum(len(sub.compilations) for sub in compiled._subgraphs))
    whys = [c.why for sub in compiled._subgraphs for c in sub.compilations]
    assert counts[0] <= 4 and counts[1] == counts[0], whys


def test_bert_keyword_calls_of_many_sizes():
    torch.manual_seed(0)
    config = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=100
    )
    model = transformers.BertModel(config).eval()
    compiled = braze.compile(model)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", braze.BrazeWarning)
        for b, s in ((2, 7), (3, 12), (4, 9), (2, 33)):
            ids = torch.randint(0, 100, (b, s), generator=gen)
            mask = torch.ones(b, s, dtype=torch.long)
            inputs = {"input_ids": ids, "attention_mask": mask, "token_type_ids": None}  # None: the default
            want = model(**inputs)
            got = compiled(**inputs)
            assert type(got) is type(want) and torch.equal(got.last_hidden_state, want.last_hidden_state)
            assert torch.equal(got.pooler_output, want.pooler_output)
    whys = [c.why for sub in compiled._subgraphs for c in sub.compilations]
    assert len(whys) <= 2, whys


def test_explain_a_keyword_call_of_a_hugging_face_model():
    torch.manual_seed(0)
    config = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=100
    )
    model = transformers.BertModel(config).eval()
    ids = torch.randint(0, 100, (2, 7))
    with torch.no_grad():
        report = braze.explain(model, input_ids=ids, attention_mask=torch.ones(2, 7, dtype=torch.long))
    placement = report.sections["native vs ATen"]
    assert "layer_norm" in report.sections["IR after lowering"] and "F.layer_norm" not in placement
    # The program a wrapper runs: generic in the sizes TorchDynamo left symbolic (explain showed
    # one for these sizes alone, which is not what runs)
    assert report.program.family is not None and ",s1," in report.sections["IR after lowering"]
    assert "generic in s" in report.sections["compilations of this call"]
