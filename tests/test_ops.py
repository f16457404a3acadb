"""Each op against eager, bit for bit: odd sizes, broadcasting, strides, zero-size, NaN/inf/-0."""

from __future__ import annotations

import math
import operator
import re
import warnings

import pytest
import torch
import torch.nn.functional as F

import braze
from braze import jit, vml

from .helpers import assert_same, check_model

SIZES = [(1,), (7,), (33,), (257,), (7, 33), (0, 7), (3, 0, 5)]


def special(*shape: int) -> torch.Tensor:
    """Random values with NaN, +-inf, -0.0 and +0.0 sprinkled in."""
    t = torch.randn(*shape)
    flat = t.view(-1)
    for i, v in enumerate([float("nan"), float("inf"), -float("inf"), -0.0, 0.0]):
        if i < flat.numel():
            flat[(i * 7919) % flat.numel()] = v
    return t


# name, function, number of tensor inputs. Each must compile to exactly one native kernel.
NATIVE = [
    ("add", operator.add, 2),
    ("sub", operator.sub, 2),
    ("mul", operator.mul, 2),
    ("div", operator.truediv, 2),
    ("torch.add", torch.add, 2),
    ("maximum", torch.maximum, 2),
    ("minimum", torch.minimum, 2),
    ("add_scalar", lambda x: x + 0.1, 1),
    ("mul_int", lambda x: x * 3, 1),
    ("rsub", lambda x: 2.5 - x, 1),
    ("rdiv", lambda x: 3.0 / x, 1),
    ("div_scalar", lambda x: x / 7, 1),
    ("neg", operator.neg, 1),
    ("abs", torch.abs, 1),
    ("rsqrt", torch.rsqrt, 1),
    ("exp", torch.exp, 1),
    ("tanh", torch.tanh, 1),
    ("erf", torch.erf, 1),
    ("log", torch.log, 1),
    ("sin", torch.sin, 1),
    ("cos", torch.cos, 1),
    ("sqrt", torch.sqrt, 1),
    ("atan", torch.atan, 1),
    ("sigmoid", torch.sigmoid, 1),
    ("silu", F.silu, 1),
    ("gelu_tanh", lambda x: F.gelu(x, approximate="tanh"), 1),
    ("rsqrt_of_sum", lambda x: torch.rsqrt(x * x + 1e-6), 1),
    ("relu", torch.relu, 1),
    ("F.relu", F.relu, 1),
    ("leaky_relu", lambda x: F.leaky_relu(x, 0.2), 1),
    ("clamp", lambda x: torch.clamp(x, -0.5, 0.75), 1),
    ("clamp_min", lambda x: x.clamp(min=0.1), 1),
    ("clamp_max", lambda x: x.clamp(max=0.1), 1),
    ("clamp_min_method", lambda x: x.clamp_min(-0.2), 1),
    ("torch.clamp_max", lambda x: torch.clamp_max(x, 0.3), 1),
    ("pow2", lambda x: x**2, 1),
    ("pow3", lambda x: torch.pow(x, 3), 1),
    ("pow_minus1", lambda x: x**-1, 1),
    ("pow_minus2", lambda x: x.pow(-2.0), 1),
    ("square", torch.square, 1),
    ("reciprocal", torch.reciprocal, 1),
    ("hardtanh", F.hardtanh, 1),
    ("relu6", F.relu6, 1),
    ("hardsigmoid", F.hardsigmoid, 1),
    ("hardswish", torch.nn.Hardswish(), 1),
    ("threshold", lambda x: F.threshold(x, 0.25, -2.0), 1),
    ("prelu", torch.nn.PReLU(init=0.3), 1),
    ("lt", operator.lt, 2),
    ("le", torch.le, 2),
    ("gt", torch.gt, 2),
    ("ge", operator.ge, 2),
    ("eq", operator.eq, 2),
    ("ne", operator.ne, 2),
    ("le_scalar", lambda x: x <= 0.5, 1),
    ("scalar_lt", lambda x: 0 < x, 1),
    ("where", lambda x, y: torch.where(x > y, x, y), 2),
    ("where_scalar", lambda x: torch.where(x.isnan(), 0.0, x), 1),
]


@pytest.mark.parametrize("shape", SIZES, ids=str)
@pytest.mark.parametrize("name,fn,arity", NATIVE, ids=[r[0] for r in NATIVE])
def test_native_elementwise(name, fn, arity, shape):
    inputs = tuple(special(*shape) for _ in range(arity))
    numel = inputs[0].numel()
    check_model(fn, inputs, kernels=1 if numel and not name.startswith("where") else None)


