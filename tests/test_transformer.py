"""nn.TransformerEncoderLayer's fused fast path, lowered as the ops ATen's CPU kernel runs: bit for
bit with eager, and native (no ATen call) where eager takes that path."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import braze

from .helpers import check_model


def _layer(d: int, heads: int, activation: str, norm_first: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(
        d, heads, dim_feedforward=2 * d, dropout=0, activation=activation, norm_first=norm_first, batch_first=True
    )
    return layer.eval()


@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("d,heads", [(64, 2), (40, 4), (256, 8)])  # head sizes 32, 10, 32
@pytest.mark.parametrize("batch,length", [(1, 7), (2, 33), (3, 16)])
def test_encoder_layer_is_native_and_exact(activation, norm_first, d, heads, batch, length):
    x = torch.randn(batch, length, d)
    with torch.no_grad():
        check_model(_layer(d, heads, activation, norm_first), (x,), externs=0)


@pytest.mark.parametrize("threads", [1, 2])
def test_encoder_layer_across_threads_and_strided_inputs(threads):
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        layer = _layer(128, 4, "relu", False)
        padded = torch.randn(4, 64, 256)[:, :, :128]  # rows 256 apart: still one GEMM for the qkv matmul
        transposed = torch.randn(64, 4, 128).transpose(0, 1)  # its matmul is a bmm: ATen's fused op
        with torch.no_grad():
            check_model(layer, (padded,), externs=0)
            check_model(layer, (transposed,), externs=1)
    finally:
        torch.set_num_threads(prev)


def test_encoder_layer_with_a_padding_mask_stays_atens():
    layer = _layer(64, 2, "relu", False)
    x, mask = torch.randn(2, 9, 64), torch.zeros(2, 9, dtype=torch.bool)
    mask[1, 6:] = True
    with torch.no_grad():
        check_model(lambda x, m: layer(x, src_key_padding_mask=m), (x, mask))


def test_encoder_layer_one_token_long():
    with torch.no_grad():
        check_model(_layer(64, 2, "relu", True), (torch.randn(3, 1, 64),))


def test_encoder_with_a_padding_mask_takes_eagers_nested_path():
    """Told it is being compiled, nn.TransformerEncoder skips its nested-tensor path, and its
    outputs at padded positions differed from eager's zeros (by up to 3.4): braze tells torch.nn
    eager's answer."""
    torch.manual_seed(0)
    encoder = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(64, 4, 128, 0, batch_first=True), 2)
    x, mask = torch.randn(3, 10, 64), torch.zeros(3, 10, dtype=torch.bool)
    mask[1, 7:] = mask[2, 5:] = True
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # PyTorch's: nested tensors are a prototype
        check_model(lambda x, m: encoder.eval()(x, src_key_padding_mask=m), (x, mask))


