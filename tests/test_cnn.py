"""Convolutional-net layers vs eager, bit for bit: eval BatchNorm (an FMA per element), max_pool2d
(pool.py's kernel), adaptive_avg_pool2d to 1 x 1 (a mean), and a small CNN with all of them."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import braze
from braze import jit, pool
from braze.ir import Op

from .helpers import assert_same, check_model, needs_mkl_order, probe_with
from .test_ops import special

nn = torch.nn


def _bn(kind: type, c: int, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    bn = kind(c).eval()
    with torch.no_grad():
        bn.running_mean.normal_()
        bn.running_var.uniform_(0.0, 3.0)
        bn.weight.normal_()
        bn.bias.normal_()
    return bn


def _same_bits(compiled, fn, x) -> None:
    # check_model's values compare -0.0 equal to 0.0; an FMA placed elsewhere changes signs of zeros
    with torch.no_grad():
        assert jit.same_bits(compiled(x), fn(x), nan_payloads=False)


@pytest.mark.parametrize(
    "kind,shape",
    [
        (nn.BatchNorm1d, (7, 33)),
        (nn.BatchNorm1d, (3, 17, 15)),
        (nn.BatchNorm2d, (1, 1, 1, 1)),
        (nn.BatchNorm2d, (2, 16, 7, 9)),
        (nn.BatchNorm2d, (3, 17, 33, 17)),
        (nn.BatchNorm2d, (0, 5, 3, 3)),
        (nn.BatchNorm3d, (2, 7, 3, 4, 5)),
    ],
    ids=str,
)
def test_eval_batch_norm_is_one_native_kernel_with_atens_bits(kind, shape):
    bn = _bn(kind, shape[1])
    x = special(*shape) * 10
    compiled = check_model(bn, (x,), externs=0)
    _same_bits(compiled, bn, x)
    relu = nn.Sequential(bn, nn.ReLU())  # the per-element FMA and the ReLU: one loop
    check_model(relu, (x,), externs=0, kernels=compiled.programs()[0].kernel_count)


def test_batch_norm_channel_terms_with_special_values():
    bn = _bn(nn.BatchNorm2d, 6)
    with torch.no_grad():  # zero variance, negative variance (NaN), zero and infinite weights
        bn.running_var[:3] = torch.tensor([0.0, -1.0, 1e-30])
        bn.weight[3:] = torch.tensor([0.0, float("inf"), -0.0])
    x = special(2, 6, 5, 7)
    _same_bits(check_model(bn, (x,), externs=0), bn, x)


@pytest.mark.parametrize("n", [1, 2])
def test_batch_norm_across_threads_and_the_functional_form(n, threads):
    threads(n)
    bn = _bn(nn.BatchNorm2d, 32)
    x = torch.randn(8, 32, 64, 64)
    _same_bits(check_model(bn, (x,), externs=0), bn, x)

    def functional(t):
        return F.batch_norm(t, bn.running_mean, bn.running_var, bn.weight, bn.bias, False, 0.1, 1e-3)

    check_model(functional, (x,), externs=0)


@torch.no_grad()
def test_batch_norm_reads_its_buffers_and_mode_at_each_call():
    bn = _bn(nn.BatchNorm2d, 5)
    x = torch.randn(4, 5, 6, 6)
    compiled = braze.compile(nn.Sequential(bn))
    compiled(x)
    assert not compiled.programs()[0].externs
    with torch.no_grad():
        bn.running_var.mul_(2.0)
        bn.weight.add_(1.0)
    assert torch.equal(compiled(x), bn(x))
    bn.train()  # batch statistics, and the running ones updated: eager's call
    mean = bn.running_mean.clone()
    want = F.batch_norm(x, mean.clone(), bn.running_var.clone(), bn.weight, bn.bias, True, 0.1, bn.eps)
    assert torch.equal(compiled(x), want)
    assert not torch.equal(bn.running_mean, mean)


@torch.no_grad()
def test_a_training_batch_norm_updates_its_statistics_once_a_call():
    # Lowering runs each ATen call on example tensors once: the module's running statistics,
    # which ATen's kernel updates in place, are put back after it (they were updated twice).
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).train()
    twin = copy.deepcopy(model)
    compiled = braze.compile(model)
    x = torch.randn(2, 3, 8, 8)
    for _ in range(3):
        assert torch.equal(compiled(x), twin(x))
    for name, buffer in model[1].named_buffers():
        assert torch.equal(buffer, twin[1].get_buffer(name)), name


def test_batch_norm_braze_cannot_match_stays_atens_call():
    bn = _bn(nn.BatchNorm2d, 5)
    x = torch.randn(2, 5, 6, 6)
    compiled = check_model(bn, (x.to(memory_format=torch.channels_last),), externs=1)
    assert "channels-last" in compiled.programs()[0].externs[0][1]
    no_affine = nn.BatchNorm2d(5, affine=False).eval()
    check_model(no_affine, (x,), externs=1)
    check_model(nn.BatchNorm2d(5, track_running_stats=False).eval(), (x,), externs=1)


def test_batch_norm_falls_back_to_aten_when_its_probe_disagrees(monkeypatch):
    monkeypatch.setattr(jit, "batch_norm_same", lambda: False)
    compiled = check_model(nn.Sequential(_bn(nn.BatchNorm2d, 5)), (torch.randn(2, 5, 6, 6),), externs=1)
    assert "probe" in compiled.programs()[0].externs[0][1]


def test_the_batch_norm_probe_sees_products_rounded_apart(monkeypatch):
    def unfused(x, mean, var, weight, bias, *rest):  # what a build without FMA computes
        alpha = 1 / torch.sqrt(var + 1e-5) * weight
        shape = (-1,) + (1,) * (x.dim() - 2)
        return x * alpha.view(shape) + (bias - mean * alpha).view(shape)

    assert not probe_with(monkeypatch, F, "batch_norm", unfused, jit.batch_norm_same, jit._batch_norm_same)
    assert jit.batch_norm_same()


WINDOWS = [
    dict(kernel_size=2),
    dict(kernel_size=3, stride=2, padding=1),
    dict(kernel_size=3, stride=1, padding=1, dilation=2),
    dict(kernel_size=(2, 3), stride=(1, 2), padding=(1, 0), ceil_mode=True),
    dict(kernel_size=3, stride=2, ceil_mode=True),
    dict(kernel_size=1),
]


@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize(
    "shape, layout",
    [(s, "planes") for s in [(1, 1, 1, 1), (2, 3, 7, 9), (3, 17, 33, 16), (5, 15, 15)]]
    + [(s, "pixels") for s in [(2, 3, 7, 9), (3, 17, 33, 16), (1, 40, 5, 4)]],
    ids=str,
)
def test_max_pool2d_is_native_with_atens_bits(window, shape, layout):
    if window["kernel_size"] != 1 and min(shape[-2:]) < 3:
        pytest.skip("window larger than the image: eager raises (tested below)")
    x = special(*shape) * 3
    x.view(-1)[::5] = torch.round(x.view(-1)[::5])  # ties between equal values
    if layout == "pixels":
        x = x.contiguous(memory_format=torch.channels_last)
    fn = nn.MaxPool2d(**window)
    check_model(fn, (x,), kernels=1, externs=0)
    _same_bits(braze.compile(fn), fn, x)
    check_model(lambda t: F.max_pool2d(t.relu(), **window), (x,), kernels=2, externs=0)


@pytest.mark.parametrize("n", [1, 2])
def test_max_pool2d_splits_planes_between_threads(n, threads):
    threads(n)
    x = special(8, 64, 64, 64)
    check_model(nn.MaxPool2d(2), (x,), kernels=1, externs=0)
    check_model(nn.MaxPool2d(3, 2, 1), (special(1, 3, 97, 101),), kernels=1, externs=0)
    check_model(nn.MaxPool2d(2), (x.contiguous(memory_format=torch.channels_last),), kernels=1, externs=0)


def test_max_pool2d_cases_braze_leaves_to_aten():
    x = special(2, 3, 8, 8)
    check_model(lambda t: F.max_pool2d(t, 2, return_indices=True), (x,), externs=1)
    check_model(nn.MaxPool2d(2), (x.transpose(-1, -2),), externs=1)
    check_model(nn.MaxPool2d(2), (x.to(memory_format=torch.channels_last).transpose(-1, -2),), externs=1)
    check_model(nn.MaxPool2d(2), (torch.randn(0, 3, 8, 8),), externs=1)  # empty result
    with pytest.raises(RuntimeError):
        braze.compile(nn.MaxPool2d(3))(torch.randn(1, 1, 2, 2))


def test_max_pool2d_falls_back_to_aten_when_its_probe_disagrees(monkeypatch):
    monkeypatch.setattr(pool, "max_pool_same", lambda: False)
    compiled = check_model(nn.MaxPool2d(2), (special(2, 3, 8, 8),), externs=1)
    assert "probe" in compiled.programs()[0].externs[0][1]


@pytest.mark.parametrize("kernel", ["max_pool2d_planes", "max_pool2d_pixels"])
def test_the_max_pool_probe_can_fail(monkeypatch, kernel):
    real = getattr(pool, kernel)
    wrong = lambda *a: real(*a).nan_to_num()  # noqa: E731  NaN not propagated
    assert not probe_with(monkeypatch, pool, kernel, wrong, pool.max_pool_same, pool._max_pool_same)
    assert pool.max_pool_same()


@pytest.mark.parametrize("shape", [(8, 128, 16, 16), (2, 3, 7, 9), (1, 5, 200, 200), (3, 1, 1), (0, 4, 3, 3)], ids=str)
def test_global_average_pool_is_atens_mean(shape):
    x = special(*shape) * 5 + 1
    check_model(nn.AdaptiveAvgPool2d(1), (x,), externs=0)
    check_model(lambda t: F.adaptive_avg_pool2d(t, (1, 1)).flatten(1), (x,), externs=0)
    check_model(nn.AdaptiveAvgPool2d(2), (special(2, 3, 7, 9),), externs=1)  # windows: ATen's kernel


@pytest.mark.parametrize("layer", [True, False], ids=["layer", "functional"])
def test_a_global_average_pool_braze_cannot_match_is_called_from_native_code(layer):
    # a channels-last input's mean takes ATen's other loops: ATen's pooling, called from the
    # native body (ConvNeXt's head: the program stays native, its convolutions too)
    x = special(2, 8, 7, 9).contiguous(memory_format=torch.channels_last) * 5 + 1
    model = nn.Sequential(nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3)).eval()
    functional = lambda t: F.adaptive_avg_pool2d(t.relu(), 1) * 2  # noqa: E731
    compiled = check_model(model if layer else functional, (x,), externs=1)
    prog = compiled.programs()[-1]
    assert prog.native and [label for label, _ in prog.externs] == ["adaptive_avg_pool2d (ATen's)"]


_ATEN_FROM_NATIVE = {  # layers and calls braze has no kernel for: ATen's op, called from the native body
    "avg_pool2d layer": (nn.AvgPool2d(3, 1, 1, count_include_pad=False), "avg_pool2d (ATen's)"),
    "avg_pool2d": (lambda t: F.avg_pool2d(t, 2, ceil_mode=True), "torch._C._nn.avg_pool2d"),
    "group_norm layer": (nn.GroupNorm(2, 8), "group_norm (ATen's)"),
    "group_norm, no affine": (nn.GroupNorm(4, 8, affine=False), "group_norm (ATen's)"),
    "group_norm": (lambda t: F.group_norm(t, 4, eps=1e-3), "F.group_norm"),
    "adaptive pool to 2 x 3": (nn.AdaptiveAvgPool2d((2, 3)), "adaptive_avg_pool2d (ATen's)"),
}


@pytest.mark.parametrize("case", list(_ATEN_FROM_NATIVE))
@pytest.mark.parametrize("shape", [(2, 8, 11, 13), (1, 8, 1, 7)], ids=str)
def test_pools_and_norms_braze_has_no_kernel_for_are_called_from_native_code(case, shape):
    op, label = _ATEN_FROM_NATIVE[case]
    # (a fresh output after it: the body can be native)
    model = nn.Sequential(nn.ReLU(), op, nn.ReLU()) if isinstance(op, nn.Module) else lambda t: op(t.relu()) * 2
    compiled = check_model(model, (special(*shape),), externs=1)
    prog = compiled.programs()[-1]
    assert prog.native and [name for name, _ in prog.externs] == [label]


@pytest.mark.parametrize("channels", [7, 8])
@torch.no_grad()
def test_a_group_norm_eager_refuses_raises_eagers_error(channels):
    layer = nn.GroupNorm(2, 6)  # its weight has 6 channels
    model = nn.Sequential(nn.ReLU(), layer, nn.ReLU())
    x = torch.randn(2, channels, 4, 4)
    with pytest.raises(RuntimeError) as eager:
        model(x)
    compiled = braze.compile(model)
    compiled(torch.randn(2, 6, 4, 4))  # compiled for 6 channels; then a call eager refuses
    with pytest.raises(RuntimeError) as ours:
        compiled(x)
    assert str(ours.value) == str(eager.value)


def stochastic_depth(x: torch.Tensor, p: float, mode: str, training: bool = True) -> torch.Tensor:
    """torchvision.ops.stochastic_depth as torchvision defines it (its input in eval), under its
    name: the lowering registry finds torchvision's function by name (braze does not import it)."""
    if not training or p == 0.0:
        return x
    keep = torch.empty([x.shape[0]] + [1] * (x.dim() - 1)).bernoulli_(1.0 - p)
    return x * keep.div_(1.0 - p)