def test_where_native_with_bool_input():
    x, y = special(7, 33), special(7, 33)
    cond = x > y
    check_model(lambda c, a, b: torch.where(c, a, b), (cond, x, y), kernels=1, externs=0)
    check_model(lambda c, a: a.masked_fill(c, -1.5) * 2, (cond, x), kernels=1, externs=0)
    check_model(lambda c, a: a.masked_fill(c[:1], 0.0), (cond, x), kernels=1, externs=0)  # broadcast mask
    check_model(lambda a, b: torch.where(a > b, a, b * 2), (x, y), kernels=1, externs=0)  # compare fused
    check_model(lambda a: a.masked_fill(a.t().t() > 0.5, 0.5), (x,), kernels=1, externs=0)
    check_model(lambda a, b: (a < b) | (a > 2), (x, y), kernels=2, externs=1)  # | on bools: ATen


def test_prelu_weights_lie_along_dimension_one():
    # ATen reshapes a weight of C values to (1, C, 1, ...); a single weight broadcasts anywhere.
    check_model(torch.nn.PReLU(33, init=0.1), (special(7, 33),), kernels=1, externs=0)
    check_model(torch.nn.PReLU(6), (special(2, 6, 5),), kernels=1, externs=0)
    check_model(torch.nn.PReLU(), (special(5),), kernels=1, externs=0)
    check_model(lambda x, w: F.prelu(x.t(), w), (special(6, 4), torch.randn(6)), kernels=1, externs=0)


def test_pow_exponents_aten_computes_with_std_pow_run_through_aten():
    x = special(7, 33)
    for e in (2.5, 0.5, -0.5, 4, 0, 1):  # 0.5: ATen's sqrt, which is not correctly rounded
        check_model(lambda t, e=e: t**e, (x,), externs=1)


@pytest.mark.parametrize("name,fn,arity", [r for r in NATIVE if r[2] == 2], ids=[r[0] for r in NATIVE if r[2] == 2])
@pytest.mark.parametrize(
    "shapes", [((33, 1), (1, 7)), ((7, 33), (33,)), ((1,), (5, 4, 3)), ((2, 1, 4), (3, 1))], ids=str
)
def test_broadcasting(name, fn, arity, shapes):
    check_model(fn, tuple(special(*s) for s in shapes))


@pytest.mark.parametrize("name,fn,arity", NATIVE[:8], ids=[r[0] for r in NATIVE[:8]])
def test_non_contiguous_inputs(name, fn, arity):
    base = [special(33, 40) for _ in range(arity)]
    check_model(fn, tuple(b.t() for b in base))  # outputs follow the inputs' layout, as in eager
    check_model(fn, tuple(b[::2, 1::3] for b in base))


def test_mixed_layouts():
    a, b = special(16, 24), special(24, 16).t()
    check_model(lambda x, y: (x * 2 + y).relu(), (a, b), kernels=1)


def test_fusion_of_a_chain_is_one_kernel():
    check_model(lambda x, y: torch.relu(x * 2 + y) - 0.5 * x, (special(64, 33), special(64, 33)), kernels=1)


def test_fused_value_used_twice_still_one_kernel():
    check_model(lambda x: (lambda t: t * t + t)(x.abs() + 1), (special(257),), kernels=2)


def test_views_are_free():
    fns = [
        lambda x: (x.view(8, 33) + 1).t().reshape(-1) * 2,
        lambda x: x.t().contiguous() + 1,
        lambda x: x.unsqueeze(0).expand(3, 8, 33) * x,
        lambda x: torch.flatten(x.permute(1, 0)) + 0,
        lambda x: x[1:5, ::2] * 3,
        lambda x: x.t().reshape(-1),  # a copy: x.t() cannot be viewed flat
        lambda x: x.transpose(0, 1).squeeze().unsqueeze(-1) - 1,
    ]
    for fn in fns:
        check_model(fn, (special(8, 33),))


def test_split_chunk_and_unbind_give_views():
    x = special(4, 10, 6)
    for fn, kernels in (
        (lambda t: t.split(3, dim=1)[2] * 2, 1),
        (lambda t: sum(t.chunk(3, -1)), 1),  # three views of one buffer, added in one loop
        (lambda t: t.unbind(0)[1].relu(), 1),
        (lambda t: [a * b for a, b in zip(t.unbind(1), reversed(t.unbind(1)))][3], 1),
        (lambda t: torch.split(t * 2, [2, 8], 1), 1),  # views of braze's own result, returned
        (lambda t: t.tensor_split(3)[0], 0),  # a view of the input, returned
    ):
        check_model(fn, (x,), kernels=kernels, externs=0)
    timm_qkv = lambda t: t.reshape(2, 10, 3, 2, 2).permute(2, 0, 3, 1, 4).unbind(0)  # noqa: E731
    check_model(lambda t: timm_qkv(t)[0] * timm_qkv(t)[2], (x,), kernels=1, externs=0)


def test_loops_reading_a_buffer_through_two_views():
    x = special(33, 33)
    check_model(lambda a: (lambda t: (t + t.t()).sum(0))(a * 2), (x,))  # t + t.t() is scratch
    check_model(lambda a: (lambda t: (t.t() * t).relu().amax(1))(a + 1), (x,))


