"""Row kernels (braze/rows.py) against eager, bit for bit: row lengths around every boundary of
ATen's vector body, Welford chunks and cascade, special values, layouts, threads, probes."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import braze
from braze import rows

from .helpers import check_model, probe_with
from .test_ops import special

# Row lengths: ATen's 8-lane body and scalar tail, 16-vector chunks, the cascade of chunks.
LENGTHS = [1, 7, 8, 15, 16, 17, 31, 32, 33, 127, 128, 129, 257, 2049, 32769]


def layer_norm(n: int, affine: bool = True) -> torch.nn.Module:
    torch.manual_seed(n)
    m = torch.nn.LayerNorm(n, elementwise_affine=affine).eval()
    if affine:
        with torch.no_grad():
            m.weight.normal_()
            m.bias.normal_()
    return m


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("n_threads", [1, 2])
def test_layer_norm_is_native_and_exact(n, n_threads, threads):
    threads(n_threads)
    rows_ = 3 if n < 4096 else 2
    x = special(rows_, n) * torch.logspace(-2, 2, rows_).unsqueeze(1)
    x[-1] = torch.randn(n) * 1e3 + 5e3  # a large mean: where a naive variance loses its bits
    check_model(layer_norm(n), (x,), kernels=1, externs=0)


def test_layer_norm_functional_forms_and_many_rows(threads):
    threads(2)
    w, b = torch.randn(6, 48), torch.randn(6, 48)
    x = torch.randn(300, 6, 48)  # 86k elements: the rows are split between threads
    check_model(lambda t: F.layer_norm(t, (6, 48), w, b, 1e-12), (x,), kernels=1, externs=0)
    check_model(lambda t: torch.layer_norm(t, [48], w[0], b[0]), (x,), kernels=1, externs=0)


def test_layer_norm_of_strided_and_zero_size_inputs():
    m = layer_norm(33)
    check_model(m, (torch.randn(33, 5).t(),), kernels=2, externs=0)  # a copy to contiguous, as ATen
    check_model(m, (torch.randn(4, 66)[:, ::2],), kernels=2, externs=0)
    check_model(m, (torch.randn(0, 33),), externs=0)


def test_layer_norm_with_its_neighbours():
    torch.manual_seed(0)
    lin, norm = torch.nn.Linear(64, 64), layer_norm(64)

    def block(x, residual):
        return norm(torch.relu(lin(x)) + residual)

    check_model(block, (torch.randn(9, 64), torch.randn(9, 64)), externs=0)


def test_layer_norm_without_weight_or_bias_stays_an_aten_call_and_says_why():
    m = layer_norm(17, affine=False)
    x = torch.randn(4, 17)
    compiled = check_model(m, (x,), externs=1)
    assert "without both weight and bias" in compiled.programs()[0].externs[0][1]


def test_layer_norm_of_many_batch_sizes_is_one_generic_program():
    m = layer_norm(40)
    compiled = braze.compile(m)
    for batch in (3, 5, 1, 17, 64):
        check_model(m, (torch.randn(batch, 7, 40),), compiled=compiled, externs=0)
    assert len(compiled.compilations) <= 3, [c.why for c in compiled.compilations]


def test_layer_norm_falls_back_to_aten_when_its_probe_disagrees(monkeypatch):
    monkeypatch.setattr(rows, "layer_norm_same", lambda: False)
    compiled = check_model(layer_norm(16), (torch.randn(4, 16),), externs=1)
    assert "probe" in compiled.programs()[0].externs[0][1]


def test_the_probe_sees_a_kernel_that_is_one_rounding_off(monkeypatch):
    # The probe must be able to fail: a kernel whose variance is off by one ulp in one row.
    real = rows.layer_norm_rows

    def off(x, w, b, eps):
        y = real(x, w, b, eps)
        y.view(-1)[-1] = torch.nextafter(y.view(-1)[-1], torch.tensor(float("inf")))
        return y

    assert not probe_with(monkeypatch, rows, "layer_norm_rows", off, rows.layer_norm_same, rows._layer_norm_same)
    assert rows.layer_norm_same()


SOFTMAX_LENGTHS = [1, 7, 15, 16, 17, 31, 32, 33, 257, 32769]


SOFTMAXES = {
    "softmax": (torch.softmax, F.softmax, torch.nn.Softmax),
    "log_softmax": (torch.log_softmax, F.log_softmax, torch.nn.LogSoftmax),
}


@pytest.mark.parametrize("kind", SOFTMAXES)
@pytest.mark.parametrize("n", SOFTMAX_LENGTHS)
@pytest.mark.parametrize("n_threads", [1, 2])
def test_softmax_is_native_and_exact(kind, n, n_threads, threads):
    threads(n_threads)
    x = special(3, n) * torch.tensor([[0.1], [10.0], [1e3]])
    op = SOFTMAXES[kind][0]
    check_model(lambda t: op(t, -1), (x,), kernels=1, externs=0)


@pytest.mark.parametrize("kind", SOFTMAXES)
def test_softmax_forms_layouts_and_special_rows(kind):
    op, functional, module = SOFTMAXES[kind]
    inf, nan = float("inf"), float("nan")
    rows_ = torch.tensor([[1.0, nan, 2.0], [inf, 1.0, 0.0], [-inf, -inf, -inf], [-0.0, 0.0, -0.0]]).repeat(2, 11)
    check_model(lambda t: functional(t, dim=-1), (rows_,), kernels=1, externs=0)
    check_model(module(dim=2), (torch.randn(2, 3, 40),), kernels=1, externs=0)
    method = getattr(torch.Tensor, kind)
    check_model(lambda t: method(t, -1), (torch.randn(40, 6).t(),), kernels=2, externs=0)  # copied first, as ATen
    check_model(lambda t: op(t, -1), (torch.randn(0, 9),), externs=0)
    compiled = check_model(lambda t: op(t, 0), (torch.randn(5, 9),), externs=1)
    assert "other than the last" in compiled.programs()[0].externs[0][1]


def test_attention_written_by_hand_is_native_for_every_sequence_length():
    def attention(q, k, v, mask):
        scores = q @ k.transpose(-1, -2) * 0.125 + mask
        return torch.softmax(scores, -1) @ v

    compiled = braze.compile(attention)
    for s in (9, 12, 31, 64):
        q, k, v = (torch.randn(8, s, 16) for _ in range(3))  # batch x heads folded, as bmm takes them
        mask = torch.zeros(s, s).masked_fill(torch.ones(s, s).triu(1).bool(), -float("inf"))
        check_model(attention, (q, k, v, mask), compiled=compiled, externs=0)
    assert len(compiled.compilations) <= 3, [c.why for c in compiled.compilations]


def test_softmax_falls_back_to_aten_when_its_probe_disagrees(monkeypatch):
    monkeypatch.setattr(rows, "softmax_same", lambda log: False)
    compiled = check_model(lambda t: torch.softmax(t, -1), (torch.randn(4, 16),), externs=1)
    assert "probe" in compiled.programs()[0].externs[0][1]


def test_the_softmax_probe_sees_a_sum_in_another_order(monkeypatch):
    def in_order(x, log):  # a plain sequential sum: what a kernel without ATen's lanes gives
        e = torch.exp(x - x.amax(-1, keepdim=True))
        return e * (1 / e.double().cumsum(-1)[..., -1:].float())

    probe = lambda: rows.softmax_same(False)  # noqa: E731
    assert not probe_with(monkeypatch, rows, "softmax_rows", in_order, probe, rows._softmax_same)


SUM_LENGTHS = [1, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 257, 2049, 32769]


@pytest.mark.parametrize("mean", [False, True], ids=["sum", "mean"])
@pytest.mark.parametrize("n", SUM_LENGTHS)
@pytest.mark.parametrize("n_threads", [1, 2])
def test_sum_and_mean_of_rows_are_native_and_exact(mean, n, n_threads, threads):
    threads(n_threads)
    x = special(3, n) * torch.tensor([[0.1], [1.0], [1e3]]) + torch.tensor([[0.0], [3.0], [0.0]])
    op = torch.mean if mean else torch.sum
    check_model(lambda t: op(t, -1), (x,), kernels=1, externs=0)
    check_model(lambda t: op(t, dim=(-1,), keepdim=True) * 2, (x,), externs=0)


def test_sum_over_the_last_dimension_of_many_rows_and_what_stays_aten(threads):
    threads(2)
    check_model(lambda t: t.sum(-1), (torch.randn(300, 7, 40),), kernels=1, externs=0)  # rows split
    check_model(lambda t: t.mean(-1), (torch.randn(0, 9),), externs=0)
    for n in (32768, 40000, 100003):  # one long row, which ATen sums in two passes over threads
        check_model(lambda t: t.sum(-1), (torch.randn(n) * 1e3 + 1,), kernels=1, externs=0)
    for f, x in (
        (lambda t: t.sum(0), torch.randn(5, 9)),  # another dimension: ATen's outer sum
        (lambda t: t.sum((0, 2)), torch.randn(5, 9, 3)),
        (lambda t: t.t().sum(-1), torch.randn(9, 5)),  # a strided row
        (lambda t: t.sum(-1, dtype=torch.float64), torch.randn(3, 9)),
    ):
        check_model(f, (x,), externs=1)


@pytest.mark.parametrize("n_threads", [1, 2])
def test_sums_over_the_last_dimensions_or_all_are_sums_of_merged_rows(n_threads, threads):
    # ATen's reduction merges the reduced dimensions of a contiguous input into one row
    threads(n_threads)
    cases = [
        (lambda t: t.mean((2, 3), keepdim=True), special(8, 33, 15, 17)),  # global average pooling
        (lambda t: t.mean((-1, -2)), special(2, 3, 7, 9) * 1e3),
        (lambda t: t.sum((1, 2)), special(3, 7, 11)),
        (lambda t: t.sum(), special(5, 40000) + 1),  # one long row: two passes over threads
        (lambda t: t.mean(), special(70001) * 1e3),
        (lambda t: torch.sum(t, dim=None), special(3, 4, 5)),
        (lambda t: t.sum(dim=(0, 1, 2), keepdim=True), special(3, 1, 33)),
    ]
    for f, x in cases:
        check_model(f, (x,), kernels=1, externs=0)


def test_sum_falls_back_to_aten_when_its_probe_disagrees(monkeypatch):
    monkeypatch.setattr(rows, "sum_same", lambda: False)
    compiled = check_model(lambda t: t.mean(-1), (torch.randn(4, 16),), externs=1)
    assert "probe" in compiled.programs()[0].externs[0][1]


def test_the_sum_probe_sees_a_plain_running_sum(monkeypatch):
    def running(x, mean=False):
        s = x.double().cumsum(-1)[..., -1].float()  # another order than ATen's cascade
        return s / x.shape[-1] if mean else s

    assert not probe_with(monkeypatch, rows, "sum_rows", running, rows.sum_same, rows._sum_same)


def test_first_calls_on_two_threads_build_the_kernels_once():
    # A fresh process: the kernels are built by whichever first call gets there, once.
    script = textwrap.dedent(
        """
        import threading, torch, braze
        from braze import jit, rows
        built = []
        real = jit.compile_module
        jit.compile_module = lambda text, *a, **k: (built.append(text.split('"')[1]), real(text, *a, **k))[1]
        models = [torch.nn.Sequential(torch.nn.LayerNorm(16), torch.nn.Softmax(-1)).eval() for _ in range(2)]
        x, same = torch.randn(4, 16), []
        def run(m):
            with torch.no_grad():
                same.append(torch.equal(braze.compile(m)(x), m(x)))
        threads = [threading.Thread(target=run, args=(m,)) for m in models]
        [t.start() for t in threads]
        [t.join() for t in threads]
        print(same == [True, True], built.count(rows.LAYER_NORM), built.count(rows.SOFTMAX))
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "1", "1"]


def test_kernels_written_for_avx512_stay_aten_calls_on_other_cpus(monkeypatch):
    # On an AVX2 machine ATen runs 8-lane kernels, and Sleef's 16-lane functions cannot run.
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    compiled = check_model(lambda t: torch.softmax(torch.sigmoid(t), -1), (torch.randn(4, 16),), externs=2)
    assert all("AVX2" in why for _, why in compiled.programs()[0].externs)