stochastic_depth.__module__, stochastic_depth.__qualname__ = "torchvision.ops.stochastic_depth", "stochastic_depth"
torch.fx.wrap("stochastic_depth")  # as torchvision wraps it: a call in the traced graph


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        return x + stochastic_depth(self.conv(x), 0.2, "row", self.training)


@pytest.mark.parametrize("training", [False, True])
def test_stochastic_depth_in_eval_is_its_input(training):
    model = _Residual().train(training)
    x = torch.randn(2, 4, 9, 9)
    with torch.no_grad():
        torch.manual_seed(0)
        want = model(x)
        compiled = braze.compile(model)
        torch.manual_seed(0)
        assert_same(compiled(x), want)
    labels = [label for label, _ in compiled.programs()[-1].externs]
    assert labels == ["torch.conv2d (a Conv2d layer's)"] + (
        [stochastic_depth.__module__ + ".stochastic_depth"] if training else []
    )


def _small_cnn() -> nn.Module:
    torch.manual_seed(0)

    def block(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1), _bn(nn.BatchNorm2d, cout, cout), nn.ReLU()]

    layers = block(3, 16) + [nn.MaxPool2d(2)] + block(16, 32) + [nn.MaxPool2d(2)]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10)).eval()


def test_a_small_cnn_runs_natively_but_its_convolutions():
    model = _small_cnn()
    for batch in (1, 3):
        compiled = check_model(model, (torch.randn(batch, 3, 33, 31),), externs=2)
        assert all("Conv2d" in label for label, _ in compiled.programs()[-1].externs)