def test_returning_inputs_and_views_of_inputs():
    x = special(4, 6)
    check_model(lambda a: (a, a.t(), a[1:], a + 1), (x,))


# Ops eager computes with its own vectorised math (Sleef, reductions): braze calls ATen for
# them inside the program, so the answer is eager's by construction.
EXTERN = [
    ("gelu", F.gelu),
    ("tanh", torch.tanh),
    ("sigmoid", torch.sigmoid),
    ("silu", F.silu),
    ("softplus", F.softplus),
    ("elu", F.elu),
    ("mish", F.mish),
    ("softmax_dim0", lambda x: torch.softmax(x, 0)),
    ("log_softmax_dim0", lambda x: F.log_softmax(x, 0)),
    ("layer_norm", lambda x: F.layer_norm(x, x.shape[-1:])),
    ("sum", lambda x: x.sum(0)),
    ("mean", lambda x: x.mean()),
    ("amax", lambda x: x.amax(0)),
    ("cat", lambda x: torch.cat([x, x * 2], 0)),
    ("pow", lambda x: x**2),
    ("exp", torch.exp),
]


@pytest.mark.parametrize("shape", [(1, 1), (7, 33), (33, 257)], ids=str)
@pytest.mark.parametrize("name,fn", EXTERN, ids=[r[0] for r in EXTERN])
def test_extern_ops_match_eager(name, fn, shape):
    x = torch.randn(*shape)
    check_model(lambda t: fn(t * 0.5) + 1, (x,))


_CONV1D = torch.randn(4, 1, 3)

# Calls braze leaves to ATen that native code makes itself (codegen/calls.py's DISPATCHED rows):
# the program keeps one native body
FROM_NATIVE = [
    ("roll", lambda x: torch.roll(x, 2, 0)),
    ("roll (method)", lambda x: x.roll((1, -3), (0, 1))),
    ("repeat", lambda x: x.repeat((2, 1, 3))),
    ("repeat (sizes)", lambda x: x.repeat(2, 1, 3)),
    ("repeat_interleave", lambda x: torch.repeat_interleave(x, 2, 1)),
    ("repeat_interleave (method)", lambda x: x.repeat_interleave(3)),
    ("adaptive_avg_pool1d", lambda x: F.adaptive_avg_pool1d(x.unsqueeze(0), 5)),
    ("cumsum", lambda x: torch.cumsum(x, 0)),
    ("cumsum (method)", lambda x: x.cumsum(-1)),
    ("mean over a leading dimension", lambda x: x.mean(0)),
    ("mean over dimensions", lambda x: torch.mean(x.t(), dim=(0, 1), keepdim=True)),
    ("argmax", lambda x: torch.argmax(x, 0) * 1.5),
    ("argmax (method, of all)", lambda x: x.argmax() + x),
    ("softmax of a leading dimension", lambda x: torch.softmax(x, 0)),
    ("softmax (method)", lambda x: (x * 2).softmax(dim=0)),
    ("conv1d", lambda x: F.conv1d(x.unsqueeze(1), _CONV1D, padding=1)),
    ("conv1d, padding by name", lambda x: F.conv1d(x.unsqueeze(1), _CONV1D, padding="same")),
    ("gelu of a strided tensor", lambda x: F.gelu(x[:, 1:], approximate="none")),
    ("unfold", lambda x: F.unfold(x[None, None], (1, 2), padding=(0, 1))),
    ("_weight_norm", lambda x: torch._weight_norm(x, x[:, :1] + 2, 0)),
    ("div with a rounding mode", lambda x: torch.div(x, 2, rounding_mode="floor")),
    ("div (method), a float divisor", lambda x: x.div(2.5, rounding_mode="trunc")),
    ("pow of a number", lambda x: 10000.0 ** (x / 64)),
    ("pow of an int (torch.pow)", lambda x: torch.pow(3, x)),
    ("pow of a bool", lambda x: torch.pow(False, x)),
    ("baddbmm (Scalars: the C shim)", lambda x: torch.baddbmm(x[None], x[None, :, :1], x[None, :1], beta=0.5, alpha=2)),
    ("baddbmm (method, an int beta)", lambda x: x[None].baddbmm(x[None, :, :2], x[None, :2], beta=2, alpha=0.3)),
]


@pytest.mark.parametrize("shape", [(1, 1), (7, 33)], ids=str)
@pytest.mark.parametrize("name,fn", FROM_NATIVE, ids=[r[0] for r in FROM_NATIVE])
def test_aten_calls_from_native_code_match_eager(name, fn, shape):
    model = lambda t: fn(t * 0.5) * 2  # noqa: E731
    with torch.no_grad():
        compiled = check_model(model, (special(*shape),))
    (prog,) = compiled.programs()
    calls = [why for _, why in prog.externs if "made once per sizes" not in why]  # (not torch.ones)
    assert prog.native and all(why.endswith("called from native code") for why in calls)
    assert calls or shape == (1, 1)  # (braze's own mean of one element)


