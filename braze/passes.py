"""Stage 3, passes: pure functions Graph -> Graph, run in order by a tiny pass manager.

PIPELINE lists them; the manager records each pass's name and milliseconds (compile time is a
product feature) and, in tests or debug mode, runs ir.verify after every pass.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch.utils import _pytree as pytree

from . import config, dims
from .dims import Dim, Expr
from .ir import ELEMENTWISE, Graph, Node, Op, TensorMeta, contiguous_strides, verify

Pass = Callable[[Graph], Graph]


@dataclass
class PassRecord:
    name: str
    ms: float
    graph: Graph


@dataclass
class PassLog:
    records: list[PassRecord] = field(default_factory=list)

    def timings(self) -> list[tuple[str, float]]:
        return [(r.name, r.ms) for r in self.records]


def run_passes(graph: Graph, passes: Sequence[Pass] | None = None, check: bool | None = None) -> tuple[Graph, PassLog]:
    """Run `passes` (default PIPELINE) over `graph`; verify after each when `check` or debug."""
    check = config.verify or config.debug > 0 if check is None else check
    log = PassLog()
    if check:
        verify(graph)
    for p in PIPELINE if passes is None else passes:
        t0 = time.perf_counter()
        graph = p(graph)
        ms = (time.perf_counter() - t0) * 1e3
        if check:
            verify(graph)
        log.records.append(PassRecord(p.__name__, ms, graph))
    return graph, log


def _constant(n: Node) -> bool:
    """A tensor factory of constants (no size of the call among them): it ran when lowering, so it
    runs at every call, and it makes nothing but its result."""
    args = pytree.tree_leaves((n.attrs["args"], n.attrs["kwargs"]))
    return n.attrs.get("factory", False) and not any(isinstance(v, Expr) for v in args)


def dce(graph: Graph) -> Graph:
    """Drop pure nodes whose value nobody uses. EXTERN nodes stay (they may draw random numbers,
    or raise eager's error), except tensor factories of constants."""
    live = set(graph.outputs) | set(graph.inputs)
    kept: list[Node] = []
    for n in reversed(graph.nodes):
        if n.name in live or (n.op is Op.EXTERN and not _constant(n)):
            kept.append(n)
            live.update(n.value_inputs())
    return dataclasses.replace(graph, nodes=tuple(reversed(kept)))


# Besides the elementwise ops, those whose result follows from their operands and attributes
# alone (each computes it in the same order at every call)
_REPEATABLE = frozenset({Op.VIEW, Op.VML, Op.ACTIVATION, Op.LAYER_NORM, Op.SOFTMAX, Op.SUM})


def cse(graph: Graph) -> Graph:
    """Make each value of a pure op once: a node that repeats an earlier one (the same op,
    operands, attributes and layout) reads that one's value instead (T5 copied its position bias
    into the attention's layout again in every layer). Not across an ATen call that changes a
    value in place (the two could read different contents), not for a graph output (eager
    returns distinct tensors, which the caller may change apart), nor for a value an ATen call
    reads (its arguments name their values in its attrs)."""
    across, outputs, users = _changes_between(graph), set(graph.outputs), graph.users()
    seen: dict[tuple, str] = {}
    same: dict[str, str] = {}  # a repeat -> the node it repeats
    nodes = []
    for n in graph.nodes:
        if any(i in same for i in n.value_inputs()):
            n = dataclasses.replace(n, inputs=tuple(same.get(i, i) if isinstance(i, str) else i for i in n.inputs))
        pure = n.op in ELEMENTWISE or n.op in _REPEATABLE
        if pure and not any(isinstance(v, torch.Tensor) for v in n.attrs.values()):  # (a tensor's repr elides)
            key = (n.op, n.inputs, n.meta, repr(sorted(n.attrs.items())))
            first = seen.get(key)
            free = n.name not in outputs and all(u.op is not Op.EXTERN for u in users[n.name])
            if first is not None and free and not across(first, n.name):
                same[n.name] = first
                continue
            seen[key] = n.name
        nodes.append(n)
    return dataclasses.replace(graph, nodes=tuple(nodes)) if same else graph


def _fusable_into(p: Node, n: Node, users: dict[str, list[Node]], outputs: set[str]) -> bool:
    only_n = all(u is n for u in users[p.name])
    return p.op in ELEMENTWISE and only_n and p.name not in outputs and p.meta.shape == n.meta.shape


def _changes_between(graph: Graph) -> Callable[[str, str], bool]:
    """across(a, b): whether an ATen call between nodes a and b changes a value in place. Fusion
    moves a producer's loop down to its consumer, and an epilogue's up to its GEMM: across such
    a call the loop would read what the call changed (or the call what the loop had not yet
    written), where eager's order reads it before."""
    at = {n.name: i for i, n in enumerate(graph.nodes)}
    changing = [i for i, n in enumerate(graph.nodes) if n.attrs.get("mutates")]
    return lambda a, b: any(at[a] < i < at[b] for i in changing)


def fuse_elementwise(graph: Graph) -> Graph:
    """Group chains and trees of elementwise nodes into FUSED nodes (one loop each).

    A producer joins its consumer's loop when the consumer is its only user, it is not a graph
    output, and both iterate over the same shape, so the value never touches memory.
    """
    users, outputs = graph.users(), set(graph.outputs)
    across = _changes_between(graph)
    group: dict[str, list[Node]] = {}
    for n in graph.nodes:
        if n.op not in ELEMENTWISE:
            continue
        members: list[Node] = []
        for p in dict.fromkeys(n.value_inputs()):
            prod = next(x for x in graph.nodes if x.name == p)
            if p in group and _fusable_into(prod, n, users, outputs) and not across(p, n.name):
                members += group.pop(p)
        group[n.name] = members + [n]
    absorbed = {m.name for body in group.values() for m in body[:-1]}
    nodes = []
    for n in graph.nodes:
        if n.name in absorbed:
            continue
        nodes.append(_fused(group[n.name]) if n.name in group else n)
    return dataclasses.replace(graph, nodes=tuple(nodes))


def _fused(body: list[Node]) -> Node:
    inner = {b.name for b in body}
    ext = dict.fromkeys(i for b in body for i in b.value_inputs() if i not in inner)
    last = body[-1]
    return Node(last.name, Op.FUSED, tuple(ext), last.meta, {"body": tuple(body)})


def fuse_rms_norm(graph: Graph) -> Graph:
    """Fast mode: the RMSNorm that Llama's and T5's layers write op by op, x * rsqrt(mean(x * x,
    -1, keepdim=True) + eps), times a weight or not, as one row kernel (Op.RMS_NORM), where the
    squares, the mean, the rsqrt and the products were four passes over the rows (T5 encoder
    and Llama: nine a call). Each step is rounded as eager's ops round it, but the sum of
    squares, reassociated as fast mode's reductions may be. Only where every value in between
    is used by the next step alone, and x's rows and the result are contiguous."""
    users, outputs, nodes = graph.users(), set(graph.outputs), graph.node_map()
    found: dict[str, tuple[Node, set[str]]] = {}  # last node's name -> (RMS_NORM, names it replaces)
    for s in graph.nodes:
        if s.op is Op.SUM and s.attrs.get("mean"):
            match = _rms_norm(s, nodes, lambda n: None if n.name in outputs else _sole_user(n, users))
            if match is not None:
                found[match[0].name] = match
    if not found:
        return graph
    gone = set().union(*(names for _, names in found.values()))
    kept = [found[n.name][0] if n.name in found else n for n in graph.nodes if n.name in found or n.name not in gone]
    return dataclasses.replace(graph, nodes=tuple(kept))


def _rms_norm(s: Node, nodes: dict[str, Node], sole: Callable[[Node], Node | None]) -> tuple[Node, set[str]] | None:
    """The RMS_NORM of the chain from mean `s` (mul(x, x) -> s -> its keepdim view -> add eps ->
    rsqrt -> mul by x -> mul by a weight of n floats, optionally), and the chain's names; None
    where it is not that chain."""
    square = nodes.get(s.inputs[0])
    if square is None or square.op is not Op.MUL or square.inputs[0] != square.inputs[1] or sole(square) is not s:
        return None
    x, n = nodes[square.inputs[0]], s.attrs["n"]
    view = sole(s)
    add = view and view.op is Op.VIEW and view.meta.shape == (*s.meta.shape, 1) and sole(view)
    eps = add and add.op is Op.ADD and [i for i in add.inputs if i != view.name]
    if not (eps and len(eps) == 1 and isinstance(eps[0], float)):
        return None
    root = sole(add)
    scaled = root and root.op is Op.RSQRT and sole(root)
    if not (scaled and scaled.op is Op.MUL and sorted(scaled.inputs) == sorted((x.name, root.name))):
        return None
    chain, last, weight = [square, s, view, add, root], scaled, None
    after = sole(scaled)
    other = after and after.op is Op.MUL and [i for i in after.inputs if i != scaled.name]
    if other and len(other) == 1 and isinstance(other[0], str):
        w = nodes[other[0]].meta
        if w is not None and w.dtype == torch.float32 and w.numel == n and w.stride[-1] == 1 and w.shape[-1] == n:
            chain, last, weight = [*chain, scaled], after, other[0]
    if x.meta.shape != last.meta.shape or x.meta.shape[-1] != n or not isinstance(n, int):
        return None
    if not all(m.dtype == torch.float32 and m.stride == contiguous_strides(m.shape) for m in (x.meta, last.meta)):
        return None
    node = Node(last.name, Op.RMS_NORM, (x.name, weight), last.meta, {"n": n, "rows": s.attrs["rows"], "eps": eps[0]})
    return node, {c.name for c in chain}


def fuse_epilogue(graph: Graph) -> Graph:
    """Run a FUSED consumer of a GEMM in place on the GEMM's output, right after the BLAS call.

    Allowed when the loop is the GEMM value's only user and writes the same layout, so each
    element is read and written at the same address while it is still in cache; also through
    a reshape of that output (a Linear of [B, T, D] is a GEMM of [B*T, D] viewed as [B, T, N]),
    whose elements lie at the same addresses: the loop then reads the view.
    """
    users, outputs = graph.users(), set(graph.outputs)
    across = _changes_between(graph)
    fold: dict[str, tuple[Node, Node]] = {}  # FUSED name -> (GEMM it absorbs, value it reads)
    for n in graph.nodes:
        if n.op is not Op.GEMM or n.body or n.name in outputs:
            continue
        acc, user = n, _sole_user(n, users)
        if user is not None and _reshape_of(n, user) and user.name not in outputs:
            acc, user = user, _sole_user(user, users)
        if user is not None and user.op is Op.FUSED and user.meta == acc.meta and not across(n.name, user.name):
            fold[user.name] = (n, acc)
    if not fold:
        return graph
    gone = {name for g, acc in fold.values() for name in (g.name, acc.name)}
    nodes = []
    for n in graph.nodes:
        if n.name in gone:
            continue
        if n.name in fold:
            g, acc = fold[n.name]
            extra = tuple(i for i in n.inputs if i != acc.name)
            attrs = {**g.attrs, "gemm_meta": g.meta, "acc": acc.name, "acc_meta": acc.meta, "body": n.body}
            n = Node(n.name, Op.GEMM, g.inputs + extra, n.meta, attrs)
        nodes.append(n)
    return dataclasses.replace(graph, nodes=tuple(nodes))


def _sole_user(n: Node, users: dict[str, list[Node]]) -> Node | None:
    us = users[n.name]
    return us[0] if us and all(u is us[0] for u in us) else None


def _reshape_of(g: Node, v: Node) -> bool:
    """Whether view v shows all of g's elements at their own addresses: g contiguous from offset
    0, v dense over the same memory (a reshape of g, or a permutation of one: a channels-last
    1 x 1 convolution's product of pixel rows seen as [N, C, H, W])."""
    contiguous = lambda m: m.offset == 0 and m.stride == contiguous_strides(m.shape)  # noqa: E731
    return v.op is Op.VIEW and v.meta.numel == g.meta.numel and contiguous(g.meta) and _dense(v.meta)


def _dense(m: TensorMeta) -> bool:
    """Whether m's elements fill its memory from offset 0 without gaps or overlaps, in any order."""
    if m.offset != 0 or not all(isinstance(d, int) for d in (*m.shape, *m.stride)):
        return m.offset == 0 and m.stride == contiguous_strides(m.shape)
    step = 1
    for stride, size in sorted((s, d) for d, s in zip(m.shape, m.stride) if d != 1):
        if stride != step:
            return False
        step *= size
    return True


def _owner(n: Node, by_name: dict[str, Node]) -> str:
    """The value whose memory `n` lives in (itself, or a view's base)."""
    while n.op is Op.VIEW or "alias_of" in n.attrs:
        n = by_name[n.inputs[0] if n.op is Op.VIEW else n.attrs["alias_of"]]
    return n.name


def plan_memory(graph: Graph) -> Graph:
    """Say where every value lives: attrs['store'] is one of
    'arg' / 'param' (given each call), 'out' (fresh tensor per call: it is returned),
    'extern' (an ATen call returns it, maybe a view of another value), 'alias' (a VIEW: base +
    metadata), or ('tmp', k): scratch
    buffer k, kept across calls and shared by values whose lifetimes do not overlap.
    An elementwise loop writes over an input that dies there when the layouts match.
    """
    by_name = graph.node_map()
    owner = {n.name: _owner(n, by_name) for n in graph.nodes}
    returned = {owner[o] for o in graph.outputs}
    last_use: dict[str, int] = {}
    for i, n in enumerate(graph.nodes):
        for v in n.value_inputs():
            last_use[owner[v]] = i
    for o in returned:
        last_use[o] = len(graph.nodes)
    free: list[tuple[int, int]] = []  # (bytes, buffer id)
    sizes: list[int] = []
    held: dict[str, int] = {}
    out_nodes = []
    for i, n in enumerate(graph.nodes):
        if n.op in (Op.INPUT, Op.PARAM):
            store: object = n.op.value
        elif n.op is Op.EXTERN:
            store = "extern"  # even when it aliases: its data pointer is read at run time
        elif owner[n.name] != n.name:
            store = "alias"
        elif n.name in returned:
            store = "out"
        else:
            dying = [v for v in _overwritable(n, i, by_name, owner, last_use) if v in held]
            store = ("tmp", _take(n, dying, held, free, sizes))
            held[n.name] = store[1]
        out_nodes.append(dataclasses.replace(n, attrs={**n.attrs, "store": store}))
        for v in {owner[x] for x in n.value_inputs()}:
            if last_use.get(v) == i and v in held:
                free.append((sizes[held[v]], held.pop(v)))
    return dataclasses.replace(graph, nodes=tuple(out_nodes))


def _overwritable(n: Node, i: int, by_name: dict, owner: dict, last_use: dict) -> list[str]:
    """Inputs an elementwise loop may write over: values owning their memory, dying here, laid
    out as the loop's output, and read by the loop through no other view (a transposed view of
    the buffer being overwritten would read elements already written)."""
    if n.op is not Op.FUSED:
        return []
    out = []
    for v in dict.fromkeys(n.value_inputs()):
        same = owner[v] == v and last_use.get(v) == i and by_name[v].meta == n.meta
        if same and all(owner[u] != v or u == v for u in n.value_inputs()):
            out.append(v)
    return out


def _nbytes(meta: TensorMeta) -> int:
    return max(meta.span, 1) * meta.dtype.itemsize


def _take(n: Node, dying: list[str], held: dict, free: list, sizes: list) -> int:
    """A scratch buffer for `n`: a dying input's (in place), else the smallest free one that fits,
    else a new one."""
    need = _nbytes(n.meta)
    if dying:
        buf = held.pop(dying[0])
        sizes[buf] = max(sizes[buf], need)
        return buf
    fits = sorted(((b, k) for b, k in free if _holds(b, need)), key=lambda f: (dims.typical(f[0]), f[1]))
    if fits:
        free.remove(fits[0])
        return fits[0][1]
    sizes.append(need)
    return len(sizes) - 1


def _holds(size: Dim, need: Dim) -> bool:
    """A buffer of `size` bytes holds `need` bytes at every size a generic program admits."""
    try:
        return size >= need
    except dims.Undecided:  # at some sizes only: a buffer of its own
        return False


def memoize(graph: Graph) -> Graph:
    """Mark attrs['memo'] on the ATen calls whose results follow from the call's sizes alone
    (lowering marks them `sizes`: deterministic calls of sizes, constants and such results, as
    Hugging Face's causal masks, position ids and T5's position buckets). The program keeps them
    per sizes instead of making them at every call (runtime.py); none may be returned, or a view
    of what is, or be changed in place, but by a call of the sizes alone that is the only reader
    of what it changes (T5's `buckets += torch.where(...)`): made once per sizes, then, as well."""
    by_name = graph.node_map()
    owner = {n.name: _owner(n, by_name) for n in graph.nodes}
    users = graph.users()
    barred = {owner[o] for o in graph.outputs}
    barred |= {
        owner[v]
        for n in graph.nodes
        for v in n.attrs.get("mutates", ())
        if not (n.attrs.get("sizes") and owner[v] == v and [u.name for u in users[v]] == [n.name])
    }
    while True:  # (a change made at every call must not change a kept value: bar it, and again)
        memo = _memoizable(graph, owner, barred)
        unkept = {owner[v] for n in graph.nodes if n.name not in memo for v in n.attrs.get("mutates", ())}
        if not unkept - barred:
            break
        barred |= unkept
    nodes = (
        dataclasses.replace(n, attrs={**n.attrs, "memo": True}) if n.op is Op.EXTERN and n.name in memo else n
        for n in graph.nodes
    )
    return dataclasses.replace(graph, nodes=tuple(nodes))


def _memoizable(graph: Graph, owner: dict[str, str], barred: set[str]) -> set[str]:
    """The ATen calls of the sizes alone (and views of them) whose memory is not barred, and
    whose inputs are such calls too."""
    memo: set[str] = set()
    for n in graph.nodes:
        known = all(v in memo for v in n.value_inputs())
        if n.op is Op.VIEW and known:
            memo.add(n.name)
        elif n.op is Op.EXTERN and known and n.attrs.get("sizes") and owner[n.name] not in barred:
            memo.add(n.name)
    return memo


def attention_per_call(graph: Graph) -> Graph:
    """ATen's calls of scaled_dot_product_attention in a program generic in its sizes, marked
    (attrs["exact_per_call"]: the kernel's scale, causality and mask) where braze's kernel of ATen's
    flash attention may run in their place at the sizes a call brings (lowering/attention.per_call:
    its probes); the native body checks those sizes per call (codegen/calls.py). (A program of
    fixed sizes has the kernel in place of the call already, where it can.)"""
    from .lowering import attention  # (its rules and probes)

    by_name = {n.name: n for n in graph.nodes}
    nodes = []
    for n in graph.nodes:
        generic = isinstance(n.meta, TensorMeta) and any(isinstance(d, Expr) for d in n.meta.shape)
        if n.op is Op.EXTERN and generic and n.attrs.get("fn") is torch._C._nn.scaled_dot_product_attention:
            given = attention.arguments(n.attrs["args"], n.attrs["kwargs"])
            metas = {v: by_name[v].meta for v in n.value_inputs() if isinstance(by_name[v].meta, TensorMeta)}
            kernel = attention.per_call(given, metas, n.meta)
            if kernel is not None:
                n = dataclasses.replace(n, attrs={**n.attrs, "exact_per_call": kernel})
        nodes.append(n)
    return dataclasses.replace(graph, nodes=tuple(nodes))


PIPELINE: tuple[Pass, ...] = (dce, cse, memoize, attention_per_call, fuse_elementwise, fuse_epilogue, plan_memory)
# Fast mode's: fuse_rms_norm before the elementwise ops it replaces are fused with others
FAST_PIPELINE: tuple[Pass, ...] = (
    dce,
    cse,
    memoize,
    attention_per_call,
    fuse_rms_norm,
    fuse_elementwise,
    fuse_epilogue,
    plan_memory,
)
