"""ATen calls made from native code: a program whose ATen calls are all of ops in DISPATCHED keeps
a native body (no generated Python body between its segments, no Python frame per call).

Each call goes through ATen's stable C interface, the way a C++ extension calls an op:
`aoti_torch_call_dispatcher(op, overload, stack)`, a stack of one 8-byte word per argument of the
op's schema (a tensor handle, an int, a double's bits, a bool, a string's handle from
`torch_new_string_handle`; an optional's value behind a heap word from `torch_new_stable_ivalue`;
None as 0; a Python number where Python's binding passes it as a tensor, div's divisor and
pow's base, as a 0-dim tensor: `_number`). A Scalar is none of these: the dispatcher refuses it,
and such a call goes through the C shim's function for the op where SHIMS names one, else stays
in Python. Tensor arguments are handles made per call over the memory the table points at
(`aoti_torch_create_tensor_from_blob`, with the layout the program was compiled for; the
dispatcher consumes them). It is the same op, at the same dispatch key, with the same arguments
as the Python call would make: the same kernel, the same bits.

The result's layout (dtype, sizes, strides) is checked against the one compiled for; on a
mismatch, or an error the op raised, the run stops, sets the table's `failed` word, and the call
runs again through the program's Python body (runtime.Program._in_python), which raises what
eager raises, or goes stale and compiles again. A result's handle is freed after the last step
that reads it.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import llvmlite.ir as ll
import torch

from ..dims import Dim, Expr
from ..ir import Node, TensorMeta
from .loops import I32, I64, PTR, VOID, Access

# One row per op: the Python callables TorchDynamo and torch.fx record -> (schema name, overload).
DISPATCHED: dict[Any, tuple[str, str]] = {
    torch._C._nn.scaled_dot_product_attention: ("aten::scaled_dot_product_attention", ""),
    torch.gather: ("aten::gather", ""),
    torch.Tensor.gather: ("aten::gather", ""),
    torch.conv1d: ("aten::conv1d", ""),  # (padding by name: _conv_arguments)
    torch.conv2d: ("aten::conv2d", ""),
    torch._C._nn.gelu: ("aten::gelu", ""),  # F.gelu (where braze's kernel does not take it)
    torch._weight_norm: ("aten::_weight_norm", ""),  # (nn.utils.weight_norm's parametrization)
    torch.argmax: ("aten::argmax", ""),
    torch.Tensor.argmax: ("aten::argmax", ""),
    torch.softmax: ("aten::softmax", "int"),  # (where braze's kernel does not take it)
    torch.Tensor.softmax: ("aten::softmax", "int"),
    torch.nn.functional.unfold: ("aten::im2col", ""),  # (its arguments are the op's, in order)
    torch._C._nn.adaptive_avg_pool2d: ("aten::adaptive_avg_pool2d", ""),
    torch._C._nn.avg_pool2d: ("aten::avg_pool2d", ""),  # F.avg_pool2d
    torch.nn.functional.group_norm: ("aten::group_norm", ""),  # its checks: ATen's raise too (then eager's)
    torch.nn.functional.silu: ("aten::silu", ""),  # (inplace=True: another op, not dispatched)
    torch.roll: ("aten::roll", ""),
    torch.Tensor.roll: ("aten::roll", ""),
    torch.Tensor.repeat: ("aten::repeat", ""),
    torch.cumsum: ("aten::cumsum", ""),
    torch.Tensor.cumsum: ("aten::cumsum", ""),
    torch.mean: ("aten::mean", "dim"),  # (mean of all elements, the overload without dims: not dispatched)
    torch.Tensor.mean: ("aten::mean", "dim"),
    torch.repeat_interleave: ("aten::repeat_interleave", "self_int"),  # (repeats a tensor: not dispatched)
    torch.Tensor.repeat_interleave: ("aten::repeat_interleave", "self_int"),
    torch.adaptive_avg_pool1d: ("aten::adaptive_avg_pool1d", ""),
    operator.getitem: ("aten::index", "Tensor"),  # see _index_arguments
    torch.nn.functional.interpolate: ("aten::upsample_bilinear2d", "vec"),  # or nearest: _interpolate_arguments
    torch.div: ("aten::div", "Tensor"),  # (or "Tensor_mode": _div_arguments)
    torch.Tensor.div: ("aten::div", "Tensor"),
    torch.pow: ("aten::pow", "Tensor_Tensor"),  # (of a tensor or a number by a tensor: _pow_arguments)
    torch.Tensor.pow: ("aten::pow", "Tensor_Tensor"),
    operator.pow: ("aten::pow", "Tensor_Tensor"),
    torch.baddbmm: ("aten::baddbmm", ""),  # (its Scalars: through SHIMS)
    torch.Tensor.baddbmm: ("aten::baddbmm", ""),
    torch.matmul: ("aten::matmul", ""),  # of computed values only: see GRAD_SENSITIVE
    operator.matmul: ("aten::matmul", ""),
    torch.Tensor.matmul: ("aten::matmul", ""),
}

# Ops with Scalar arguments (which the dispatcher refuses) called through the C shim's function for
# their out= form: the result made first (as compiled), then the schema's arguments in order, each
# Scalar as a double (an int's value too: the kernels read it in the result's dtype). The shim
# runs the CPU kernel the dispatcher would (at::cpu::), without the dispatch.
SHIMS = {"aten::baddbmm": "aoti_torch_cpu_baddbmm_out"}

# Ops whose path in ATen depends on whether an operand requires grad: matmul folds a batch into
# one mm where one does (a parameter, even under no_grad), and sums in another order otherwise.
# The tensors native code passes never do, so these are called from native code only where no
# operand is the program's input or parameter (or a view of one); values it computes under
# no_grad, or from tensors none of which requires grad, do not require grad in eager either.
GRAD_SENSITIVE = frozenset({torch.matmul, operator.matmul, torch.Tensor.matmul})

Row = tuple[str, str]
Adapted = tuple[Row, tuple, dict]


def _index_arguments(row: Row, args: tuple, kwargs: dict) -> Adapted | str:
    """x[i], x[:, i], ... with integer index tensors of one or more dimensions: Python's indexing
    calls aten::index(x, indices), an index None for each full slice before the last tensor
    (torch/csrc/autograd/python_variable_indexing.cpp: applySlicing, then dispatch_index)."""
    src, idx = args
    indices: list = []
    for i in idx if type(idx) is tuple else (idx,):
        if isinstance(i, slice) and i.start is None and i.stop is None and i.step is None:
            indices.append(None)
        elif _tensor(i) and i.meta.dtype in (torch.int64, torch.int32) and i.meta.dim() >= 1:
            indices.append(i)  # (a 0-dim one selects, a view; a bool one's result has data-dependent sizes)
        else:
            return "indexing with other than full slices and integer tensors of one or more dimensions"
    while indices and indices[-1] is None:
        indices.pop()
    return (row, (src, indices), {}) if _tensor(src) and indices else "indexing without an index tensor"


def _repeat_arguments(row: Row, args: tuple, kwargs: dict) -> Adapted | str:
    """x.repeat(2, 3) is x.repeat((2, 3)): the op's one list of repeats."""
    src, *rest = args
    return (row, (src, rest[0] if len(rest) == 1 and isinstance(rest[0], (tuple, list)) else tuple(rest)), kwargs)