def test_a_number_of_a_higher_kind_than_the_tensor_stays_in_python():
    """An int64 tensor divided by 2.5: Python passes 2.5 as a wrapped number, whose result is
    float32; as a plain float64 tensor it would be float64. So the call stays in Python."""
    model = lambda t: torch.div((t > 0).long() * 3, 2.5, rounding_mode="floor") + t  # noqa: E731
    with torch.no_grad():
        compiled = check_model(model, (special(7, 33),))
    (prog,) = compiled.programs()
    assert not prog.native and "a tensor or a number of its kind" in prog.python_body_why


def test_a_string_argument_the_op_refuses_raises_eagers_error():
    """A gelu or conv1d braze would call from native code, given a string the op refuses: the
    lowering's run of it on the example raises, and the call raises eager's error."""
    x = special(7, 33)
    for f in (lambda a: F.gelu(a.t(), approximate="erf") * 2, lambda a: F.conv1d(a[:, None], _CONV1D, padding="full")):
        with pytest.raises(RuntimeError) as eager:
            f(x)
        with pytest.raises(RuntimeError, match=re.escape(str(eager.value))), warnings.catch_warnings():
            warnings.simplefilter("ignore", braze.BrazeWarning)
            braze.compile(f)(x)


def test_indexing_with_integer_tensors_is_called_from_native_code():
    """x[i], x[:, i], x[i, j] (Swin's relative position bias, GPT-J's sin/cos table): aten::index
    with the indices Python's indexing passes; an index out of range raises eager's error."""
    x, i, j = special(7, 33), torch.randint(0, 7, (5,)), torch.randint(0, 33, (4, 3))
    for f, args in [
        (lambda a, k: a[k] * 2, (x, i)),
        (lambda a, k: a[:, k] + 1, (x, j)),
        (lambda a, k, m: a[k[:3], m[0]] - 1, (x, i, j)),
        (lambda a, k: a.t()[k] * 2, (x, j % 7)),
        (lambda a, k: a[k.int()] * 2, (x, i)),  # int32 indices, converted by a loop
    ]:
        (prog,) = check_model(f, args).programs()
        assert prog.native and all(why.endswith("called from native code") for _, why in prog.externs)
    for f, args in [  # a mask (data-dependent sizes), a None (a new dimension): Python's body
        (lambda a: a[a[:, 0] > 0] * 2, (x,)),
        (lambda a, k: a[None, k] * 2, (x, i)),
    ]:
        (prog,) = check_model(f, args).programs()
        assert not prog.native
    compiled = braze.compile(lambda a, k: a[k] * 2)
    compiled(x, i)
    with pytest.raises(IndexError), warnings.catch_warnings():
        warnings.simplefilter("ignore", braze.BrazeWarning)
        compiled(x, torch.tensor([0, 9]))
    assert_same(compiled(x, i), x[i] * 2)


def test_matmul_of_computed_values_is_called_from_native_code():
    """A matmul braze does not lower (MobileViT's tiny 4-D products) is called from native code
    where both operands are values the program computed: they do not require grad in eager
    either. Of an input or a parameter (ATen folds where one requires grad) it stays in Python."""
    a, b = special(4, 4, 1, 60), special(4, 4, 60, 1)
    w = torch.nn.Parameter(torch.randn(4, 60, 3))
    for f, native in [
        (lambda x, y: (x * 2) @ (y * 3) + 1, True),
        (lambda x, y: torch.matmul(x * 2, y + 1) * 2, True),
        (lambda x, y: x @ y + 1, False),
        (lambda x, y: (x * 2).matmul(y) + 1, False),
        (lambda x, y: (x * 2) @ w + 1, False),
    ]:
        with torch.no_grad():
            (prog,) = check_model(f, (a, b)).programs()
        assert prog.native == native


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_interpolation_is_called_from_native_code(layout):
    """F.interpolate, nearest or bilinear, by a size or scale factors (SegFormer's and MobileViT's
    heads): the upsample call its Python code makes; other modes stay in a Python body."""
    x = special(2, 3, 7, 5)
    x = x.to(memory_format=torch.channels_last) if layout == "channels_last" else x
    for f in (
        lambda t: F.interpolate(t, scale_factor=2) * 2,
        lambda t: F.interpolate(t, size=(4, 3)) + 1,
        lambda t: F.interpolate(t, scale_factor=0.5, mode="nearest") + 1,
        lambda t: F.interpolate(t, size=(9, 11), mode="bilinear") * 2,
        lambda t: F.interpolate(t, size=13, mode="bilinear", align_corners=True) + 1,
        lambda t: F.interpolate(t, scale_factor=(1.5, 2.5), mode="bilinear") + 1,
    ):
        (prog,) = check_model(f, (x,)).programs()
        assert prog.native and prog.externs[0][1].endswith("called from native code")
    for f in (
        lambda t: F.interpolate(t, scale_factor=2, mode="bicubic") + 1,
        lambda t: F.interpolate(t, scale_factor=2, mode="bilinear", recompute_scale_factor=True) + 1,
        lambda t: F.interpolate(t[0], scale_factor=2) + 1,
    ):
        (prog,) = check_model(f, (x,)).programs()
        assert not prog.native


