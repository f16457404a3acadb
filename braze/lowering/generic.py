"""Shape-generic lowering: one IR graph for a family of shapes, its sizes polynomials of symbols.

Lowering runs ops on real tensors, which gives eager's layouts (and errors) exactly but only for
one shape. `lower_generic` lowers the graph at a grid of values of the symbols (each symbol a
dimension of the arguments that changed between calls), requires every lowering to make the
same IR apart from its integers, fits each integer that varies as a polynomial (dims.fit), and
checks the fit at the shapes the wrapper has seen and at the smallest sizes the program is to
admit. Lowering's own decisions that depend on sizes (BLAS arguments, ATen's size-1 special
cases, bmm's small-matrix path) then either hold for the whole family or show up as a
difference that makes the family smaller or the program specialised.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .. import config, dims
from ..capture import Captured
from ..dims import Undecided
from ..ir import Graph, Node, Op, TensorMeta
from .core import Lowered, Sym, lower
from .gemm import one_thread_sizes, own_kernel

# Where a symbol is read: (argument position, dimension), or (position, -1) for an int argument
# (TorchDynamo passes its symbolic sizes to a graph as ints).
Place = tuple[int, int]


def size_at(args: Sequence[Any], place: Place) -> Any:
    i, d = place
    return args[i] if d < 0 else args[i].shape[d]


@dataclass(frozen=True)
class Family:
    """The symbols of a generic program: where each is read, and its smallest admitted value."""

    places: tuple[tuple[Place, ...], ...]  # per symbol, every argument dimension that holds it
    lo: tuple[int, ...]
    hi: tuple[int, ...] = ()  # the largest value of each symbol (a view of a fixed buffer: BERT's
    # position ids sliced to the sequence length), NO_LIMIT where none

    def values(self, args: Sequence[Any]) -> tuple[int, ...] | None:
        """Each symbol's value in a call, or None if the call is outside the family (a symbol
        below its bound, or two places of one symbol differing)."""
        out = []
        tensors = {i for places in self.places for i, d in places if d >= 0}
        if not all(isinstance(args[i], torch.Tensor) and args[i].is_contiguous() for i in tensors):
            return None
        for places, lo, hi in zip(self.places, self.lo, self.hi or (NO_LIMIT,) * len(self.lo)):
            sizes = {size_at(args, p) for p in places}
            if len(sizes) != 1 or type(min(sizes)) is not int or not lo <= min(sizes) <= hi:
                return None
            out.append(sizes.pop())
        return tuple(out)


class NotGeneric(Exception):
    """The graph's lowering differs between shapes of the family other than by its sizes."""


def lower_generic(
    captured: Captured, args: tuple[Any, ...], places: Sequence[Sequence[Place]], seen: Sequence[Sequence[int]]
) -> tuple[Lowered, Family]:
    """Lower for every call whose arguments are laid out like `args` but for the sizes at
    `places` (one list per symbol); `seen` lists the values of the symbols in calls so far (one
    tuple per call). Raises NotGeneric with the reason when no polynomial family fits.

    The grid starts at the smallest sizes (2, 3, 4), where each lowering runs the model on the
    smallest examples: BERT's first call spent 474 ms lowering at its own sizes and up. Where a
    size-dependent choice of lowering differs there (bmm's path for small matrices), the grid
    starts at the smallest sizes seen instead; then, for two symbols, at a grid that keeps
    their order in this call (_ordered)."""
    if not all(args[i].is_contiguous() for ps in places for i, d in ps if d >= 0):
        raise NotGeneric("an argument of changing size is not contiguous")
    runs: dict[tuple[int, ...], tuple[Any, list[int], Lowered]] = {}
    smallest_seen = [max(min(p[j] for p in seen), 2) for j in range(len(places))]
    *first, last = dict.fromkeys([(2,) * len(places), tuple(smallest_seen), *_ordered(args, places)])
    for starts in first:
        try:
            return _fit(captured, args, places, seen, list(starts), runs)
        except (NotGeneric, Undecided):
            pass
    return _fit(captured, args, places, seen, list(last), runs)


def _ordered(args: tuple[Any, ...], places: Sequence[Sequence[Place]]) -> list[tuple[int, ...]]:
    """Two symbols of different sizes in this call: a grid that keeps the larger one larger (it
    grows from its size, the other shrinks to its own). A decode step of Hugging Face's generate
    reads its padding mask (the whole sequence's length) at positions up to the cache's length,
    which the mask's exceeds: at the sizes of a grid where the cache is the longer, lowering
    fails, and every step compiled a program of its own."""
    if len(places) != 2:
        return []
    a, b = (size_at(args, ps[0]) for ps in places)
    if not (isinstance(a, int) and isinstance(b, int)) or a == b or min(a, b) - dims.DEGREE < 2:
        return []
    return [(a, b - dims.DEGREE) if a > b else (a - dims.DEGREE, b)]