class _Branching(nn.Module):  # a branch on a value: torch.fx cannot trace it, TorchDynamo can
    def __init__(self) -> None:
        super().__init__()
        self.cnn = _small_cnn()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.cnn(x)
        return y if y.sum() > 0 else -y


def test_a_small_cnn_through_torchdynamo():
    model = _Branching().eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        compiled = check_model(model, (x,))
    externs = [label for program in compiled.programs() for label, _ in program.externs]
    assert externs == ["torch.conv2d", "torch.conv2d"]  # batch_norm, max_pool2d, the means: native


@pytest.mark.parametrize("threads", [1, 2])
def test_convolutions_are_atens_calls_made_from_the_native_body(threads):
    model, before = _small_cnn(), torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for batch in (1, 3):
            x = torch.randn(batch, 3, 33, 31)
            compiled = check_model(model, (x,), externs=2)
            check_model(model, (x,), compiled=compiled)  # the entry's call
            prog = compiled.programs()[-1]
            assert prog.native and all(why.endswith("called from native code") for _, why in prog.externs)
        strided = lambda x, w: F.relu(F.conv2d(x, w, stride=2, padding=1))  # noqa: E731  (ints given once)
        compiled = check_model(strided, (torch.randn(2, 3, 9, 9), torch.randn(4, 3, 3, 3)), externs=1)
        assert compiled.programs()[-1].native
    finally:
        torch.set_num_threads(before)