@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "transposed"])
def test_constant_padding_is_native(layout):
    """F.pad with a constant (Swin, EfficientViT): filled blocks and the input copied between
    them, laid out as ATen lays out its result; other modes and crops stay ATen's."""
    x = special(2, 5, 7, 3)
    x = {"channels_last": x.to(memory_format=torch.channels_last), "transposed": x.transpose(1, 2)}.get(layout, x)
    for f in (
        lambda a: F.pad(a, (1, 2)) * 2,
        lambda a: F.pad(a, (0, 0, 0, 3, 0, 1)),
        lambda a: F.pad(a, (0, 0)),  # a copy
        lambda a: F.pad(a, (2, 1, 1, 0), value=-1.5),
        lambda a: F.pad(a, (1, 1, 1, 1, 1, 1, 1, 1)),
        lambda a: torch.constant_pad_nd(a, (1, 2), 3.0),
    ):
        check_model(f, (x,), externs=0)
    check_model(lambda a: F.pad(a, (-1, 1)), (x,), externs=1)
    check_model(lambda a: F.pad(a, (1, 1), mode="reflect"), (x[0],), externs=1)
    check_model(lambda a: F.pad(a, (1, 1), value=a[0, 0, 0, 0].item()), (x,), fallback=True)  # a traced value


def test_extern_between_native_kernels():
    compiled = check_model(lambda x: torch.sinh(x * 2 + 1) * 3 - 1, (torch.randn(33, 7),), kernels=2, externs=1)
    assert compiled.programs()[0].externs[0][0].endswith("sinh")


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_cat_and_stack_are_copies_into_slices(dim):
    a, b, c = special(7, 33), special(7, 33), special(7, 1)
    check_model(lambda x, y: torch.cat([x, y], dim) * 2, (a, b), kernels=2, externs=0)  # cat, then the loop
    check_model(lambda x, y: torch.stack((x, y.t().t(), x + 1), dim), (a, b), externs=0)
    check_model(lambda x, y: torch.cat([x.t(), y.t()], dim), (a, b), kernels=1, externs=0)  # strided in and out
    check_model(lambda x: torch.cat([x, x[:0] if dim == 0 else x[:, :0], x], dim), (a,), externs=0)
    if dim != 0:
        check_model(lambda x, z: torch.cat([x, z, z], dim=dim), (a, c), kernels=1, externs=0)


def test_cat_cases_aten_handles_otherwise():
    a = special(7, 33)
    check_model(lambda x: torch.cat([x, torch.zeros(0)]), (a,), externs=0)  # ATen skips a 1-D empty tensor
    check_model(lambda x: torch.cat([x, x.double()]), (a,), externs=2)  # .double, and cat to float64
    check_model(lambda x: torch.cat([torch.zeros(0), torch.zeros(0)]) + x.sum(), (a,))
    bad = braze.compile(lambda x: torch.cat([x, x[:, :3]]))  # sizes differ off the cat dimension
    with pytest.raises(RuntimeError), warnings.catch_warnings():
        warnings.simplefilter("ignore", braze.BrazeWarning)
        bad(a)


def test_conversions_to_a_tensors_own_dtype_are_the_tensor_itself():
    x, y = special(7, 33), special(7, 33).double()
    for f in (
        lambda t: (t.to(torch.float32) * 2).float(),
        lambda t: t.to(t.dtype).type_as(t).cpu() + 1,
        lambda t: t.to("cpu", torch.float32).type(torch.float32).relu(),
    ):
        check_model(f, (x,), kernels=1, externs=0)
    check_model(lambda t, d: t.to(d.dtype) * 2, (x, y), externs=2)  # a copy to float64, and float64 math: ATen
    check_model(lambda t: t.to(torch.float32, copy=True) * 2, (x,), externs=0)  # a copy loop
    check_model(lambda t: t.to(torch.float32, copy=True), (x,), kernels=1, externs=0)
    check_model(lambda t: t.to(memory_format=torch.channels_last), (special(2, 3, 4, 5),), kernels=1, externs=0)
    check_model(lambda t: t.double() * 2, (x,), externs=2)


