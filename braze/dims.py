"""Run-time dimensions: the sizes a shape-generic program reads from each call.

A generic program has symbols s0, s1, ... (a batch size, a sequence length), each bound from one
dimension of its inputs at every call. Every size, stride, offset and BLAS argument of its IR is
an int or an `Expr`: a polynomial in the symbols with integer coefficients (`64*s0`,
`s0*s1*128`). Lowering runs on real tensors, so the expressions are not traced: the program is
lowered at several values of the symbols and each integer that varies is fitted (`fit`) as a
polynomial of degree at most 2 in each symbol, then checked at further points.

Comparisons between expressions answer for every value the program admits (each symbol at least
its lower bound, which is at least 1) or raise `Undecided`: a pass that must decide something a
generic program cannot decide once for all its shapes fails, and the call is compiled for its
own shapes instead.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any

DEGREE = 2  # the highest power of one symbol an expression may hold


class Undecided(Exception):
    """A comparison whose answer depends on the symbols' values."""


Monomial = tuple[int, ...]  # the power of each symbol


class Expr:
    """A polynomial in the symbols; arithmetic with ints gives an Expr, or an int when constant."""

    __slots__ = ("terms", "_hash")

    def __init__(self, terms: Mapping[Monomial, int]) -> None:
        self.terms = tuple(sorted((m, c) for m, c in terms.items() if c))
        self._hash = hash(self.terms)

    @staticmethod
    def symbol(i: int, n: int) -> Expr:
        return Expr({tuple(int(j == i) for j in range(n)): 1})

    @property
    def n(self) -> int:
        return len(self.terms[0][0]) if self.terms else 0

    def eval(self, values: Sequence[int]) -> int:
        return sum(c * math.prod(v**e for v, e in zip(values, m)) for m, c in self.terms)

    def symbols(self) -> set[int]:
        return {i for m, _ in self.terms for i, e in enumerate(m) if e}

    # --- arithmetic ----------------------------------------------------------------------------
    def _dict(self) -> dict[Monomial, int]:
        return dict(self.terms)

    def __add__(self, other: Any) -> Dim:
        if not isinstance(other, (int, Expr)):
            return NotImplemented
        out = self._dict()
        for m, c in _terms(other, self.n):
            out[m] = out.get(m, 0) + c
        return _simplify(out)

    __radd__ = __add__

    def __neg__(self) -> Dim:
        return _simplify({m: -c for m, c in self.terms})

    def __sub__(self, other: Any) -> Dim:
        return self + (-other)

    def __rsub__(self, other: Any) -> Dim:
        return (-self) + other

    def __mul__(self, other: Any) -> Dim:
        if not isinstance(other, (int, Expr)):
            return NotImplemented
        out: dict[Monomial, int] = {}
        for (m1, c1), (m2, c2) in itertools.product(self.terms, _terms(other, self.n)):
            m = tuple(a + b for a, b in zip(m1, m2))
            out[m] = out.get(m, 0) + c1 * c2
        return _simplify(out)

    __rmul__ = __mul__

    # --- comparisons: true (or false) for every admitted value, else Undecided ---------------------
    def __eq__(self, other: object) -> bool:
        return isinstance(other, Expr) and self.terms == other.terms

    def __hash__(self) -> int:
        return self._hash

    def __lt__(self, other: Any) -> bool:
        return positive(other - self)

    def __gt__(self, other: Any) -> bool:
        return positive(self - other)

    def __le__(self, other: Any) -> bool:
        return not positive(self - other)

    def __ge__(self, other: Any) -> bool:
        return not positive(other - self)

    def __bool__(self) -> bool:
        return True  # a non-constant polynomial is not identically zero

    def __index__(self) -> int:
        raise Undecided(f"{self} used where a fixed integer is needed")

    def __repr__(self) -> str:
        parts = []
        for m, c in reversed(self.terms):
            names = "*".join(f"s{i}" + (f"**{e}" if e > 1 else "") for i, e in enumerate(m) if e)
            parts.append(names if c == 1 and names else f"{c}*{names}" if names else str(c))
        return " + ".join(parts).replace("+ -", "- ")


Dim = int | Expr


def _terms(x: Dim, n: int) -> tuple[tuple[Monomial, int], ...]:
    return x.terms if isinstance(x, Expr) else (((0,) * n, x),)