class _OwnForward(nn.Conv2d):
    def forward(self, x):
        return super().forward(x) * 2


@pytest.mark.parametrize("change", ["hook", "padding by name", "own forward", "reflect padding", "parametrized"])
def test_a_conv2d_layer_whose_call_is_more_than_its_convolution_stays_a_call_of_the_layer(change):
    conv = {"own forward": _OwnForward, "padding by name": lambda *a: nn.Conv2d(*a, padding="same")}.get(
        change, nn.Conv2d
    )(3, 4, 3)
    calls = []
    if change == "hook":
        conv.register_forward_hook(lambda *_: calls.append(1))
    if change == "reflect padding":
        conv.padding, conv.padding_mode = (1, 1), "reflect"
    if change == "parametrized":
        torch.nn.utils.parametrize.register_parametrization(conv, "weight", _Doubled())
    model, x = nn.Sequential(conv, nn.ReLU()).eval(), torch.randn(2, 3, 8, 8)
    compiled = check_model(model, (x,), externs=1)
    ((label, _),) = compiled.programs()[-1].externs
    # (a subclass of its own is traced through: its convolution is a call of torch.conv2d)
    assert label.endswith("Conv2d)") or change == "own forward", label  # the layer, called
    calls.clear()
    check_model(model, (x,), compiled=compiled)
    assert calls == ([1, 1] if change == "hook" else [])  # eager's call, then the program's