@pytest.mark.parametrize("shape", [(7, 33), (1,), (0, 5), (257,)])
def test_float_to_bool_and_logical_not_are_native_comparisons(shape):
    """DeBERTa's `~(mask.bool())`: x != 0 (NaN is true) and its negation, fused into one loop."""
    x = special(*shape)
    x.view(-1)[: x.numel() // 3] = 0.0  # zeros among the values, which become false
    b = x > 0.3
    for f in (
        lambda t: t.bool(),
        lambda t: torch.where(t.to(torch.bool), t, 1.5),
        lambda t: ~(t.bool()),
        torch.logical_not,
        lambda t: t.masked_fill(~(t.abs() > 1).bool(), -2.0),
    ):
        check_model(f, (x,), kernels=1, externs=0)
    for f in (operator.invert, torch.logical_not, lambda t: t.logical_not(), lambda t: torch.bitwise_not(t[::2])):
        check_model(f, (b,), kernels=1, externs=0)
    if x.dim() == 2:
        check_model(lambda t: t.t().bool(), (x,), kernels=1, externs=0)  # eager's layout, transposed
    check_model(lambda t: ~(t.long()), (x,), externs=2)  # integers: ATen
    with pytest.raises(TypeError), warnings.catch_warnings():
        warnings.simplefilter("ignore", braze.BrazeWarning)
        braze.compile(operator.invert)(x)  # bitwise not of a float: eager's error


def roberta_positions(input_ids: torch.Tensor, padding_idx: int = 1, past: int = 0) -> torch.Tensor:
    """Hugging Face's create_position_ids_from_input_ids (RoBERTa, XLM-R, MPNet)."""
    mask = input_ids.ne(padding_idx).int()
    incremental = (torch.cumsum(mask, dim=1).type_as(mask) + past) * mask
    return incremental.long() + padding_idx


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_integer_arithmetic_comparisons_and_conversions_are_native_loops(dtype, n, threads):
    """Two's complement add, sub and mul (wrapping as ATen's do), comparisons, conversions among
    bool, int32, int64 and to float32, and float32 arithmetic on integers and bools (cast first,
    as ATen casts to the common dtype), fused into loops."""
    threads(n)
    info = torch.iinfo(dtype)
    for shape in [(1,), (7, 33), (32769,), (0, 5)]:
        t = torch.randint(info.min, info.max, shape, dtype=dtype)
        t.view(-1)[:3] = torch.tensor([info.min, info.max, 0], dtype=dtype)[: t.numel()]
        for f in (
            lambda a: a * a + 3,
            lambda a: (a - 7) * a[:1],
            lambda a: a > 5,
            lambda a: a == a[:1],
            lambda a: a.float(),
            lambda a: a.bool(),
            lambda a: (a.t() if a.dim() == 2 else a).long() * 1,
            lambda a: a.int() * 2,
        ):
            check_model(f, (t,), kernels=None if t.numel() == 0 else 1, externs=0)
    i = torch.randint(-5, 5, (7, 33), dtype=dtype)
    for f in (lambda a: a * 0.5, lambda a: 1.0 - a, lambda a: a / 3, lambda a: a / (a * 2 + 11)):
        check_model(f, (i,), kernels=1, externs=0)  # float32 arithmetic on the values cast to float32
    check_model(lambda a, x: x * a[:1] + (x > 0) * x, (i, special(7, 33)), externs=0)
    if dtype == torch.int32:
        check_model(lambda a: a + 2**31, (i,), externs=1)  # a scalar the dtype cannot hold
    check_model(lambda a, c: a + c, (i, i.to(torch.int64 if dtype == torch.int32 else torch.int32)), externs=1)
    check_model(lambda a: a.float().int(), (i,), externs=1)  # float32 to an integer: ATen
    b = i > 0
    check_model(lambda a: a.float() * 2 + a.long(), (b,), kernels=1, externs=0)
    check_model(lambda a: a.long() * 3 - 1, (b,), kernels=1, externs=0)
    ids = torch.randint(0, 5, (3, 17), dtype=dtype)
    ids[0, -4:] = 1
    compiled = check_model(roberta_positions, (ids,), kernels=2, externs=1)  # ATen's cumsum between
    assert compiled.programs()[0].native


def test_transposed_attributes_are_views():
    """Falcon's `x @ weight.T`: TorchDynamo records `weight.T` as getattr(weight, "T")."""
    x, w, b = special(7, 33), torch.randn(5, 33), torch.randn(3, 4, 5)
    check_model(lambda t: t.T + 1, (x,), kernels=1, externs=0)
    check_model(lambda t: t.mT * 2, (b,), kernels=1, externs=0)
    check_model(lambda t: t.mH - t.transpose(-1, -2), (b,), kernels=1, externs=0)
    check_model(lambda t, u: t @ u.T, (x, w), externs=0)

    class Keywords(torch.nn.Module):  # (**kwargs: captured through TorchDynamo)
        def forward(self, t: torch.Tensor, u: torch.Tensor, **kwargs: object) -> torch.Tensor:
            return (t @ u.T).relu()

    torch._dynamo.reset()
    compiled = braze.compile(Keywords())
    for _ in range(2):
        assert_same(compiled(x, u=w), (x @ w.T).relu())
    assert compiled._subgraphs and all(p.native and not p.externs for p in compiled.programs())


def test_rsqrt_falls_back_to_aten_when_its_probe_disagrees(monkeypatch):

    x = special(7, 33).abs()
    check_model(torch.rsqrt, (x,), kernels=1, externs=0)
    monkeypatch.setattr(jit, "rsqrt_is_ieee", lambda: False)
    compiled = check_model(lambda t: torch.rsqrt(t) * 2, (x,), externs=1)
    assert "probe" in compiled.programs()[0].externs[0][1]


def test_probe_references_do_not_use_atens_float64_sqrt(monkeypatch):
    """ATen's float64 sqrt (MKL's vdSqrt) is not correctly rounded, and how many values it misses
    varied between processes: references built on it made the rsqrt and batch_norm probes fail
    now and then. With it a float32 ulp off, the probes still see what they check."""
    real = torch.Tensor.sqrt
    off = lambda t: real(t) * (1 + 2**-23) if t.dtype == torch.float64 else real(t)  # noqa: E731
    monkeypatch.setattr(torch.Tensor, "sqrt", off)
    jit._rsqrt_is_ieee.cache_clear(), jit._batch_norm_same.cache_clear()
    try:
        assert jit.rsqrt_is_ieee() and jit.batch_norm_same()
    finally:
        monkeypatch.undo()
        jit._rsqrt_is_ieee.cache_clear(), jit._batch_norm_same.cache_clear()


def test_rms_norm_written_by_hand_is_all_native():
    w = torch.randn(33)

    def rms_norm(x):  # Llama's and T5's, op by op
        variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        return w * (x * torch.rsqrt(variance + 1e-6))

    check_model(rms_norm, (special(7, 33),), externs=0)
    check_model(rms_norm, (torch.randn(3, 5, 33) * 1e3,), externs=0)


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("name", sorted(jit.VML_FUNCTIONS))
def test_mkl_vector_math_across_threads_and_layouts(name, n, threads):
    threads(n)
    op = getattr(torch, name)
    big = special(32769)
    for x in (big, special(257, 130).t(), special(64, 66)[:, ::2], special(7, 1, 33).expand(7, 5, 33)):
        check_model(lambda t: op(t * 0.5) + 1, (x,), externs=0)


def test_gpt2_gelu_written_by_hand_is_all_native():
    def gelu_new(x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))

    # One loop: the tanh is braze's (vml.py) where its probe agrees, else a vmsTanh call between two.
    check_model(gelu_new, (special(33, 65),), kernels=1 if vml.why_not_tanh() is None else 3, externs=0)


