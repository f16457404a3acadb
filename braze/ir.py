"""braze's IR: one flat, immutable, topologically ordered list of nodes.

Every tensor value carries the exact shape, strides, storage offset and dtype that eager PyTorch
gives it (found by running the op on meta tensors during lowering), so native code can write
outputs with eager's layout and views are free: a VIEW is only new metadata over its base.

After fusion a FUSED node (and a GEMM with an epilogue) holds a `body`: elementwise nodes that
run in one loop. Body nodes name values defined earlier in the body or operands of the owner.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from . import dims


class Op(enum.Enum):
    INPUT = "input"  # a user argument, read from the call
    PARAM = "param"  # a parameter or buffer of the model, read at each call (never copied)
    VIEW = "view"  # alias of inputs[0]: new shape/stride/offset over the same memory
    # inputs[0] into a fresh buffer (contiguous, reshape of a non-view, ...), converted to the
    # node's dtype; a constant inputs[0] fills it (padding)
    COPY = "copy"
    ADD = "add"
    SUB = "sub"
    MUL = "mul"
    DIV = "div"
    NEG = "neg"
    ABS = "abs"
    RSQRT = "rsqrt"  # 1 / sqrt(x), both IEEE (ATen's rsqrt here; checked by a probe when lowering)
    # gelu's erf form as oneDNN's avx512_core kernel computes it (ATen's gelu of a contiguous
    # float32 input here; checked by a probe when lowering): a polynomial per quarter binade
    GELU_ERF = "gelu_erf"
    TANH = "tanh"  # MKL's vmsTanh as its generic kernel computes it (vml.py)
    FAST_TANH = "fast_tanh"  # fast mode's tanh: within 1.1 ulp (codegen/fastmath.py)
    # Fast mode's sigmoid, silu, gelu_tanh (attrs fn): per element as ATen's Sleef-based kernel
    # computes its vector body (or, on one element, its scalar tail), but not in ATen's loop
    SLEEF = "sleef"
    RELU = "relu"
    LEAKY_RELU = "leaky_relu"  # attrs: slope
    CLAMP = "clamp"  # attrs: lo, hi (either may be None)
    MAXIMUM = "maximum"
    MINIMUM = "minimum"
    WHERE = "where"  # inputs: cond (bool), a, b
    FMA = "fma"  # inputs[0] * inputs[1] + inputs[2], rounded once (where ATen's build fused them)
    LT = "lt"  # comparisons: float32 operands, a bool result
    LE = "le"
    GT = "gt"
    GE = "ge"
    EQ = "eq"
    NE = "ne"
    GEMM = "gemm"  # out = beta * bias + a @ b through BLAS sgemm_, as ATen's addmm/mm
    # Fast mode's convolutions as GEMMs (lowering/conv.py): row (image, oh, ow) of the [N * OH *
    # OW, KH * KW * C] result holds, tap after tap (kh, kw), the C channels of inputs[0]'s
    # channels-last pixel under it (zeros off the image); attrs: kernel, stride, padding,
    # dilation (pairs). Such a GEMM's attrs `taps`: its inputs[1] is the convolution's weight
    # [O, C, KH, KW] itself, read only from its panels (fast.GemmPack's, in this K order).
    IM2COL = "im2col"
    BMM = "bmm"  # out[i] = a[i] @ b[i] through MKL's cblas_sgemm_batch, as ATen's bmm
    CAT = "cat"  # the inputs copied one after another along attrs['dim'], as ATen's cat
    VML = "vml"  # MKL's vector math function attrs['fn'] (vmsExp...) on the input, as ATen calls it
    # ATen's Sleef-based activation attrs['fn'] (sigmoid, silu, gelu_tanh, ATen's own gelu_erf) of an
    # input in one run of memory, with ATen's loop: its threads' chunks, 32-element vector steps and
    # scalar tails (sleef.py).
    ACTIVATION = "activation"
    # Each row of inputs[0] (contiguous) normalised over its attrs['n'] elements, times inputs[1]
    # plus inputs[2], with ATen's arithmetic (rows.py); attrs: n, rows, eps.
    LAYER_NORM = "layer_norm"
    # (log_)softmax of each row of inputs[0] (contiguous, attrs n long), as ATen (rows.py); attrs:
    # n, rows, log
    SOFTMAX = "softmax"
    SUM = "sum"  # each row of inputs[0] (contiguous, attrs n long) summed as ATen; attrs: n, rows, mean
    # Fast mode: each row x of inputs[0] (contiguous, attrs n long) as x * rsqrt(mean(x * x) + eps),
    # times inputs[1] (n floats; None: no weight), the sum reassociated (rows.py); attrs: n, rows, eps
    RMS_NORM = "rms_norm"
    # max_pool2d of each [H, W] plane of inputs[0] (contiguous), or with attrs pixels of its
    # channels-last pixels, as ATen (pool.py); attrs: kernel, stride, padding, dilation (pairs)
    MAX_POOL = "max_pool"
    # Fast mode's direct convolution (directconv.py) of inputs[0] by the contiguous weight
    # inputs[1], plus the bias inputs[2] if there is one, into a channels-last result: with attrs
    # depthwise, [C, 1, KH, KW] on channels-last pixels; else [C, CIN, KH, KW] on a contiguous
    # NCHW input of few channels. attrs: kernel, stride, padding (pairs; no dilation)
    CONV = "conv"
    # Rows of inputs[1] (2-D, rows contiguous) copied out in the order of the int64/int32 indices
    # inputs[0], as ATen's embedding; an index outside [0, attrs rows) raises eager's IndexError.
    EMBEDDING = "embedding"
    # Fast mode's attention (attention.py): softmax(inputs[0] @ inputs[1]^T * attrs scale + mask)
    # @ inputs[2] per (batch, head) of [B, H, T, d] float32 tensors whose rows are contiguous;
    # attrs causal: query i sees keys 0..i; mask: 0 none, 1 boolean inputs[3], 2 float inputs[3].
    ATTENTION = "attention"
    FUSED = "fused"  # elementwise body computed in one loop nest
    EXTERN = "extern"  # a torch call made unchanged; attrs: fn, args, kwargs, why


UNARY = frozenset(
    {Op.NEG, Op.ABS, Op.RSQRT, Op.GELU_ERF, Op.TANH, Op.FAST_TANH, Op.SLEEF}
    | {Op.RELU, Op.LEAKY_RELU, Op.CLAMP, Op.COPY}
)
BINARY = frozenset({Op.ADD, Op.SUB, Op.MUL, Op.DIV, Op.MAXIMUM, Op.MINIMUM})
COMPARE = frozenset({Op.LT, Op.LE, Op.GT, Op.GE, Op.EQ, Op.NE})
ELEMENTWISE = UNARY | BINARY | COMPARE | {Op.WHERE, Op.FMA}
# The dtypes elementwise values may have (codegen/loops.py lays each out): float32 arithmetic,
# add, sub, mul and comparisons in an integer dtype, bool as comparisons give it; COPY converts
# among them.
INTEGERS = frozenset({torch.int32, torch.int64})
LOOP_DTYPES = INTEGERS | {torch.float32, torch.bool}
# Ops whose value is computed by native code into its own buffer.
KERNELS = (
    frozenset(
        {
            Op.FUSED,
            Op.GEMM,
            Op.BMM,
            Op.CAT,
            Op.VML,
            Op.ACTIVATION,
            Op.LAYER_NORM,
            Op.SOFTMAX,
            Op.SUM,
            Op.RMS_NORM,
            Op.MAX_POOL,
            Op.CONV,
            Op.IM2COL,
            Op.EMBEDDING,
            Op.ATTENTION,
        }
    )
    | ELEMENTWISE
)

# An operand is a value's name, a Python scalar baked into the code, or None (absent bias).
Operand = str | float | None


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype

    @staticmethod
    def of(t: torch.Tensor) -> TensorMeta:
        return TensorMeta(tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def dense(self) -> bool:
        """The elements fill [offset, offset + numel) of memory exactly, in some order of the
        dimensions (contiguous, transposed, channels-last): ATen's loops walk such a tensor as
        one run of memory."""
        expected = 1
        pairs = [(st, n) for st, n in zip(self.stride, self.shape) if not isinstance(n, int) or n > 1]
        for stride, size in sorted(pairs, key=lambda p: dims.typical(p[0])):
            if stride != expected:
                return False
            expected *= size
        return True

    @property
    def span(self) -> int:
        """Elements of storage the view reaches, from offset 0 (what a buffer must hold)."""
        if self.numel == 0:
            return self.offset
        return self.offset + 1 + sum((s - 1) * st for s, st in zip(self.shape, self.stride))

    def __str__(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        dims = ",".join(map(str, self.shape))
        text = f"{dt}[{dims}]"
        if self.stride != contiguous_strides(self.shape):
            text += "(" + ",".join(map(str, self.stride)) + ")"
        return text + (f"+{self.offset}" if self.offset else "")


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


@dataclass(frozen=True)
class Node:
    name: str
    op: Op
    inputs: tuple[Operand, ...]
    meta: TensorMeta | None  # None for non-tensor values (only EXTERN makes them)
    attrs: dict[str, Any] = field(default_factory=dict, compare=False)

    def value_inputs(self) -> tuple[str, ...]:
        return tuple(i for i in self.inputs if isinstance(i, str))

    @property
    def body(self) -> tuple[Node, ...]:
        return self.attrs.get("body", ())

    def __str__(self) -> str:
        return format_node(self, "")


@dataclass(frozen=True)
class Graph:
    inputs: tuple[str, ...]  # INPUT node names, in call order
    nodes: tuple[Node, ...]
    outputs: tuple[str, ...]

    def node_map(self) -> dict[str, Node]:
        return {n.name: n for n in self.nodes}

    def users(self) -> dict[str, list[Node]]:
        out: dict[str, list[Node]] = {n.name: [] for n in self.nodes}
        for n in self.nodes:
            for i in n.value_inputs():
                out[i].append(n)
        return out

    def count(self, op: Op) -> int:
        return sum(n.op is op for n in self.nodes)

    def __str__(self) -> str:
        lines = [f"graph({', '.join(self.inputs)}):"]
        lines += [format_node(n, "  ") for n in self.nodes]
        lines.append(f"  return {', '.join(self.outputs)}")
        return "\n".join(lines)


def _fmt_operand(x: Operand) -> str:
    return "None" if x is None else (x if isinstance(x, str) else repr(x))


def _fmt_attr(v: Any) -> str:
    if callable(v):
        return getattr(v, "__qualname__", None) or getattr(v, "__name__", None) or type(v).__name__
    return repr(v)


def format_node(n: Node, indent: str) -> str:
    args = ", ".join(_fmt_operand(i) for i in n.inputs)
    shown = {k: v for k, v in n.attrs.items() if k not in ("body", "tensor", "args", "kwargs")}
    extra = " ".join(f"{k}={_fmt_attr(v)}" for k, v in shown.items())
    meta = str(n.meta) if n.meta is not None else "object"
    text = f"{indent}{n.name}: {meta} = {n.op.value}({args})" + (f"  {extra}" if extra else "")
    for b in n.body:
        text += "\n" + format_node(b, indent + "    | ")
    return text


class VerifyError(AssertionError):
    pass


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise VerifyError(msg)


def broadcast_shape(*shapes: tuple[int, ...]) -> tuple[int, ...]:
    """NumPy broadcasting (torch.broadcast_shapes would import sympy on first use)."""
    out: list[int] = []
    for column in zip(*(((1,) * (max(map(len, shapes)) - len(s)) + tuple(s)) for s in shapes)):
        sizes = {d for d in column if d != 1}
        if len(sizes) > 1:
            raise RuntimeError(f"shapes {shapes} cannot be broadcast together")
        out.append(sizes.pop() if sizes else 1)
    return tuple(out)


def _verify_elementwise(n: Node, metas: dict[str, TensorMeta | None]) -> None:
    _check(n.meta is not None, f"{n.name}: elementwise node without meta")
    shapes = [metas[i].shape for i in n.value_inputs() if metas.get(i) is not None]
    try:
        ok = broadcast_shape(*shapes, n.meta.shape) == n.meta.shape
    except RuntimeError:
        ok = False
    _check(ok, f"{n.name}: inputs {shapes} do not broadcast to {n.meta.shape}")


def _verify_body(owner: Node, metas: dict[str, TensorMeta | None]) -> None:
    local = dict(metas)
    if owner.op is Op.GEMM:
        local[owner.attrs["acc"]] = owner.attrs["acc_meta"]
    for b in owner.body:
        _check(b.op in ELEMENTWISE, f"{owner.name}: body node {b.name} is {b.op}, not elementwise")
        for i in b.value_inputs():
            _check(i in local, f"{owner.name}: body node {b.name} uses unbound {i}")
        _check(b.name not in local, f"{owner.name}: body value {b.name} bound twice")
        _verify_elementwise(b, local)
        _check(b.meta.shape == owner.meta.shape, f"{owner.name}: body {b.name} shape differs")
        local[b.name] = b.meta
    _check(owner.body[-1].name == owner.name, f"{owner.name}: body must end in the owner's value")


def _verify_cat(n: Node, metas: dict[str, TensorMeta | None]) -> None:
    dim, shapes = n.attrs["dim"], [metas[i].shape for i in n.inputs if metas.get(i) is not None]
    _check(len(shapes) == len(n.inputs), f"{n.name}: cat of a non-tensor")
    rest = [s[:dim] + s[dim + 1 :] for s in shapes]
    _check(all(r == n.meta.shape[:dim] + n.meta.shape[dim + 1 :] for r in rest), f"{n.name}: cat of {shapes}")
    _check(sum(s[dim] for s in shapes) == n.meta.shape[dim], f"{n.name}: cat sizes do not add up")


def _within(span: Any, base: Any) -> bool:
    """span <= base; where that depends on a generic program's sizes, its family's bounds keep
    it so (lowering/generic.py), and it passes here."""
    try:
        return span <= base
    except Exception:  # dims.Undecided: ir imports nothing of braze
        return True


def verify(graph: Graph) -> Graph:
    """Check single assignment, defined-before-use, and consistent shapes; return the graph."""
    metas: dict[str, TensorMeta | None] = {}
    for n in graph.nodes:
        _check(n.name not in metas, f"{n.name} is assigned twice")
        for i in n.value_inputs():
            _check(i in metas, f"{n.name} uses {i} before it is defined")
        if n.op in ELEMENTWISE:
            _verify_elementwise(n, metas)
        if n.body:
            _verify_body(n, metas)
        if n.op is Op.VIEW:
            src = metas[n.inputs[0]]
            _check(src is not None and _within(n.meta.span, src.span), f"{n.name}: view reaches past its base")
        if n.op is Op.CAT:
            _verify_cat(n, metas)
        if n.op is Op.COPY and isinstance(n.inputs[0], str):
            src = metas[n.inputs[0]]
            _check(src is not None and n.meta.shape == src.shape, f"{n.name}: copy changes shape")
        if "alias_of" in n.attrs:
            _check(n.attrs["alias_of"] in metas, f"{n.name} aliases {n.attrs['alias_of']}, not an earlier value")
        if n.op is Op.INPUT:
            _check(n.name in graph.inputs, f"{n.name} is an input missing from graph.inputs")
        metas[n.name] = n.meta
    for o in graph.outputs:
        _check(o in metas, f"output {o} is not defined")
    return graph