class _Doubled(nn.Module):
    def forward(self, w):
        return w * 2


def test_a_convolution_reads_its_layers_weights_as_they_are_at_each_call():
    model = _small_cnn()
    x = torch.randn(2, 3, 16, 16)
    compiled = check_model(model, (x,))
    with torch.no_grad():
        model[0].weight.data.mul_(2)  # in place, outside autograd's version counter
        check_model(model, (x,), compiled=compiled)
        model[4].weight = nn.Parameter(torch.randn_like(model[4].weight))  # replaced
        model[4].bias = None
        check_model(model, (x,), compiled=compiled)


def _same_bits_across_settings(compiled, model, x, threads) -> None:
    """Eager's bits as compiled, at the other thread count (another path, another order: compiled
    again), with oneDNN off (ATen's own kernels), and with it on again (the last program was
    compiled with it off: its entry must refuse the call)."""
    _same_bits(compiled, model, x)
    threads(3 - torch.get_num_threads())
    _same_bits(compiled, model, x)
    with torch.backends.mkldnn.flags(enabled=False):
        _same_bits(compiled, model, x)
    _same_bits(compiled, model, x)


# (in, out channels, height, width, batch, channels-last): K in one block, in MKL's, in oneDNN's
# blocks of 80 and 256, odd sizes; NCHW images alone and in batches, channels-last pixels
POINTWISE = [
    (640, 160, 14, 14, 3, False),
    (17, 33, 9, 11, 2, False),
    (48, 12, 1, 1, 2, False),  # squeeze-excite's: one column per image
    (48, 12, 1, 1, 1, False),
    (33, 17, 1, 3, 2, False),
    (40, 160, 56, 56, 1, False),
    (640, 160, 14, 14, 1, False),
    (1280, 320, 7, 7, 1, False),
    (320, 1280, 7, 7, 1, False),
    (17, 33, 9, 11, 1, False),
    (7, 16, 15, 17, 1, False),
    (160, 40, 28, 28, 1, True),
    (320, 96, 7, 7, 3, True),
    (33, 17, 15, 16, 2, True),
]