def test_vector_math_falls_back_to_aten_when_its_probe_disagrees(monkeypatch):

    monkeypatch.setattr(jit, "vml_same", lambda name: False)
    compiled = check_model(torch.tanh, (special(7, 33),), externs=1)
    assert "probe" in compiled.programs()[0].externs[0][1]


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize(
    "op", [torch.sigmoid, F.silu, lambda x: F.gelu(x, approximate="tanh")], ids=["sigmoid", "silu", "gelu_tanh"]
)
def test_sleef_activations_take_atens_loop_across_threads_and_lengths(op, n, threads):
    # Sleef in ATen's vector body, glibc in its scalar tails; from 32768 elements (gelu: 16385)
    # a tail per thread.
    threads(n)
    for length in (31, 32, 33, 65, 16384, 16385, 20001, 32767, 32768, 32769, 65536 + 33, 100003):
        check_model(op, (special(length) * 20,), kernels=1, externs=0)
    # Transposed or channels-last: ATen walks the memory as one run, as braze's kernel does.
    check_model(op, (special(7, 33).t(),), kernels=1, externs=0)
    check_model(op, (special(2, 5, 7, 3).to(memory_format=torch.channels_last),), kernels=1, externs=0)
    check_model(op, (special(7, 66)[:, ::2],), externs=1)  # strided: ATen's loop differs; its call


GELU_LENGTHS = (2, 7, 8, 9, 15, 16, 17, 31, 32, 33, 257, 32768, 32769, 100003)