def _fit(
    captured: Captured,
    args: tuple[Any, ...],
    places: Sequence[Sequence[Place]],
    seen: Sequence[Sequence[int]],
    starts: list[int],
    runs: dict[tuple[int, ...], tuple[Any, list[int], Lowered]],
) -> tuple[Lowered, Family]:
    """lower_generic with the grid starting at `starts`; `runs` keeps each point's lowering."""
    grids = [list(range(start, start + dims.DEGREE + 1)) for start in starts]

    def run(point: tuple[int, ...]) -> tuple[Any, list[int], Lowered]:
        if point not in runs:
            lowered = point_lowering(captured, args, places, point)
            ints: list[int] = []
            runs[point] = (_walk(lowered, ints.append, True), ints, lowered)
        return runs[point]

    grid = list(itertools.product(*grids))
    try:
        shape = run(grid[0])[0]
        for p in grid:
            if run(p)[0] != shape:
                raise NotGeneric(f"lowering at sizes {p} differs from lowering at {grid[0]} other than in sizes")
    except (NotGeneric, Undecided):
        raise
    except Exception as e:
        raise NotGeneric(f"lowering at other sizes fails ({type(e).__name__}: {e})") from e
    samples = list(zip(*(run(p)[1] for p in grid)))
    fitted = [dims.fit(grid, list(s), grids) for s in samples]
    if any(f is None for f in fitted):
        raise NotGeneric("a size is not a polynomial of degree <= 2 in the changing dimensions")

    def holds(point: tuple[int, ...]) -> bool:
        try:
            got, ints, _ = run(point)
        except Exception:
            return False
        return got == shape and all(dims.value(f, point) == i for f, i in zip(fitted, ints))

    for point in seen:
        if min(point) >= 2 and not holds(tuple(point)):
            raise NotGeneric(f"the fitted sizes do not hold at {tuple(point)}")
    lo = [_smallest(j, starts, holds) for j in range(len(places))]
    fitted_ints = iter(fitted)
    generic = _walk(runs[grid[0]][2], lambda _: next(fitted_ints), False)
    for node in generic.graph.nodes:
        if node.op is Op.GEMM and not node.attrs.get("taps"):  # (a convolution's: the kernel at any size)
            node.attrs["one_thread_sizes"] = one_thread_sizes(node.attrs["blas"], node.attrs["beta"], tuple(lo))
            node.attrs["own_kernel"] = own_kernel(node.attrs["blas"], node.attrs["beta"], "pack" in node.attrs)
    return generic, Family(tuple(tuple(p) for p in places), tuple(lo), _largest(generic.graph, lo))


NO_LIMIT = 2**62


def _largest(graph: Graph, lo: list[int]) -> tuple[int, ...]:
    """Each symbol's largest value: where a view grows with it over a base that does not (a
    slice of a fixed buffer), up to the base's end. (Beyond it, eager's slice would stop at the
    end, or the view would be an error: the family does not reach there.)"""
    hi = [NO_LIMIT] * len(lo)
    spans = {n.name: n.meta.span for n in graph.nodes if n.meta is not None}
    for n in graph.nodes:
        if n.op is not Op.VIEW:
            continue
        room = spans[n.inputs[0]] - n.meta.span  # must stay >= 0
        try:
            if dims.positive(room + 1):
                continue
            raise NotGeneric(f"view {n.name} reaches past its base at every size")
        except Undecided:
            pass
        symbols = room.symbols()
        if len(symbols) != 1:
            raise NotGeneric(f"view {n.name}'s extent over its base depends on several sizes")
        j = symbols.pop()
        at = lambda v, j=j: [v if k == j else lo[k] for k in range(len(lo))]  # noqa: E731
        good, bad = lo[j], NO_LIMIT
        if dims.value(room, at(good)) < 0:
            raise NotGeneric(f"view {n.name} reaches past its base at the smallest size")
        while bad - good > 1:  # the room shrinks as the symbol grows
            mid = (good + bad) // 2
            good, bad = (mid, bad) if dims.value(room, at(mid)) >= 0 else (good, mid)
        hi[j] = min(hi[j], good)
    return tuple(hi)


LOWER_CHECKS = 8  # sizes below the fitted ones checked one by one for the family