@pytest.mark.parametrize("count", [1, 2])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", POINTWISE, ids=str)
def test_a_1x1_convolution_is_a_native_gemm_in_the_order_of_atens_path(shape, bias, count, threads):
    """Exact mode: a 1 x 1 convolution is braze's GEMM kernel in the order ATen's path takes at
    that shape and thread count (MKL's, or one of oneDNN's a probe found), the GELU after an
    NCHW one its epilogue (channels-last: a loop of its own, as the product's rows are pixels
    the epilogue reads permuted), no ATen call, eager's bits (special values; signed zeros)."""
    cin, cout, h, w, n, last = shape
    if not last and n == 1 and count == 1:
        needs_mkl_order()  # (ATen's slow_conv2d: MKL's sgemm_ per image)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(cin, cout, 1, bias=bias), nn.GELU()).eval()
    x = special(n, cin, h, w).contiguous(memory_format=torch.channels_last if last else torch.contiguous_format)
    threads(count)
    # (ATen's slow_conv2d of several images, on one thread: MKL's order per image, which braze
    # leaves to ATen where its probe finds none of its orders, as with a bias, or one column)
    mkls = not last and n > 1 and count == 1
    compiled = check_model(model, (x,), kernels=None if mkls else 2 if last else 1, externs=None if mkls else 0)
    _same_bits_across_settings(compiled, model, x, threads)