class _AttentionThenBranch(torch.nn.Module):
    def __init__(self, heads: int = 4) -> None:
        super().__init__()
        self.attention = torch.nn.MultiheadAttention(64, heads, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.attention(x, x, x, need_weights=False)[0]
        if (y.sum() > -1e9).item():  # FX cannot trace this: TorchDynamo captures the model
            y = y + 1
        return y


def test_multihead_attention_inside_a_dynamo_graph_runs_eagers_fused_kernel():
    """Told it is being compiled, nn.MultiheadAttention runs F.multi_head_attention_forward
    instead of eager's fused kernel (1.2e-7 apart): braze tells it eager's answer, and the
    graph's torch._native_multi_head_attention is the fused layer's attention, bit for bit."""
    from braze.ir import Op

    torch.manual_seed(0)
    model = _AttentionThenBranch().eval()
    compiled = braze.compile(model)
    with torch.no_grad():
        for shape in ((2, 9, 64), (3, 33, 64)):
            check_model(model, (torch.randn(*shape),), compiled=compiled)
    progs = [p for sub in compiled._subgraphs for p in sub.programs()]
    assert not any("multi_head" in label for p in progs for label, _ in p.externs)
    assert any([n.op for n in p.graph.nodes].count(Op.BMM) == 2 for p in progs)  # (q k^T, then v)


@pytest.mark.parametrize("activation,norm_first", [("relu", False), ("gelu", True)])
@pytest.mark.parametrize("d,heads", [(64, 2), (128, 2), (40, 4)])  # head sizes 32, 64, 10
@pytest.mark.parametrize("batch,length", [(1, 1), (2, 33), (3, 16)])
@pytest.mark.parametrize("n", [1, 2])
def test_fast_modes_encoder_layer_runs_its_attention_kernel(
    activation, norm_first, d, heads, batch, length, n, threads
):
    """Fast mode: heads of a multiple of 32 are fast mode's attention kernel on the projection's
    output in place (no bmm, no scores in memory, no copies of q, k, v); others the fused path's
    ops as in exact mode. Within the contract either way, at scales 1e-3 to 1e3."""
    from braze.ir import Op

    threads(n)
    layer = _layer(d, heads, activation, norm_first)
    with torch.no_grad():
        for scale in (1e-3, 1.0, 1e3):
            x = torch.randn(batch, length, d) * scale
            assert braze.check_accuracy(layer, x, mode="fast").ok
        compiled = braze.compile(layer, mode="fast")
        compiled(x)
    (prog,) = compiled.programs()
    ops, fused = [node.op for node in prog.graph.nodes], d // heads % 32 == 0
    assert not prog.externs or not fused  # (exact mode's bmm of one token is ATen's)
    bmms = 0 if length == 1 else 2  # (or ATen's, with one token)
    assert (ops.count(Op.ATTENTION), ops.count(Op.BMM), ops.count(Op.SOFTMAX)) == ((1, 0, 0) if fused else (0, bmms, 1))
    assert ops.count(Op.GEMM) == 4  # the projections, the FFN
    assert not fused or ops.count(Op.FUSED) == 0  # no bias loops or copies of q, k, v and the heads


def test_fast_modes_native_multihead_attention_in_a_dynamo_graph_runs_its_attention_kernel():
    from braze.ir import Op

    torch.manual_seed(0)
    model = _AttentionThenBranch(heads=2).eval()
    compiled = braze.compile(model, mode="fast")
    with torch.no_grad():
        x = torch.randn(3, 33, 64)
        assert braze.check_accuracy(model, x, mode="fast").ok
        compiled(x)
    progs = [p for sub in compiled._subgraphs for p in sub.programs()]
    assert [n.op for p in progs for n in p.graph.nodes].count(Op.ATTENTION) == 1
    assert not any("multi_head" in label for p in progs for label, _ in p.externs)


class _SelfAttention(torch.nn.Module):
    def __init__(self, d: int, heads: int, batch_first: bool, bias: bool = True, **call: Any) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm = torch.nn.LayerNorm(d)
        self.attn = torch.nn.MultiheadAttention(d, heads, bias=bias, batch_first=batch_first)
        self.call = {"need_weights": False} | call

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        y = self.norm(x)
        return x + self.attn(y, y, y, key_padding_mask=mask, **self.call)[0]


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("d,heads", [(64, 2), (192, 3), (40, 4)])  # head sizes 32, 64, 10
@pytest.mark.parametrize("shape", [(1, 1), (2, 33), (3, 16)])
@pytest.mark.parametrize("n", [1, 2])
def test_fast_modes_multihead_attention_runs_its_attention_kernel(batch_first, bias, d, heads, shape, n, threads):
    """Fast mode: nn.MultiheadAttention's self-attention with heads of a multiple of 32 is the
    projection (its bias in the GEMM) and fast mode's attention kernel on its output in place,
    either order of batch and tokens, odd head counts too; other heads keep the module's call.
    Within the contract at scales 1e-3 to 1e3, with grad mode on or off."""
    from braze.ir import Op

    threads(n)
    model = _SelfAttention(d, heads, batch_first, bias).eval().requires_grad_(False)
    for scale in (1e-3, 1.0, 1e3):
        x = torch.randn(*shape, d) * scale
        with torch.set_grad_enabled(scale == 1.0):
            assert braze.check_accuracy(model, x, mode="fast").ok
    compiled = braze.compile(model, mode="fast")
    compiled(x)
    (prog,) = compiled.programs()
    ops, native = [node.op for node in prog.graph.nodes], d // heads % 32 == 0
    assert [label for label, _ in prog.externs] == (
        [] if native else ["attn (MultiheadAttention)", "_operator.getitem"]
    )
    assert (ops.count(Op.ATTENTION), ops.count(Op.GEMM)) == ((1, 2) if native else (0, 0))


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("d,heads", [(64, 2), (192, 2), (40, 4), (60, 3)])  # odd heads: eager's other path
@pytest.mark.parametrize("shape", [(1, 1), (2, 33), (3, 16)])
@pytest.mark.parametrize("n", [1, 2])
def test_exact_modes_multihead_attention_is_eagers_fused_kernel(batch_first, d, heads, shape, n, threads):
    """Exact mode: where eager's nn.MultiheadAttention calls its fused kernel (batch first, an even
    number of heads, ...), the kernel's ops in its order, bit for bit, under no_grad or with no
    weight requiring grad; elsewhere the module's call."""
    threads(n)
    model = _SelfAttention(d, heads, batch_first).eval()
    # the module's call and [0] of it; or ATen's two bmm of one token
    externs = 0 if batch_first and heads % 2 == 0 and shape[1] > 1 else 2
    with torch.no_grad():
        check_model(model, (torch.randn(*shape, d),), externs=externs)
    model.requires_grad_(False)
    check_model(model, (torch.randn(*shape, d) * 1e3,), externs=externs)


def test_exact_modes_multihead_attention_follows_eagers_choice_when_it_changes():
    """torch.backends.mha's switch and the module's attributes decide eager's path at each call:
    a program for one path is not run on the other (the entry watches both; compiled again)."""
    model = _SelfAttention(64, 2, True).eval()
    x = torch.randn(2, 9, 64)
    compiled = braze.compile(model)

    def native() -> bool:
        return not compiled.programs()[-1].externs

    with torch.no_grad():
        check_model(model, (x,), compiled=compiled)
        assert native()
        torch.backends.mha.set_fastpath_enabled(False)
        try:
            check_model(model, (x,), compiled=compiled)  # F.multi_head_attention_forward's bits
            assert not native()
        finally:
            torch.backends.mha.set_fastpath_enabled(True)
        check_model(model, (x,), compiled=compiled)
        assert native()
        model.attn.batch_first = False
        check_model(model, (x.transpose(0, 1).contiguous(),), compiled=compiled)
        assert not native()


@pytest.mark.parametrize("weights,masked", [(True, False), (False, True)])
def test_other_multihead_attention_keeps_the_modules_call(weights, masked):
    model = _SelfAttention(64, 2, True, need_weights=weights).eval()
    x, mask = torch.randn(2, 9, 64), torch.zeros(2, 9, dtype=torch.bool)
    mask[1, 5:] = True
    args = (x, mask) if masked else (x,)
    with torch.no_grad():
        assert braze.check_accuracy(model, *args, mode="fast").ok
        compiled = braze.compile(model, mode="fast")
        compiled(*args)
        check_model(model, args)  # exact mode: the module's call, eager's bits
    (prog,) = compiled.programs()
    assert ("attn (MultiheadAttention)", "nn.MultiheadAttention with a mask, or returning its weights") in prog.externs


def test_fast_modes_multihead_attention_sees_its_weights_change():
    model = _SelfAttention(64, 2, True).eval()
    x = torch.randn(2, 9, 64)
    compiled = braze.compile(model, mode="fast")
    with torch.no_grad():
        before = compiled(x)
        model.attn.in_proj_weight.mul_(-0.5)  # in place: the packed weight is packed again
        model.attn.out_proj.weight = torch.nn.Parameter(model.attn.out_proj.weight * 2)  # replaced
        after = compiled(x)
        assert not torch.allclose(before, after)
        assert braze.check_accuracy(model, x, mode="fast").ok
        torch.testing.assert_close(after, model(x), rtol=1e-5, atol=1e-5)


def test_exact_modes_multihead_attention_without_dict_versions_keeps_the_modules_call(monkeypatch):
    """Where CPython's dictionaries carry no version tag, the entry could not see eager's choice
    change: the module's call stays."""
    from braze import jit

    monkeypatch.setattr(jit, "dict_version", lambda d: None)
    model = _SelfAttention(64, 2, True).eval()
    with torch.no_grad():
        check_model(model, (torch.randn(2, 9, 64),), externs=2)