def _smallest(j: int, starts: list[int], holds: Callable[[tuple[int, ...]], bool]) -> int:
    """The smallest value of symbol j the family admits. Lowering's decisions that depend on a
    size are ATen's size-1 cases and thresholds that grow with the size (bmm's path for small
    matrices): a match at 2 and at the fitted sizes holds between them, and 1 is checked alone.
    Where 2 does not match, the sizes below the fitted ones are checked one by one."""
    at = lambda v: tuple(v if k == j else starts[k] for k in range(len(starts)))  # noqa: E731
    lo = starts[j]
    if lo > 2 and holds(at(2)):
        lo = 2
    while lo > max(2, starts[j] - LOWER_CHECKS) and holds(at(lo - 1)):
        lo -= 1
    return 1 if lo == 2 and holds(at(1)) else lo


def varying(captured: Captured, args: tuple[Any, ...], places: Sequence[Place]) -> list[Place]:
    """The places whose size the graph lowers at when it changes (one more): for dynamic=True,
    which makes every dimension a candidate, also those a weight's shape fixes."""
    out = []
    for i, d in places:
        try:
            point_lowering(captured, args, [[(i, d)]], [size_at(args, (i, d)) + 1])
        except Exception:
            continue
        out.append((i, d))
    return out


def point_lowering(
    captured: Captured, args: tuple[Any, ...], places: Sequence[Sequence[Place]], point: Sequence[int]
) -> Lowered:
    """Lower with each symbol's dimensions resized to its value at `point`."""
    want: dict[int, dict[int, int]] = {}
    for j, ps in enumerate(places):
        for i, d in ps:
            want.setdefault(i, {})[d] = point[j]
    resized = tuple(
        a if i not in want else want[i][-1] if -1 in want[i] else _resized(a, want[i]) for i, a in enumerate(args)
    )
    # Whether a small GEMM runs on one thread, or braze's own kernel, is probed per shape: a
    # generic program's GEMMs call sgemm_ on MKL's thread count, as eager's do; its attention
    # is ATen's call (the sizes braze's kernel reproduces depend on the tokens modulo a block).
    with config.patch(one_thread_gemm_flops=0, own_gemm=False, exact_attention=False):
        return lower(captured, resized)


def _resized(t: torch.Tensor, sizes: dict[int, int]) -> torch.Tensor:
    """`t` with dimension d of size sizes[d], its values repeated along it (an index stays a valid
    index), contiguous like the arguments of a generic family."""
    out = t
    for d, n in sizes.items():
        out = out.index_select(d, torch.arange(n) % max(t.shape[d], 1))
    return out.contiguous()


_IGNORED = frozenset({"label", "why"})  # text for people, which may quote sizes


def _walk(x: Any, on_int: Callable[[int], Any], keyed: bool) -> Any:
    """`x` rebuilt with each integer in it replaced by on_int(integer), in a fixed order; with
    `keyed`, a comparable key of x's structure instead (objects by identity, integers as holes):
    two lowerings with equal keys differ only in their integers."""
    walk = lambda v: _walk(v, on_int, keyed)  # noqa: E731
    if isinstance(x, bool) or x is None or isinstance(x, (str, float, torch.dtype, torch.device)):
        return ("v", repr(x)) if keyed else x
    if isinstance(x, int):
        got = on_int(x)
        return "#" if keyed else got
    if isinstance(x, (Lowered, Graph, Node, TensorMeta)):
        fields = {f.name: walk(getattr(x, f.name)) for f in dataclasses.fields(x) if f.name not in _IGNORED}
        return (type(x).__name__, tuple(fields.items())) if keyed else dataclasses.replace(x, **fields)
    if isinstance(x, dict):
        items = {k: v if k in _IGNORED else walk(v) for k, v in x.items() if not (keyed and k in _IGNORED)}
        return tuple(items.items()) if keyed else items
    if isinstance(x, (tuple, list, frozenset)) and not hasattr(x, "_fields"):
        items = [walk(v) for v in (sorted(x) if isinstance(x, frozenset) else x)]
        if keyed:
            return (type(x).__name__, tuple(items))
        return tuple(items) if isinstance(x, torch.Size) else type(x)(items)
    if isinstance(x, slice):
        parts = (walk(x.start), walk(x.stop), walk(x.step))
        return ("slice", parts) if keyed else slice(*parts)
    if isinstance(x, Sym):
        return ("sym", x.name) if keyed else x
    if isinstance(x, pytree.TreeSpec):
        return ("spec", str(x)) if keyed else x
    if hasattr(x, "generic_key"):  # fast mode's packed calls: equal when configured alike
        return ("obj", x.generic_key()) if keyed else x
    return ("id", id(x)) if keyed else x