_INTERPOLATE = ("input", "size", "scale_factor", "mode", "align_corners", "recompute_scale_factor", "antialias")


def _interpolate_arguments(row: Row, args: tuple, kwargs: dict) -> Adapted | str:
    """F.interpolate of an image, "nearest" or "bilinear", by a size or by scale factors: the call
    its Python code makes, upsample_nearest2d(input, output_size, scale_factors) or
    upsample_bilinear2d(input, output_size, align_corners, scale_factors), one of the two None."""
    g = dict(zip(_INTERPOLATE, args)) | kwargs
    x, size, scale, mode = g["input"], g.get("size"), g.get("scale_factor"), g.get("mode", "nearest")
    if not (_tensor(x) and x.meta.dim() == 4 and mode in ("nearest", "bilinear") and (size is None) != (scale is None)):
        return "interpolation other than nearest or bilinear of an image by a size or a scale"
    if (
        g.get("recompute_scale_factor")
        or g.get("antialias")
        or (mode == "nearest" and g.get("align_corners") is not None)
    ):
        return "interpolation that recomputes its scale, antialiases, or that eager refuses"
    size, scale = (v if v is None or isinstance(v, (tuple, list)) else (v, v) for v in (size, scale))
    if any(v is not None and len(v) != 2 for v in (size, scale)):
        return "interpolation whose sizes or scales are not one per spatial dimension"
    size = None if size is None else list(size)
    scale = None if scale is None else [float(v) for v in scale]
    if mode == "nearest":
        return ("aten::upsample_nearest2d", "vec"), (x, size, scale), {}
    return row, (x, size, bool(g.get("align_corners") or False), scale), {}


