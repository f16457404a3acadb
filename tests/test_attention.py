"""Exact mode's attention: ATen's flash attention (scaled_dot_product_attention on CPU, float32)
reproduced by braze's kernel (attention.EXACT: the FMA chains of MKL's generic GEMM, ATen's
exp_u20 and its scalar tail's double exp, its max and sum orders; docs/aten-bits.md) where its
probe agrees, else ATen's call."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import braze
from braze.ir import Op

from .helpers import check_model


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v)


def _exact_kernels(compiled) -> list:
    return [k.attrs.get("exact") for s in compiled.programs()[-1].segments for k in s.kernels if k.op is Op.ATTENTION]


def _special(t: torch.Tensor, every: int = 97) -> torch.Tensor:
    values = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e30, 3e38, 1e-40])
    flat = t.view(-1)
    flat[::every] = values.repeat(flat[::every].numel() // len(values) + 1)[: flat[::every].numel()]
    return t


# (tokens = keys, head size): blocks of queries of at least 4 (ATen's are 32, 64 from 192 tokens, 256 from
# 768), 12 to 512 keys, the keys' 16-lane body and its tail of 0-15 (ATen's double exp)
NATIVE = [(12, 64), (16, 64), (17, 32), (31, 64), (32, 64), (36, 64), (64, 32), (197, 64), (260, 64), (512, 64)]


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize("tokens,d", NATIVE)
@pytest.mark.parametrize("special", [False, True])
@pytest.mark.parametrize("fn", [_attention, _causal], ids=["full", "causal"])
def test_attention_is_braze_kernel_with_flash_attentions_bits(tokens, d, special, fn, threads):
    # (causal: ATen's block of keys is all of them, those after a row's query -inf)
    for t in (1, 2):
        threads(t)
        q, k, v = (torch.randn(2, 3, tokens, d) for _ in range(3))
        if special:
            q, k, v = _special(q), _special(k, 89), _special(v, 83)
        compiled = check_model(fn, (q, k, v), externs=0)
        assert _exact_kernels(compiled) == [True]


# 1-3 queries in the last block, under 12 keys, more than one block of keys: MKL's other paths
# (found where they differ) or ATen's rescale between blocks, which the kernel does not compute
@pytest.mark.parametrize("tokens", [1, 2, 3, 7, 11, 33, 35, 66, 513])
def test_attention_sizes_it_does_not_reproduce_are_atens_call(tokens, threads):
    threads(2)
    q, k, v = (torch.randn(1, 2, tokens, 32) for _ in range(3))
    compiled = check_model(_attention, (q, k, v), externs=1)
    assert _exact_kernels(compiled) == []


def test_attention_of_strided_heads_a_scale_and_a_model(threads):
    threads(2)
    # heads a view of [B, T, H, d] (as models split them), a scale of the caller's
    q, k, v = (torch.randn(2, 40, 4, 32).transpose(1, 2) for _ in range(3))
    check_model(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, scale=0.3), (q, k, v), externs=0)

    class Block(torch.nn.Module):  # timm's ViT attention, as FX captures it (sizes fixed)
        def __init__(self) -> None:
            super().__init__()
            self.qkv, self.proj = torch.nn.Linear(64, 192), torch.nn.Linear(64, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, n, c = x.shape
            q, k, v = self.qkv(x).reshape(b, n, 3, 2, 32).permute(2, 0, 3, 1, 4).unbind(0)
            return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c))

    compiled = check_model(Block().eval(), (torch.randn(2, 50, 64),), externs=0)
    assert _exact_kernels(compiled) == [True]


def test_attention_whose_probe_disagrees_is_atens_call(threads, monkeypatch):
    from braze import attention
    from braze.lowering import attention as lowering

    threads(2)
    lowering._probe.cache_clear()
    monkeypatch.setattr(attention, "exact", lambda q, *rest: torch.zeros_like(q))
    try:
        q, k, v = (torch.randn(1, 2, 24, 32) for _ in range(3))
        compiled = check_model(_attention, (q, k, v), externs=1)
        assert _exact_kernels(compiled) == []
        assert "its probe at these sizes disagrees" in braze.explain(_attention, q, k, v)
    finally:
        lowering._probe.cache_clear()


def test_attention_follows_flash_attention_being_disabled(threads):
    # Without ATen's flash kernel eager runs the math one (other bits): the program computing the
    # flash kernel's must not run then; a program of ATen's call does, and the first again after.
    threads(2)
    q, k, v = (torch.randn(1, 2, 48, 32) for _ in range(3))
    compiled = check_model(_attention, (q, k, v), externs=0)
    with sdpa_kernel(SDPBackend.MATH):
        check_model(_attention, (q, k, v), compiled=compiled)
        assert len(compiled.programs()) == 2 and _exact_kernels(compiled) == []
    check_model(_attention, (q, k, v), compiled=compiled)
    assert len(compiled.programs()) == 2


@pytest.mark.parametrize("threads_", [1, 2])
@pytest.mark.parametrize("fn", [_attention, _causal], ids=["full", "causal"])
def test_attention_of_changing_sizes_is_one_generic_program_choosing_per_call(threads_, fn, threads, monkeypatch):
    # Which sizes the kernel reproduces depends on the tokens modulo ATen's blocks: a program
    # generic in them keeps ATen's call and runs the kernel in its place at the sizes it
    # reproduces (checked per call; 33, 35, 66 and 7 tokens, a block of 1-3 queries or under 12
    # keys, and 600, two blocks of keys, are ATen's), as its probes at several sizes agreed. The
    # first call's program, at its own sizes, is the kernel's.
    from braze.lowering import attention as lowering

    threads(threads_)
    ran, real = [], lowering.per_call
    monkeypatch.setattr(lowering, "per_call", lambda *a: ran.append(1) or real(*a))
    compiled = braze.compile(fn)
    for tokens in (40, 48, 33, 56, 64, 97, 35, 66, 7, 200, 600, 12):
        check_model(fn, tuple(_special(torch.randn(1, 2, tokens, 32)) for _ in range(3)), compiled=compiled)
    assert len(compiled.compilations) == 2, [c.why for c in compiled.compilations]
    first, generic = compiled.programs()
    assert first.family is None and _exact_kernels_of(first) == [True]
    assert generic.family is not None and generic.native and ran
    assert "or braze's kernel of it where a call's sizes are ones it reproduces" in generic.externs[0][1]
    kernel = {"scale": torch.tensor(32**-0.5).item(), "causal": fn is _causal, "mask": 0}
    assert [n.attrs.get("exact_per_call") for n in generic.graph.nodes if n.op is Op.EXTERN] == [kernel]
    with sdpa_kernel(SDPBackend.MATH):  # (eager's math kernel: the flash kernel's program must not run)
        check_model(fn, tuple(torch.randn(1, 2, 70, 32) for _ in range(3)), compiled=compiled)
    assert len(compiled.compilations) == 3


def test_a_generic_programs_failing_probe_keeps_atens_call(threads, monkeypatch):
    from braze.lowering import attention as lowering

    threads(2)
    monkeypatch.setattr(lowering, "_same", lambda shape, keys, *form: keys != 197)
    compiled = braze.compile(_attention)
    for tokens in (40, 48, 56):
        check_model(_attention, tuple(torch.randn(1, 2, tokens, 32) for _ in range(3)), compiled=compiled)
    generic = compiled.programs()[-1]
    assert generic.family is not None and not any(n.attrs.get("exact_per_call") for n in generic.graph.nodes)


def _exact_kernels_of(program) -> list:
    return [k.attrs.get("exact") for s in program.segments for k in s.kernels if k.op is Op.ATTENTION]


def _masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _mask(kind: str, tokens: int) -> torch.Tensor:
    """A fifth of the keys masked (false, -inf), the first query's all; broadcast as models do."""
    shape = {"bool": (2, 3, tokens, tokens), "bool-2d": (tokens, tokens), "float": (2, 3, tokens, tokens)}
    shape["float-heads"] = (1, 3, tokens, tokens)
    off = torch.rand(shape[kind]) < 0.2
    off[..., 0, :] = True
    if kind.startswith("bool"):
        return ~off
    return torch.randn(shape[kind]).masked_fill(off, -float("inf"))