def _simplify(terms: dict[Monomial, int]) -> Dim:
    e = Expr(terms)
    if all(not any(m) for m, _ in e.terms):
        return sum(c for _, c in e.terms)
    return e


def positive(x: Dim) -> bool:
    """Whether x > 0 for every admitted value (each symbol >= 1): True, False, or Undecided.

    With each symbol written 1 + y (y >= 0), a polynomial whose coefficients are all >= 0 (one of
    them, the constant, > 0) is positive everywhere; all <= 0: nowhere."""
    if isinstance(x, int):
        return x > 0
    shifted: dict[Monomial, int] = {}
    for m, c in x.terms:
        for sub in itertools.product(*(range(e + 1) for e in m)):
            coef = c * math.prod(math.comb(e, k) for e, k in zip(m, sub))
            shifted[sub] = shifted.get(sub, 0) + coef
    coefs = [c for c in shifted.values() if c]
    constant = shifted.get((0,) * x.n, 0)
    if all(c >= 0 for c in coefs) and constant > 0:
        return True
    if all(c <= 0 for c in coefs):
        return False
    raise Undecided(f"whether {x} > 0")


def value(x: Dim, values: Sequence[int]) -> int:
    return x.eval(values) if isinstance(x, Expr) else x


def typical(x: Dim) -> int:
    """x at a typical size of every symbol: an order for choices that only speed depends on
    (which loop is outermost)."""
    return x.eval([64] * x.n) if isinstance(x, Expr) else x


def fit(points: Sequence[Sequence[int]], samples: Sequence[int], grids: Sequence[Sequence[int]]) -> Dim | None:
    """The polynomial (degree <= DEGREE in each symbol, integer coefficients) through `samples`
    taken at the tensor grid `grids` (points lists them in itertools.product order); None if
    there is none."""
    if all(v == samples[0] for v in samples):  # most integers of a graph do not vary: no algebra
        return samples[0]
    table = dict(zip(map(tuple, points), samples))
    n = len(grids)
    coefs = _fit_axis(lambda rest: table[tuple(rest)], grids, n, ())
    if coefs is None:
        return None
    out: dict[Monomial, int] = {}
    for m, c in coefs.items():
        if c.denominator != 1:
            return None
        out[m] = int(c)
    return _simplify(out) if out else 0


def _fit_axis(at: Any, grids: Sequence[Sequence[int]], n: int, fixed: tuple) -> dict[Monomial, Fraction] | None:
    """Coefficients of the polynomial in symbols len(fixed).. (those before are fixed to `fixed`)."""
    axis = len(fixed)
    if axis == n:
        return {(): Fraction(at(fixed))}
    per_value = []
    for v in grids[axis]:
        sub = _fit_axis(at, grids, n, fixed + (v,))
        if sub is None:
            return None
        per_value.append(sub)
    out: dict[Monomial, Fraction] = {}
    for rest in {m for sub in per_value for m in sub}:
        ys = [sub.get(rest, Fraction(0)) for sub in per_value]
        for power, c in enumerate(_interpolate(list(grids[axis]), ys)):
            if c:
                out[(power, *rest)] = c
    return out


def _interpolate(xs: list[int], ys: list[Fraction]) -> list[Fraction]:
    """Coefficients (lowest power first) of the polynomial through (xs, ys) (Lagrange)."""
    coefs = [Fraction(0)] * len(xs)
    for basis, yi in zip(_lagrange(tuple(xs)), ys):
        for k, c in enumerate(basis):
            coefs[k] += c * yi
    return coefs


@functools.cache
def _lagrange(xs: tuple[int, ...]) -> list[list[Fraction]]:
    """Per point i, the coefficients of prod over j != i of (x - xj) / (xi - xj): the same few
    grids serve every integer a generic lowering fits."""
    out = []
    for i, xi in enumerate(xs):
        basis = [Fraction(1)]
        for j, xj in enumerate(xs):
            if j == i:
                continue
            scale = Fraction(1, xi - xj)
            basis = [Fraction(0)] + basis
            for k in range(len(basis) - 1):
                basis[k] -= basis[k + 1] * xj
            basis = [c * scale for c in basis]
        out.append(basis)
    return out