def _conv_arguments(row: Row, args: tuple, kwargs: dict) -> Adapted:
    """conv1d / conv2d with padding "same" or "valid": the op's overload that takes it by name."""
    padding = args[4] if len(args) > 4 else kwargs.get("padding")
    return ((row[0], "padding") if isinstance(padding, str) else row), args, kwargs


def _div_arguments(row: Row, args: tuple, kwargs: dict) -> Adapted | str:
    """div(x, y) or div(x, y, rounding_mode=...): the overload Python's binding calls, a number y
    passed as a tensor (_number)."""
    given = dict(zip(("self", "other"), args)) | kwargs
    x, y, mode = given.pop("self", None), given.pop("other", None), given.pop("rounding_mode", ...)
    if given or not (_tensor(x) and (_tensor(y) or _number(y, x.meta.dtype))):
        return "a division whose operands are not a tensor and a tensor or a number of its kind"
    return ((row[0], "Tensor_mode"), (x, y), {"rounding_mode": mode}) if mode is not ... else (row, (x, y), {})


def _pow_arguments(row: Row, args: tuple, kwargs: dict) -> Adapted | str:
    """x ** y of a tensor y: pow(x, y) of two tensors; of a number x, the op Python's binding
    calls (pow.Scalar) is pow of the number as a tensor by y, but for x = 1 (then it fills with
    1). A number exponent is another op, pow.Tensor_Scalar (its own cases for 2, 0.5, ...)."""
    given = dict(zip(("self", "exponent"), args)) | kwargs
    x, y = given.pop("self", None), given.pop("exponent", None)
    if given or not _tensor(y):
        return "a power by other than a tensor"
    if not (_tensor(x) or (_number(x, y.meta.dtype) and x != 1)):
        return "a power of other than a tensor or a number of its exponent's kind (not 1)"
    return row, (x, y), {}


def _number(value: Any, dtype: torch.dtype) -> bool:
    """Whether a Python number can stand where div or pow takes a tensor, as a 0-dim tensor of
    its kind (int64, float64, bool: Arg "number"). Python's binding passes a "wrapped number",
    which takes no part in the result's dtype; a plain 0-dim tensor does only where its kind is
    above the other operand's (an int64 tensor divided by 2.5: float32 wrapped, float64 plain),
    so only a number no higher in kind than `dtype` stands for itself. The values are the same:
    the op reads either in the result's dtype."""
    if type(value) not in (bool, int, float):
        return False
    kinds = (bool, int, float)
    kind = 0 if dtype == torch.bool else 2 if dtype.is_floating_point else 1 if not dtype.is_complex else 3
    return kinds.index(type(value)) <= kind


def _as_given(row: Row, args: tuple, kwargs: dict) -> Adapted:
    """A call whose arguments are its op's, one for one."""
    return row, args, kwargs


# A Python call whose arguments are not the op's schema's, one for one: how they become it (and,
# for interpolate, which op it is).
ADAPTED = {
    operator.getitem: _index_arguments,
    torch.Tensor.repeat: _repeat_arguments,
    torch.nn.functional.interpolate: _interpolate_arguments,
    torch.conv1d: _conv_arguments,
    torch.conv2d: _conv_arguments,
    torch.div: _div_arguments,
    torch.Tensor.div: _div_arguments,
    torch.pow: _pow_arguments,
    torch.Tensor.pow: _pow_arguments,
    operator.pow: _pow_arguments,
}


