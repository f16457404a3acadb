"""A call's signature, which a wrapper's programs are specialised for (its cache key), and how two
differ: whether braze may run a call natively at all, the reason a compilation gives, and the
argument dimensions whose sizes vary (where a shape-generic program is compiled)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from . import entry, jit
from .ir import contiguous_strides
from .lowering.generic import NO_LIMIT, Family, Place
from .runtime import Program

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_keys = torch._C._dispatch_keys
# A dense CPU tensor's dispatch keys (made outside inference mode: it has them all), and those a
# thread includes when nothing is active; whatever state braze is imported in.
with torch.inference_mode(False):
    _PLAIN_KEYS = _keys(torch.empty(0)).raw_repr()
_KEY = torch._C.DispatchKey
_DEFAULT_INCLUDED = torch._C.DispatchKeySet(_KEY.BackendSelect).add(_KEY.ADInplaceOrView).raw_repr()


def _within(keys: Any, allowed: int) -> bool:
    return keys.raw_repr() | allowed == allowed


def plain_cpu(t: torch.Tensor) -> bool:
    """A dense CPU tensor whose bytes are its values: no lazy negation or conjugation, no
    functorch wrapper (vmap, grad, functionalize), not sparse, nested or on another device."""
    keys = _keys(t)
    return type(t) in _PLAIN and keys.has(_KEY.CPU) and _within(keys, _PLAIN_KEYS)


def unusual_state() -> str:
    """A global setting under which eager does something other than run the ops as written."""
    if torch.is_autocast_enabled("cpu"):
        return "CPU autocast"
    if torch._C._len_torch_dispatch_stack() or torch._C._is_torch_function_mode_enabled():
        return "a Python dispatch or torch-function mode"
    if not _within(torch._C._dispatch_tls_local_include_set(), _DEFAULT_INCLUDED):
        return "a functorch transform (vmap, grad, functionalize) or another dispatch override"
    if entry.flushes_denormals():
        return "flushing denormals to zero (torch.set_flush_denormal(True))"
    return ""


@dataclass(frozen=True)
class Compilation:
    """One program a wrapper compiled: why (which part of the call differed from the last one
    compiled, or what changed) and the milliseconds it took."""

    why: str
    ms: float


_STATE = (
    "the default dtype",
    "ATen's float32 matmul precision",
    "MKL's thread count",
    "torch.backends.mkldnn.enabled",
    "ATen's flash attention enabled",
)


def global_state() -> tuple:
    """The process's settings a program's bits depend on, after the default dtype (the trace's):
    GEMMs are native only in full float32 matmul precision, and small ones run on one thread where
    MKL's thread count gives the same bits; gelu's erf form is oneDNN's only while oneDNN is
    enabled; exact mode's attention is ATen's flash kernel's only while that is enabled. A program
    per combination (the entry checks each one its program depends on)."""
    return (jit.matmul_precision(), jit.mkl_threads(), torch.backends.mkldnn.enabled, torch._C._get_flash_sdp_enabled())


def difference(old: tuple | None, new: tuple) -> str:
    """What differs between two call signatures (see CompiledFunction._miss for their parts)."""
    if old is None:
        return "first call"
    if len(old) != len(new):
        return f"{len(new) - len(old):+d} parts in the call's signature (a new number of arguments or modules)"
    for i, (a, b) in enumerate(zip(old, new)):
        if a == b:
            continue
        if i >= len(new) - len(_STATE):
            return f"{_STATE[i - len(new)]}: {a} -> {b}"
        if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) == 5:
            fields = ("shape", "strides", "dtype", "device", "type")
            name, x, y = next((f, x, y) for f, x, y in zip(fields, a, b) if x != y)
            return f"argument {i}: {name} {tuple(x) if name == 'shape' else x} -> {tuple(y) if name == 'shape' else y}"
        if isinstance(a, tuple) and isinstance(b, tuple):
            return f"argument {i}: {a[1]!r} -> {b[1]!r}"
        return f"a module's training flag: {a} -> {b}"
    return "the same signature"


def topic(why: str) -> str:
    """What a compilation's reason is about: "argument 0: shape (4, 64) -> (8, 64)" is about
    argument 0's shape."""
    head, _, tail = why.partition(": ")
    return f"{head}'s {tail.split()[0]}" if head.startswith("argument") and tail else head


def contiguous(a: Any) -> bool:
    return isinstance(a, torch.Tensor) and a.is_contiguous()


def size_change(old: tuple | None, new: tuple, n_args: int) -> set[Place]:
    """The argument dimensions whose sizes differ between two signatures that differ in
    nothing else, their tensors contiguous in both; empty if they differ otherwise."""
    if old is None or len(old) != len(new) or old[n_args:] != new[n_args:]:
        return set()
    changed: set[Place] = set()
    for i, (a, b) in enumerate(zip(old[:n_args], new[:n_args])):
        if a == b:
            continue
        if len(a) != 5 or len(b) != 5 or a[2:] != b[2:] or len(a[0]) != len(b[0]):
            return set()
        if a[1] != contiguous_strides(tuple(a[0])) or b[1] != contiguous_strides(tuple(b[0])):
            return set()
        changed |= {(i, d) for d in range(len(a[0])) if a[0][d] != b[0][d]}
    return changed


def family_key(key: tuple, family: Family) -> tuple:
    """A signature with the family's dimensions (and its tensors' strides, contiguous) left out."""
    out = list(key)
    for i in {i for places in family.places for i, d in places if d < 0}:
        out[i] = (int, None)
    for i in {i for places in family.places for i, d in places if d >= 0}:
        shape, _, *rest = key[i]
        free = {d for places in family.places for j, d in places if j == i}
        out[i] = (tuple(-1 if d in free else n for d, n in enumerate(shape)), None, *rest)
    return tuple(out)


def generic_note(prog: Program) -> str:
    if prog.family is None:
        return ""
    parts = []
    for j, (places, lo, hi) in enumerate(zip(prog.family.places, prog.family.lo, prog.family.hi)):
        where = ", ".join(f"argument {i}" + (f" dim {d}" if d >= 0 else "") for i, d in places)
        parts.append(f"s{j} = {where} " + (f"(>= {lo})" if hi == NO_LIMIT else f"({lo} to {hi})"))
    return "; generic in " + "; ".join(parts)


def signature(args: tuple[Any, ...]) -> tuple:
    sig = []
    for a in args:
        if isinstance(a, torch.Tensor):
            sig.append((a.shape, a.stride(), a.dtype, a.device, type(a)))
        else:
            sig.append((type(a), a))
    return tuple(sig)
