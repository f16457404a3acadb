"""Serving check: Python threads calling one compiled model at several batch sizes at once.

    python benchmarks/stress.py                      # the ten models, exact and fast, 8 s each
    python benchmarks/stress.py bert-tiny,resnet18 fast 20

For each model and mode: eager's outputs at batch sizes 1, the bench size and 3 (inputs drawn
once, seeded), then four threads call the compiled model for the given seconds, each taking the
sizes in turn from its own starting point (so the threads overlap on every size and on the
compiles between them). Every output is compared with eager's: exact mode `torch.equal`, fast
mode within 1e-3 of the output's scale with NaN where eager has it. Printed per model and mode:
calls, mismatches, exceptions, compilations. Needs transformers, torchvision and timm
(`pip install -e '.[bench]'`; torchvision as README says). Exits 1 on any mismatch or exception.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

import torch
from torch.utils import _pytree as pytree

import braze
from braze.bench import build_model

MODELS = (
    "lesson,mlp-wide,cnn-small,transformer-layer,bert-tiny,gpt2-tiny,resnet18,mobilenet-v3-small,vit-tiny,convnext-atto"
)
THREADS = 4


def _at_batch(inputs: tuple, batch: int, gen: torch.Generator) -> tuple:
    """The inputs with their first dimension `batch`: new token ids below the old maximum, or
    new normal values."""

    def one(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        shape = (batch, *t.shape[1:])
        if t.dtype.is_floating_point:
            return torch.randn(shape, generator=gen, dtype=t.dtype)
        return torch.randint(0, int(t.max()) + 1, shape, generator=gen, dtype=t.dtype)

    return tuple(one(t) for t in inputs)


def _leaves(out: Any) -> list[torch.Tensor]:
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def _same(got: Any, want: Any, exact: bool) -> bool:
    a, b = _leaves(got), _leaves(want)
    if len(a) != len(b) or any(x.shape != y.shape or x.dtype != y.dtype for x, y in zip(a, b)):
        return False
    if exact:
        return all(torch.equal(x, y) for x, y in zip(a, b))
    for x, y in zip(a, b):
        if not torch.equal(x.isnan(), y.isnan()):
            return False
        finite = y[y.isfinite()]
        scale = max(1.0, float(finite.abs().max())) if finite.numel() else 1.0
        if not torch.allclose(x, y, rtol=0, atol=1e-3 * scale, equal_nan=True):
            return False
    return True


def check(name: str, mode: str, seconds: float) -> dict[str, Any]:
    """Four threads on one compiled `name` for `seconds`: calls, mismatches, errors, compilations."""
    model, inputs = build_model(name)
    gen = torch.Generator().manual_seed(1)
    cases = [_at_batch(inputs, b, gen) for b in (1, inputs[0].shape[0], 3)]
    with torch.no_grad():
        wanted = [model(*c) for c in cases]
    compiled = braze.compile(model, mode=mode)
    counts = {"calls": 0, "mismatches": 0, "errors": 0}
    lock = threading.Lock()
    errors: list[str] = []
    end = time.perf_counter() + seconds

    def work(start: int) -> None:
        i = start
        while time.perf_counter() < end:
            case = i % len(cases)
            try:
                with torch.no_grad():
                    ok, err = _same(compiled(*cases[case]), wanted[case], mode == "exact"), None
            except Exception as e:  # reported, and the check fails
                ok, err = False, f"{type(e).__name__}: {e}"
            with lock:
                counts["calls"] += 1
                counts["mismatches"] += not ok and err is None
                counts["errors"] += err is not None
                if err is not None and len(errors) < 3:
                    errors.append(err)
            i += 1

    threads = [threading.Thread(target=work, args=(k,)) for k in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    compilations = compiled.compilation_count()
    return counts | {"compilations": compilations, "first errors": errors}


def main(models: list[str], modes: list[str], seconds: float) -> int:
    torch.set_num_threads(2)
    bad = 0
    for name in models:
        for mode in modes:
            r = check(name, mode, seconds)
            bad += r["mismatches"] + r["errors"]
            print(
                f"{name:20s} {mode:5s} {r['calls']:6d} calls  {r['mismatches']} mismatched  "
                f"{r['errors']} raised  {r['compilations']} compilations  {'; '.join(r['first errors'])}",
                flush=True,
            )
    return 1 if bad else 0


if __name__ == "__main__":
    args = sys.argv[1:]
    sys.exit(
        main(
            (args[0] if args else MODELS).split(","),
            (args[1] if len(args) > 1 else "exact,fast").split(","),
            float(args[2]) if len(args) > 2 else 8.0,
        )
    )
