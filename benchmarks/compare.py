"""Backends side by side on one `braze bench` model, in one process, interleaved with eager.

    python benchmarks/compare.py bert-tiny braze,braze-fast        # 15 rounds
    python benchmarks/compare.py bert braze,braze-fast,torchscript 11

Each round times 3 calls of eager and of each backend in turn (after two warm-up calls each);
printed: each one's median time per call and the median of its per-round ratio to eager. For a
quick A/B of a change, where `braze bench` (each backend in its own process) takes minutes.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from braze.bench import BACKENDS, build_model


def main(name: str, backends: list[str], rounds: int) -> None:
    torch.set_num_threads(2)
    model, inputs = build_model(name)
    fns = {"eager": model} | {b: BACKENDS[b][0](model, inputs) for b in backends}
    times: dict[str, list[float]] = {k: [] for k in fns}
    with torch.no_grad():
        for f in fns.values():
            f(*inputs)
            f(*inputs)
        for _ in range(rounds):
            for k, f in fns.items():
                t0 = time.perf_counter()
                for _ in range(3):
                    f(*inputs)
                times[k].append((time.perf_counter() - t0) / 3)
    for k, ts in times.items():
        ratio = statistics.median(e / t for e, t in zip(times["eager"], ts))
        print(f"{name:20s} {k:18s} {statistics.median(ts) * 1e3:8.3f} ms  {ratio:.2f}x eager")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(","), int(sys.argv[3]) if len(sys.argv) > 3 else 15)