def _tensor(value: Any) -> bool:
    return isinstance(getattr(value, "meta", None), torch.Tensor)


NULL = ll.Constant(PTR, None)


@dataclass(frozen=True)
class Arg:
    """One word of a call's stack: a tensor (`value` names it), None, a number (an int may be a
    generic program's size) or a string; `boxed`: an optional's value, through a heap word."""

    # "tensor", "none", "int", "float", "bool", "str", "ints", "floats" (tuples), "tensors" (names
    # or None), "number" (a Python number where the op takes a tensor: _number)
    kind: str
    value: Any = None
    boxed: bool = False


@dataclass(frozen=True)
class Call:
    op: str
    overload: str
    args: tuple[Arg, ...]
    shim: str = ""  # the C shim's function that runs it (SHIMS), else the dispatcher

    def tensors(self) -> list[str]:
        return [a.value for a in self.args if a.kind == "tensor"] + [
            t for a in self.args if a.kind == "tensors" for t in a.value if t is not None
        ]


def plan(n: Node, given: frozenset[str] = frozenset()) -> Call | str:
    """How EXTERN node n is called from native code, or why it is not. `given`: the values that
    are the program's inputs or parameters, or views of them."""
    fn = n.attrs["fn"]
    if fn not in DISPATCHED:
        return "native code calls no op of its kind"
    if fn in GRAD_SENSITIVE and given & set(n.value_inputs()):
        return "a matmul of an input or parameter (ATen's path depends on whether it requires grad)"
    if any(n.attrs.get(a) for a in ("memo", "mutates", "alias_of")):
        return "a memoized, mutating or aliasing call"
    if not isinstance(n.meta, TensorMeta) or n.attrs.get("store") != "extern":
        return "its result is not one tensor of its own"
    adapted = ADAPTED.get(fn, _as_given)(DISPATCHED[fn], n.attrs["args"], n.attrs["kwargs"])
    if isinstance(adapted, str):
        return adapted
    (op, overload), positional, keywords = adapted
    schema = getattr(getattr(torch.ops.aten, op.removeprefix("aten::")), overload or "default")._schema
    given = dict(zip((a.name for a in schema.arguments), positional))
    if len(positional) > len(schema.arguments) or given.keys() & keywords.keys():
        return "its arguments do not fit the op's schema"
    given.update(keywords)
    args = []
    shim = SHIMS.get(op, "")
    for a in schema.arguments:
        value = given.pop(a.name) if a.name in given else a.default_value if a.has_default_value() else ...
        scalar = shim and str(a.type) == "number" and type(value) in (int, float)  # (a Scalar)
        arg = Arg("float", float(value)) if scalar else _arg(str(a.type), value, a.N or 1)
        if arg is None or (shim and arg.kind not in ("tensor", "float")):
            return f"argument {a.name} ({a.type}) is not one native code passes"
        args.append(arg)
    if given:
        return "its arguments do not fit the op's schema"
    return Call(op, overload, tuple(args), shim)


