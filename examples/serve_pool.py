"""Serve a braze-compiled model from a pool of worker processes, checking every answer.

The compiled model is pickled to each worker (its model and braze's options: machine code is not
pickled), and each worker compiles it again on its first request, in milliseconds. Every
answer is compared with eager PyTorch in the parent, bit for bit.

    python examples/serve_pool.py [--workers 2] [--requests 64]
"""

from __future__ import annotations

import argparse
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import torch
import torch.nn as nn

import braze

_model = None  # the worker's compiled model


def _load(compiled: braze.CompiledModule, threads: int) -> None:
    global _model
    torch.set_num_threads(threads)
    _model = compiled


def _answer(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    with torch.no_grad():
        return _model(x), len(_model.compilations)


def serve(workers: int = 2, requests: int = 64, seed: int = 0) -> int:
    """Answer `requests` batches of varying size on `workers` processes; return how many
    answers were torch.equal to eager (all of them, or it raises)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)).eval()
    compiled = braze.compile(model)
    batches = [torch.randn(int(torch.randint(1, 9, ())) * 8, 64) for _ in range(requests)]
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: nothing inherited but the pickle
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_load, initargs=(compiled, 1)) as pool:
        answers = list(pool.map(_answer, batches))
    with torch.no_grad():
        for x, (y, _) in zip(batches, answers):
            if not torch.equal(y, model(x)):
                raise AssertionError("a worker's answer differs from eager")
    return len(answers)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--requests", type=int, default=64)
    args = parser.parse_args()
    print(f"{serve(args.workers, args.requests)} answers, every one torch.equal to eager")