@pytest.mark.parametrize("tokens", [12, 17, 36, 100, 197])
@pytest.mark.parametrize("kind", ["bool", "bool-2d", "float", "float-heads"])
def test_attention_with_a_mask_is_braze_kernel_with_flash_attentions_bits(tokens, kind, threads):
    # fmaf(score, scale, mask), the max over the whole row NaN-propagating; a row all masked: 0s
    for t in (1, 2):
        threads(t)
        q, k, v = (_special(torch.randn(2, 3, tokens, 32), every) for every in (97, 89, 83))
        compiled = check_model(_masked, (q, k, v, _mask(kind, tokens)), externs=0)
        assert _exact_kernels(compiled) == [True]


def test_attention_with_a_mask_of_changing_sizes_chooses_per_call(threads):
    # Hugging Face's text models: a boolean causal mask [1, 1, tokens, tokens], generic in tokens
    threads(2)
    compiled = braze.compile(_masked)
    for tokens in (40, 48, 33, 56, 7, 100):
        q, k, v = (torch.randn(1, 2, tokens, 32) for _ in range(3))
        mask = torch.ones(tokens, tokens, dtype=torch.bool).tril()[None, None]
        check_model(_masked, (q, k, v, mask), compiled=compiled)
    generic = compiled.programs()[-1]
    assert generic.family is not None and generic.native
    kernel = {"scale": torch.tensor(32**-0.5).item(), "causal": False, "mask": 1}
    assert [n.attrs.get("exact_per_call") for n in generic.graph.nodes if n.op is Op.EXTERN] == [kernel]