def _arg(schema_type: str, value: Any, n: int) -> Arg | None:
    """The stack word of an argument of type `schema_type` (`n`: a list's length, where fixed)."""
    optional = schema_type.startswith("Optional[")
    inner = schema_type.removeprefix("Optional[").removesuffix("]") if optional else schema_type
    if inner == "List[int]" and value is not None:  # int[2] given one int means it twice, as in Python
        values = tuple(value) if isinstance(value, (tuple, list)) else (value,) * n
        if all(isinstance(v, (int, Expr)) and not isinstance(v, bool) for v in values):
            return Arg("ints", values, optional)
        return None
    if inner == "List[float]" and isinstance(value, list) and all(type(v) is float for v in value):
        return Arg("floats", tuple(value), optional)
    if inner == "List[Optional[Tensor]]" and isinstance(value, list) and all(v is None or _tensor(v) for v in value):
        return Arg("tensors", tuple(None if v is None else v.name for v in value))
    if value is None:
        return Arg("none") if optional else None
    if inner == "Tensor" and _tensor(value):
        return Arg("tensor", value.name, optional)
    if inner == "Tensor" and type(value) in (bool, int, float):  # (its adapter checked _number)
        return Arg("number", value, optional)
    if inner in ("int", "SymInt") and isinstance(value, (int, Expr)) and not isinstance(value, bool):
        return Arg("int", value, optional)
    if inner == "float" and isinstance(value, (int, float)) and not isinstance(value, bool):
        return Arg("float", float(value), optional)
    if inner == "bool" and isinstance(value, bool):
        return Arg("bool", value, optional)
    if inner == "str" and isinstance(value, str):
        return Arg("str", value, optional)
    return None


@dataclass
class Step:
    """One step of a native body: a segment's function, or an ATen call (node, plan, the table
    word its handle goes in); then the handles of the results nothing later reads are freed."""

    segment: ll.Function | None = None
    call: tuple[Node, Call, int] | None = None
    frees: tuple[int, ...] = ()