@torch.no_grad()
def test_a_1x1_convolution_as_mkls_product_is_compiled_again_on_another_thread_count(threads):
    """Found by a random-CNN fuzz: on one thread ATen's path for this one is MKL's sgemm_, which
    the program calls (MKL's own order); on two, oneDNN's, whose bits differ. The program's entry
    checks MKL's thread count (it ran MKL's product on two threads: 1 ulp off at 1e3)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(33, 17, 1)).eval()  # (a layer: its call is the one lowered)
    x = torch.randn(1, 33, 32, 33) * 1e3
    threads(1)
    compiled = braze.compile(model)
    for count in (1, 2, 1):
        threads(count)
        assert torch.equal(compiled(x), model(x))


def test_a_1x1_convolution_braze_has_no_order_for_stays_atens_call(monkeypatch):
    from braze import gemmkernel
    from braze.lowering import conv

    model = nn.Sequential(nn.Conv2d(33, 17, 1), nn.ReLU()).eval()
    x = torch.randn(2, 33, 9, 9).contiguous(memory_format=torch.channels_last)
    order = lambda: conv.pointwise_order(2, 17, 33, 9, 9, True, False)  # noqa: E731
    real = gemmkernel.gemm
    off = lambda *a, **k: real(*a, **k).nextafter(torch.tensor(float("inf")))  # noqa: E731  (an ulp off)
    assert order() is not None
    assert probe_with(monkeypatch, gemmkernel, "gemm", off, order, conv._pointwise_order) is None
    monkeypatch.setattr(conv, "pointwise_order", lambda *a: None)
    compiled = check_model(model, (x,), externs=1)
    ((label, why),) = compiled.programs()[-1].externs
    assert "Conv2d" in label and "probe found none" in why


@pytest.mark.parametrize("case", ["stride", "padding", "groups", "strided input", "1 input channel"])
def test_1x1_convolutions_braze_leaves_to_aten(case):
    kw = {"stride": {"stride": 2}, "padding": {"padding": 1}, "groups": {"groups": 2}}.get(case, {})
    cin = 1 if case == "1 input channel" else 4
    model = nn.Sequential(nn.Conv2d(cin, 8, 1, **kw), nn.ReLU()).eval()
    x = torch.randn(1, cin, 8, 16)
    check_model(model, (x[..., ::2] if case == "strided input" else x,), externs=1)


# (channels, height, width, kernel, stride, batch): ConvNeXt's, MobileNet's, odd sizes. (One
# channel, or a 1 x 1 image, which is NCHW too, takes another path of ATen's: the probe refuses it.)
DEPTHWISE = [
    (40, 56, 56, 7, 1, 1),
    (160, 14, 14, 7, 1, 1),
    (17, 15, 16, 3, 1, 2),
    (72, 28, 28, 5, 2, 1),
    (16, 9, 7, 3, 2, 3),
    (3, 5, 5, 3, 1, 1),
    (33, 3, 2, 3, 1, 1),
]


@pytest.mark.parametrize("count", [1, 2])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", DEPTHWISE, ids=str)
def test_a_depthwise_convolution_of_channels_last_pixels_is_native_in_atens_order(shape, bias, count, threads):
    """Exact mode: oneDNN's depthwise convolution of channels-last pixels sums each output's taps
    inside the image in order and adds the bias last: directconv's kernel so, no ATen call,
    eager's bits (special values, signed zeros), on other thread counts and with oneDNN off."""
    c, h, w, k, s, n = shape
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(c, c, k, stride=s, padding=k // 2, groups=c, bias=bias), nn.ReLU()).eval()
    x = special(n, c, h, w).contiguous(memory_format=torch.channels_last)
    threads(count)
    compiled = check_model(model, (x,), externs=0)
    _same_bits_across_settings(compiled, model, x, threads)


def test_depthwise_convolutions_braze_leaves_to_aten(monkeypatch):
    from braze import directconv
    from braze.lowering import conv

    model = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.ReLU()).eval()
    x = torch.randn(1, 8, 9, 9)
    compiled = check_model(model, (x,), externs=1)  # NCHW: ATen's call (see docs/limits.md)
    assert "channels-last" in compiled.programs()[-1].externs[0][1]
    x = x.contiguous(memory_format=torch.channels_last)
    same = lambda: conv.depthwise_same((1, 8, 9, 9), True, (3, 3), (1, 1), (1, 1))  # noqa: E731
    real = directconv.conv2d
    off = lambda *a, **k: real(*a, **k).nextafter(torch.tensor(float("inf")))  # noqa: E731  (an ulp off)
    assert same()
    assert not probe_with(monkeypatch, directconv, "conv2d", off, same, conv._depthwise_same)
    monkeypatch.setattr(conv, "depthwise_same", lambda *a: False)
    compiled = check_model(model, (x,), externs=1)
    assert "probe found another order" in compiled.programs()[-1].externs[0][1]


class _InvertedBottleneck(nn.Module):  # ConvNeXt's block after its depthwise convolution
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Conv2d(16, 64, 1), nn.Conv2d(64, 16, 1)
        self.gamma = nn.Parameter(torch.randn(16, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gamma * self.down(F.relu(self.up(x)))


@pytest.mark.parametrize("batch", [1, 3])
def test_a_channels_last_1x1_convolution_takes_what_follows_as_its_epilogue(batch):
    """The product of channels-last pixel rows seen as [N, C, H, W] lies where the rows do: what
    follows it elementwise (ReLU; the layer scale and residual) runs in the GEMM's epilogue."""
    torch.manual_seed(0)
    x = special(batch, 16, 9, 7).contiguous(memory_format=torch.channels_last)
    compiled = check_model(_InvertedBottleneck().eval(), (x,), kernels=2, externs=0)
    bodies = [[b.op.value for b in n.body] for n in compiled.programs()[-1].graph.nodes if n.op is Op.GEMM]
    assert bodies == [["relu"], ["mul", "add"]]
