"""Stage 2, lowering: an FX graph plus example inputs becomes a braze IR graph.

Each FX node is run on example tensors (a copy of the first call's arguments, or what earlier
ops gave), which gives eager's exact output layout and raises eager's errors for bad shapes.
Then the lowering registry (one row per op, the table below) turns it into IR; an op without a
row, or with arguments a row cannot do bit-exactly, becomes an EXTERN node that calls the same
torch function at run time. In-place ops are rewritten to functional ones when the value they
change is braze's own intermediate; changing an input or a view is `Unsupported`.

    core.py         the Lowerer, the registry, helpers
    elementwise.py  arithmetic, comparisons, activations, clamps
    views.py        views (and x.T), conversions, cat/stack, constant padding, identity, dropout
    gemm.py         linear, addmm, mm, matmul, bmm as BLAS calls
    rows.py         layer_norm, softmax, log_softmax, sum, mean through braze's row kernels;
                    a GroupNorm layer as ATen's group_norm called from native code
    pool.py         max_pool2d through braze's pooling kernel; adaptive_avg_pool2d to 1 x 1 (a mean);
                    ATen's avg_pool2d and other adaptive pools called from native code
    conv.py         conv2d: ATen's in exact mode; fast mode's packed oneDNN call, BatchNorm and ReLU folded in
    index.py        embedding as native row copies
    transformer.py  nn.TransformerEncoderLayer's and nn.MultiheadAttention's fused fast paths, as
                    the ops their CPU kernel runs (fast mode: its attention fast mode's kernel)
    attention.py    scaled_dot_product_attention: fast mode's own kernel
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F

from .. import jit
from ..ir import Op
from .attention import _attention
from .conv import _conv2d
from .core import LOWERINGS, Lowered, Lowerer, NotNative, Sym, Unsupported, lower, register, to_meta
from .elementwise import (
    _batch_norm,
    _binary,
    _clamp,
    _clamp_one,
    _gelu,
    _hardsigmoid,
    _hardswish,
    _hardtanh_any,
    _leaky_relu_any,
    _logical_not,
    _masked_fill,
    _post_op,
    _pow,
    _pow_by,
    _prelu,
    _relu6,
    _rsqrt,
    _rsub,
    _sleef,
    _threshold,
    _unary,
    _vml,
    _where,
)
from .gemm import _addmm, _bmm, _linear, _matmul, _mm, blas_args, bmm_blas_args
from .index import _embedding
from .pool import _adaptive_avg_pool2d, _avg_pool2d, _max_pool2d
from .rows import _group_norm, _layer_norm, _softmax, _sum
from .transformer import _encoder_layer, _multihead_attention, _native_multihead_attention
from .views import (
    _attribute,
    _cat,
    _conversion,
    _dropout,
    _getitem,
    _identity,
    _pad,
    _stack,
    _stochastic_depth,
    _view_op,
    _views,
)

__all__ = [
    "LOWERINGS",
    "Lowered",
    "Lowerer",
    "NotNative",
    "Sym",
    "Unsupported",
    "lower",
    "register",
    "to_meta",
    "blas_args",
    "bmm_blas_args",
]


def _rows() -> None:
    nn = torch.nn
    for op, keys in {
        Op.ADD: (operator.add, operator.iadd, torch.add, "add", "add_", "__add__", "__iadd__", "__radd__"),
        Op.SUB: (operator.sub, operator.isub, torch.sub, torch.subtract, "sub", "sub_", "__sub__", "__isub__"),
        Op.MUL: (
            operator.mul,
            operator.imul,
            torch.mul,
            torch.multiply,
            "mul",
            "mul_",
            "__mul__",
            "__imul__",
            "__rmul__",
        ),
        Op.DIV: (
            operator.truediv,
            operator.itruediv,
            torch.div,
            torch.true_divide,
            "div",
            "div_",
            "__truediv__",
            "__itruediv__",
        ),
        Op.MAXIMUM: (torch.maximum, "maximum"),
        Op.MINIMUM: (torch.minimum, "minimum"),
        Op.LT: (operator.lt, torch.lt, torch.less, "lt", "less", "__lt__"),
        Op.LE: (operator.le, torch.le, torch.less_equal, "le", "less_equal", "__le__"),
        Op.GT: (operator.gt, torch.gt, torch.greater, "gt", "greater", "__gt__"),
        Op.GE: (operator.ge, torch.ge, torch.greater_equal, "ge", "greater_equal", "__ge__"),
        Op.EQ: (operator.eq, torch.eq, "eq", "__eq__"),
        Op.NE: (operator.ne, torch.ne, torch.not_equal, "ne", "not_equal", "__ne__"),
    }.items():
        register(*keys)(_binary(op))
    register(torch.rsub, "rsub", "__rsub__")(_rsub)
    register(operator.neg, torch.neg, torch.negative, "neg", "neg_", "__neg__")(_unary(Op.NEG))
    register(operator.abs, torch.abs, "abs", "abs_", "__abs__")(_unary(Op.ABS))
    register(torch.rsqrt, "rsqrt", "rsqrt_")(_rsqrt)
    for name in jit.VML_FUNCTIONS:
        extra = (nn.Tanh,) if name == "tanh" else ()
        register(getattr(torch, name), name, f"{name}_", *extra)(_vml(name))
    register(torch.sigmoid, F.sigmoid, "sigmoid", "sigmoid_", nn.Sigmoid)(_post_op("sigmoid", "", _sleef("sigmoid")))
    register(F.silu, nn.SiLU)(_post_op("swish", "", _sleef("silu")))
    register(F.gelu, nn.GELU)(_post_op("gelu", "", _gelu))
    register(operator.pow, torch.pow, "pow", "pow_", "__pow__", "__ipow__")(_pow)
    register(torch.square, "square", "square_")(_pow_by(2))
    register(torch.reciprocal, "reciprocal", "reciprocal_")(_pow_by(-1))
    register(torch.masked_fill, "masked_fill", "masked_fill_")(_masked_fill)
    register(torch.cat, torch.concat, torch.concatenate)(_cat)
    register(torch.stack)(_stack)
    register(torch._C._nn.pad, F.pad, torch.constant_pad_nd)(_pad)
    register(torch.clamp_min, "clamp_min", "clamp_min_")(_clamp_one(lo=True))
    register(torch.clamp_max, "clamp_max", "clamp_max_")(_clamp_one(lo=False))
    register(torch.relu, torch.relu_, F.relu, F.relu_, "relu", "relu_", nn.ReLU)(_post_op("relu", "", _unary(Op.RELU)))
    register(F.leaky_relu, F.leaky_relu_, nn.LeakyReLU)(_leaky_relu_any)
    register(torch.clamp, torch.clip, "clamp", "clip", "clamp_", "clip_")(_clamp)
    register(F.hardtanh, F.hardtanh_, nn.Hardtanh)(_hardtanh_any)
    register(F.relu6, nn.ReLU6)(_relu6)
    register(F.hardsigmoid, nn.Hardsigmoid)(_hardsigmoid)
    register(F.hardswish, nn.Hardswish)(_hardswish)
    register(F.threshold, F.threshold_, torch.threshold, nn.Threshold)(_threshold)
    register(F.prelu, torch.prelu, nn.PReLU)(_prelu)
    register(torch.where, "where")(_where)
    register(operator.invert, torch.bitwise_not, "bitwise_not", "__invert__", torch.logical_not, "logical_not")(
        _logical_not
    )
    register(nn.Identity)(_identity)
    register("to", "type", "type_as", "float", "double", "half", "bfloat16", "long", "int", "short", "bool", "cpu")(
        _conversion
    )
    register(F.dropout, nn.Dropout)(_dropout)
    register("torchvision.ops.stochastic_depth.stochastic_depth")(_stochastic_depth)
    register(
        torch.reshape,
        torch.flatten,
        torch.transpose,
        torch.permute,
        torch.t,
        torch.unsqueeze,
        torch.squeeze,
        torch.swapaxes,
        torch.movedim,
        torch.narrow,
        "view",
        "reshape",
        "flatten",
        "transpose",
        "permute",
        "t",
        "unsqueeze",
        "squeeze",
        "expand",
        "expand_as",
        "contiguous",
        "view_as",
        "reshape_as",
        "swapaxes",
        "narrow",
        "movedim",
        "unflatten",
    )(_view_op)
    register(nn.Flatten, nn.Unflatten)(_view_op)
    register(torch.split, torch.chunk, torch.unbind, torch.tensor_split, "split", "chunk", "unbind", "tensor_split")(
        _views
    )
    register(operator.getitem, "__getitem__")(_getitem)
    register(getattr)(_attribute)
    register(F.layer_norm, torch.layer_norm, nn.LayerNorm)(_layer_norm)
    register(torch.softmax, F.softmax, "softmax", nn.Softmax)(_softmax(log=False))
    register(torch.log_softmax, F.log_softmax, "log_softmax", nn.LogSoftmax)(_softmax(log=True))
    register(torch.sum, "sum")(_sum(mean=False))
    register(torch.mean, "mean")(_sum(mean=True))
    register(F.batch_norm, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)(_batch_norm)
    register(F.max_pool2d, torch.max_pool2d, nn.MaxPool2d)(_max_pool2d)
    register(F.adaptive_avg_pool2d, nn.AdaptiveAvgPool2d)(_adaptive_avg_pool2d)
    register(nn.AvgPool2d)(_avg_pool2d)
    register(nn.GroupNorm)(_group_norm)
    register(F.conv2d, torch.conv2d, nn.Conv2d)(_conv2d)
    register(F.embedding, nn.Embedding)(_embedding)
    register(torch._transformer_encoder_layer_fwd)(_encoder_layer)
    register(nn.MultiheadAttention)(_multihead_attention)
    register(torch._native_multi_head_attention)(_native_multihead_attention)
    register(F.scaled_dot_product_attention)(_attention)
    register(F.linear, nn.Linear)(_linear)
    register(torch.bmm, "bmm")(_bmm)
    register(torch.addmm, "addmm")(_addmm)
    register(torch.mm, "mm")(_mm)
    register(torch.matmul, operator.matmul, "matmul", "__matmul__")(_matmul)


_rows()