class CallEmitter:
    """Writes `{prefix}_run(table)`: the steps in order, the ATen calls between the segments."""

    def __init__(self, mb: Any, dtype_code: Any, cpu: int) -> None:
        self.mb, self.dtype_code, self.cpu = mb, dtype_code, cpu
        d = mb.declare
        self.dispatch = d("aoti_torch_call_dispatcher", I32, [PTR, PTR, PTR])
        self.from_blob = d("aoti_torch_create_tensor_from_blob", I32, [PTR, I64, PTR, PTR, I64, I32, I32, I32, PTR])
        self.boxed = d("torch_new_stable_ivalue", I32, [PTR])
        self.new_list = d("torch_new_list_reserve_size", I32, [I64, PTR])
        self.new_string = d("torch_new_string_handle", I32, [PTR, I64, PTR])
        self.push = d("torch_list_push_back", I32, [PTR, I64])
        self.delete = d("aoti_torch_delete_tensor_object", I32, [PTR])
        self.data_ptr = d("aoti_torch_get_data_ptr", I32, [PTR, PTR])
        self.empty = d("aoti_torch_empty_strided", I32, [I64, PTR, PTR, I32, I32, I32, PTR])
        # a number's 0-dim tensor, by its Python type: (its word's type, the function making it)
        byte, double = ll.IntType(8), ll.DoubleType()  # (C's bool: a byte)
        self.numbers = {
            bool: (byte, d("aoti_torch_scalar_to_tensor_bool", I32, [byte, PTR])),
            int: (I64, d("aoti_torch_scalar_to_tensor_int64", I32, [I64, PTR])),
            float: (double, d("aoti_torch_scalar_to_tensor_float64", I32, [double, PTR])),
        }

    def run(self, steps: list[Step], handles: list[int], failed: int) -> str:
        fn = ll.Function(self.mb.module, ll.FunctionType(VOID, [PTR]), f"{self.mb.prefix}_run")
        table = fn.args[0]
        b = ll.IRBuilder(fn.append_basic_block("entry"))
        fail = fn.append_basic_block("failed")
        for h in handles:
            b.store(NULL, self._word(b, table, h))
        for step in steps:
            if step.segment is not None:
                b.call(step.segment, [table])
            if step.call is not None:
                self._call(b, table, *step.call, fail)
            for h in step.frees:
                self._free(b, table, h)
        b.ret_void()
        b.position_at_end(fail)
        if handles:  # (else no call: no way here)
            b.store(ll.Constant(I64, 1), self._word(b, table, failed))
        for h in handles:  # (NULL: not made, or freed already)
            self._free(b, table, h)
        b.ret_void()
        return fn.name

    @staticmethod
    def _word(b: ll.IRBuilder, table: ll.Value, slot: int) -> ll.Value:
        return b.gep(table, [I64(slot)], source_etype=PTR)

    def _free(self, b: ll.IRBuilder, table: ll.Value, slot: int) -> None:
        word = self._word(b, table, slot)
        b.call(self.delete, [b.load(word, typ=PTR)])
        b.store(NULL, word)

    def _require(self, b: ll.IRBuilder, ok: ll.Value, fail: ll.Block) -> None:
        nxt = b.append_basic_block("ok")
        b.cbranch(ok, nxt, fail)
        b.position_at_end(nxt)

    def _call(self, b: ll.IRBuilder, table: ll.Value, n: Node, call: Call, handle: int, fail: ll.Block) -> None:
        kernel = n.attrs.get("exact_per_call")
        if call.shim:
            self._shim(b, table, n, call, handle, fail)
            return
        if kernel is None:
            self._dispatch(b, table, n, call, handle, fail)
            return
        from ..lowering.attention import arguments

        given = arguments(n.attrs["args"], n.attrs["kwargs"])
        with b.if_else(self._flash_sizes(b, table, given)) as (mine, aten):
            with mine:
                self._exact_attention(b, table, n, given, handle, kernel, fail)
            with aten:
                self._dispatch(b, table, n, call, handle, fail)

    def _flash_sizes(self, b: ll.IRBuilder, table: ll.Value, given: dict[str, Any]) -> ll.Value:
        """Whether this call's token counts (`given`: its arguments by name) are ones braze's
        kernel of ATen's flash attention reproduces: lowering/attention.flash_sizes_ok, on the
        same constants."""
        from ..lowering.attention import KEYS, MIN_BLOCK, QUERY_BLOCKS

        queries, keys = (self.mb.dim(b, table, self.mb.slot_of(given[a].name).meta.shape[2]) for a in ("query", "key"))
        big = lambda t: b.icmp_signed(">=", queries, I64(t))  # noqa: E731
        block = I64(QUERY_BLOCKS[-1][1])
        for start, size in reversed(QUERY_BLOCKS[:-1]):
            block = b.select(big(start), I64(size), block)
        rest = b.srem(queries, block)
        blocks = b.or_(b.icmp_signed("==", rest, I64(0)), b.icmp_signed(">=", rest, I64(MIN_BLOCK)))
        ok = b.and_(b.and_(big(MIN_BLOCK), blocks), b.icmp_signed(">=", keys, I64(KEYS[0])))
        return b.and_(ok, b.icmp_signed("<=", keys, I64(KEYS[1])))

    def _result(self, b: ll.IRBuilder, table: ll.Value, n: Node, handle: int, fail: ll.Block) -> ll.Value:
        """A new tensor laid out as node n's result (the layout compiled for), its handle in the
        call's word and its data in n's slot, as the call's result would be."""
        m = n.meta
        sizes, strides = self._shape(b, table, m.shape), self._shape(b, table, m.stride)
        dtype, cpu = I32(self.dtype_code(m.dtype)), I32(self.cpu)
        result = self._made(b, self.empty, [I64(len(m.shape)), sizes, strides, dtype, cpu, I32(0)], fail)
        self._keep(b, table, n, result, handle)
        return result

    def _keep(self, b: ll.IRBuilder, table: ll.Value, n: Node, result: ll.Value, handle: int) -> None:
        """Node n's result: its handle in the call's word, its data in n's slot."""
        b.store(result, self._word(b, table, handle))
        b.call(self.data_ptr, [result, self._word(b, table, self.mb.slot_of(n.name).slot)])

    def _made(self, b: ll.IRBuilder, fn: ll.Function, args: list[ll.Value], fail: ll.Block) -> ll.Value:
        """What fn(*args, &out) makes (it returns 0 where it made it), as a pointer."""
        with b.goto_entry_block():
            out = b.alloca(PTR)
        self._ok(b, b.call(fn, [*args, out]), fail)
        return b.load(out, typ=PTR)

    def _ok(self, b: ll.IRBuilder, code: ll.Value, fail: ll.Block) -> None:
        """On to `fail` unless a shim function's return code is 0."""
        self._require(b, b.icmp_signed("==", code, I32(0)), fail)

    def _boxed(self, b: ll.IRBuilder, word: ll.Value, fail: ll.Block) -> ll.Value:
        """A new heap word holding `word` (an optional's value), as a stack word."""
        box = self._made(b, self.boxed, [], fail)
        b.store(word, box)
        return b.ptrtoint(box, I64)

    def _shim(self, b: ll.IRBuilder, table: ll.Value, n: Node, call: Call, handle: int, fail: ll.Block) -> None:
        """The call through its C shim function (SHIMS): into a result made first, the tensor
        arguments as handles it does not consume (deleted after it returns)."""
        result = self._result(b, table, n, handle, fail)
        words, types, made = [result], [PTR], []
        for a in call.args:
            if a.kind == "float":
                words.append(ll.Constant(ll.DoubleType(), a.value))
                types.append(ll.DoubleType())
            else:
                made.append(b.inttoptr(self._tensor(b, table, self.mb.slot_of(a.value), fail), PTR))
                words.append(made[-1])
                types.append(PTR)
        code = b.call(self.mb.declare(call.shim, I32, types), words)
        for h in made:
            b.call(self.delete, [h])
        self._ok(b, code, fail)

    def _exact_attention(
        self, b: ll.IRBuilder, table: ll.Value, n: Node, given: dict, handle: int, kernel: dict, fail: ll.Block
    ) -> None:
        """braze's kernel in place of ATen's call (`given`: its arguments by name): its result
        made as ATen lays it out (the layout compiled for), the handle in the call's word, as the
        call's would be."""
        self._result(b, table, n, handle, fail)
        slot = self.mb.slot_of(n.name)
        operands = [self.mb.slot_of(given[a].name) for a in ("query", "key", "value")] + [slot]
        mask = self.mb.slot_of(given["attn_mask"].name) if kernel["mask"] else None
        self.mb.attention(b, table, operands, mask, {"exact": True, **kernel})

    def _dispatch(self, b: ll.IRBuilder, table: ll.Value, n: Node, call: Call, handle: int, fail: ll.Block) -> None:
        with b.goto_entry_block():
            stack = b.alloca(I64, size=I64(max(len(call.args), 1)))
        for i, a in enumerate(call.args):
            value = self._value(b, table, a, fail)
            value = self._boxed(b, value, fail) if a.boxed else value
            b.store(value, b.gep(stack, [I64(i)], source_etype=I64))
        op = self.mb.cstring(f"aten_op_{call.op}", call.op)
        overload = self.mb.cstring(f"aten_ov_{call.op}", call.overload)
        self._ok(b, b.call(self.dispatch, [op, overload, stack]), fail)
        result = b.inttoptr(b.load(stack, typ=I64), PTR)
        self._keep(b, table, n, result, handle)
        self._check(b, table, result, n.meta, fail)

    def _value(self, b: ll.IRBuilder, table: ll.Value, a: Arg, fail: ll.Block) -> ll.Value:
        if a.kind == "none":
            return I64(0)
        if a.kind == "float":
            return b.bitcast(ll.Constant(ll.DoubleType(), a.value), I64)
        if a.kind == "bool":
            return I64(int(a.value))
        if a.kind == "int":
            return self.mb.dim(b, table, a.value)
        if a.kind == "ints":
            return self._list(b, [self.mb.dim(b, table, v) for v in a.value], fail)
        if a.kind == "floats":
            return self._list(b, [b.bitcast(ll.Constant(ll.DoubleType(), v), I64) for v in a.value], fail)
        if a.kind == "tensors":
            return self._optional_tensors(b, table, a.value, fail)
        if a.kind == "str":
            return self._string(b, a.value, fail)
        if a.kind == "number":
            return self._number(b, a.value, fail)
        return self._tensor(b, table, self.mb.slot_of(a.value), fail)

    def _list(self, b: ll.IRBuilder, words: list[ll.Value], fail: ll.Block) -> ll.Value:
        """A new list of ints or doubles, given as stack words (the dispatcher consumes it)."""
        handle = self._made(b, self.new_list, [I64(len(words))], fail)
        for word in words:
            self._ok(b, b.call(self.push, [handle, word]), fail)
        return b.ptrtoint(handle, I64)

    def _string(self, b: ll.IRBuilder, text: str, fail: ll.Block) -> ll.Value:
        """A new string's handle (the dispatcher consumes it)."""
        data = text.encode()
        chars = self.mb.cstring(f"aten_str_{data.hex()}", text)
        return b.ptrtoint(self._made(b, self.new_string, [chars, I64(len(data))], fail), I64)

    def _number(self, b: ll.IRBuilder, value: bool | int | float, fail: ll.Block) -> ll.Value:
        """A new 0-dim tensor's handle holding a number (the dispatcher consumes it)."""
        kind, make = self.numbers[type(value)]
        word = kind(int(value) if type(value) is bool else value)  # (llvmlite prints a bool as i1's)
        return b.ptrtoint(self._made(b, make, [word], fail), I64)

    def _optional_tensors(self, b: ll.IRBuilder, table: ll.Value, names: tuple, fail: ll.Block) -> ll.Value:
        """A new list of optional tensors (the dispatcher consumes it): None as 0, a tensor as a
        heap word holding its new handle."""
        handle = self._made(b, self.new_list, [I64(len(names))], fail)
        for name in names:
            word = I64(0)
            if name is not None:
                word = self._boxed(b, self._tensor(b, table, self.mb.slot_of(name), fail), fail)
            self._ok(b, b.call(self.push, [handle, word]), fail)
        return b.ptrtoint(handle, I64)

    def _shape(self, b: ll.IRBuilder, table: ll.Value, values: tuple[Dim, ...]) -> ll.Value:
        with b.goto_entry_block():
            arr = b.alloca(I64, size=I64(max(len(values), 1)))
        for k, v in enumerate(values):
            b.store(self.mb.dim(b, table, v), b.gep(arr, [I64(k)], source_etype=I64))
        return arr

    def _tensor(self, b: ll.IRBuilder, table: ll.Value, acc: Access, fail: ll.Block) -> ll.Value:
        """A new handle of a tensor over the memory the access names, laid out as compiled."""
        m = acc.meta
        base = b.load(self._word(b, table, acc.slot), typ=PTR)
        offset = b.mul(self.mb.dim(b, table, m.offset), I64(m.dtype.itemsize))
        data = b.gep(base, [offset], source_etype=ll.IntType(8))
        sizes, strides = self._shape(b, table, m.shape), self._shape(b, table, m.stride)
        dtype, cpu = I32(self.dtype_code(m.dtype)), I32(self.cpu)
        args = [data, I64(len(m.shape)), sizes, strides, I64(0), dtype, cpu, I32(0)]
        return b.ptrtoint(self._made(b, self.from_blob, args, fail), I64)

    def _check(self, b: ll.IRBuilder, table: ll.Value, h: ll.Value, meta: TensorMeta, fail: ll.Block) -> None:
        """The result is laid out as compiled: dtype, dimensions, sizes and strides."""
        d = self.mb.declare
        with b.goto_entry_block():
            word = b.alloca(I64)
        b.store(I64(0), word)  # the getters write an int32 into it
        b.call(d("aoti_torch_get_dtype", I32, [PTR, PTR]), [h, word])
        self._require(b, b.icmp_signed("==", b.load(word, typ=I64), I64(self.dtype_code(meta.dtype))), fail)
        b.call(d("aoti_torch_get_dim", I32, [PTR, PTR]), [h, word])
        self._require(b, b.icmp_signed("==", b.load(word, typ=I64), I64(len(meta.shape))), fail)
        for getter, values in (("aoti_torch_get_sizes", meta.shape), ("aoti_torch_get_strides", meta.stride)):
            b.call(d(getter, I32, [PTR, PTR]), [h, word])
            have = b.load(word, typ=PTR)
            for k, v in enumerate(values):
                got = b.load(b.gep(have, [I64(k)], source_etype=I64), typ=I64)
                self._require(b, b.icmp_signed("==", got, self.mb.dim(b, table, v)), fail)