@pytest.mark.parametrize("n", [1, 2])
def test_gelu_is_onednns_polynomial_fused_in_braze_loops(n, threads):
    # ATen's gelu of a contiguous tensor of 2+ elements is oneDNN's per-lane polynomial: any
    # length and split gives its bits, so it is an elementwise op, fused with its neighbours.
    threads(n)
    for length in GELU_LENGTHS:
        check_model(F.gelu, (special(length) * 4,), kernels=1, externs=0)
    x = special(7, 33)
    bits = torch.arange(0, 0x7F800000, 0x10001, dtype=torch.int32).view(torch.float32)  # every binade
    for t in (bits, -bits, torch.tensor([1e-45, -1e-45, 5.546, -5.546, 3e38, -3e38])):
        check_model(F.gelu, (t,), kernels=1, externs=0)
    check_model(lambda t: F.gelu(t * 2 + 1) - t, (x,), kernels=1, externs=0)  # one loop
    check_model(torch.nn.GELU(), (x,), kernels=1, externs=0)
    check_model(lambda t: F.gelu(t, approximate="none"), (x,), kernels=1, externs=0)
    check_model(F.gelu, (special(0, 7),), externs=0)
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(33, 65), torch.nn.GELU(), torch.nn.Linear(65, 33))
    compiled = check_model(mlp, (special(5, 33),), externs=0)
    assert compiled.programs()[0].kernel_count == 2  # bias, GEMM and GELU; bias and GEMM


@pytest.mark.parametrize("n", [1, 2])
def test_gelu_where_aten_takes_its_own_kernel(n, threads):
    # One element, or a transposed or channels-last input: ATen's own kernel (an erf of Sleef's
    # exp in its vector body, glibc's erff in the tails), reproduced by sleef.py with its loop.
    threads(n)
    for length in (1, 31, 33, 16385, 32769, 65536 + 33):
        check_model(F.gelu, (special(2, length).t() * 4,), kernels=1, externs=0)
    for x in (special(1), special(1, 1), special(2, 5, 7, 3).to(memory_format=torch.channels_last)):
        check_model(F.gelu, (x,), kernels=1, externs=0)
    compiled = check_model(F.gelu, (special(7, 66)[:, ::2],), externs=1)  # truly strided: ATen's
    assert "gelu" in compiled.programs()[0].externs[0][1]


def test_gelu_follows_the_mkldnn_flag_between_calls():
    # Disabled, eager's gelu takes ATen's own kernel: braze recompiles (saying why) and calls it.
    compiled = braze.compile(lambda t: F.gelu(t) * 2)
    x = special(7, 33)
    check_model(lambda t: F.gelu(t) * 2, (x,), compiled=compiled, kernels=1, externs=0)
    with torch.backends.mkldnn.flags(enabled=False):
        check_model(lambda t: F.gelu(t) * 2, (x,), compiled=compiled, externs=1)
        assert "mkldnn" in compiled.programs()[-1].externs[0][1]
    check_model(lambda t: F.gelu(t) * 2, (x,), compiled=compiled)
    assert len(compiled.programs()) == 2  # enabled again: the first program
    assert "torch.backends.mkldnn.enabled: True -> False" in [c.why for c in compiled.compilations]


def test_gelu_falls_back_to_aten_when_its_probe_disagrees(monkeypatch):
    from braze import onednn

    monkeypatch.setattr(onednn, "_same", lambda threads: False)
    compiled = check_model(F.gelu, (special(7, 33),), externs=1)
    assert "probe" in compiled.programs()[0].externs[0][1]


def test_the_gelu_probe_sees_one_coefficient_off(monkeypatch):
    from braze import onednn
    from braze.codegen import loops

    table = [list(row) for row in loops.GELU_ERF_TABLE]
    table[5][12] = float(torch.tensor(table[5][12]).nextafter(torch.tensor(1.0)))  # one float32 ulp
    monkeypatch.setattr(loops, "GELU_ERF_TABLE", table)
    monkeypatch.setattr(onednn, "KERNEL", "braze_gelu_erf_perturbed")
    assert not onednn._same.__wrapped__(torch.get_num_threads())


def test_gated_mlp_of_llama_is_native():
    torch.manual_seed(0)
    gate, up, down = (torch.nn.Linear(32, 64, bias=False), torch.nn.Linear(32, 64, bias=False), torch.nn.Linear(64, 32))

    def mlp(x):
        return down(F.silu(gate(x)) * up(x))

    check_model(mlp, (torch.randn(5, 7, 32),), externs=0)


def test_sleef_activations_fall_back_to_aten_when_their_probe_disagrees(monkeypatch):
    from braze import sleef

    monkeypatch.setattr(sleef, "_same", lambda fn, threads: False)
    compiled = check_model(torch.sigmoid, (special(7, 33),), externs=1)
    assert "probe" in compiled.programs()[0].externs[0][1]


def test_the_sleef_probe_sees_a_tail_computed_as_the_body(monkeypatch):
    from braze import sleef

    real = sleef.run

    def all_vector(fn, x):  # the tail through Sleef too: what a kernel without ATen's loop gives
        padded = torch.cat([x, torch.zeros(-x.numel() % 32)])
        return real(fn, padded)[: x.numel()]

    monkeypatch.setattr(sleef, "run", all_vector)
    sleef._same.cache_clear()
    try:
        assert not sleef._same("silu", torch.get_num_threads())
    finally:
        monkeypatch.undo()
        sleef._same.cache_clear()
