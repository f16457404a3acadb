"""What `memoize` (passes.py) buys: each model compiled twice in one process, with the pass and
without it, timed interleaved with eager (median of 11 rounds of 30 calls).

    python benchmarks/memo.py            # needs transformers (pip install -e '.[bench]')

Models (random weights): the bench's gpt2-tiny (2x128), GPT-2 at 1x32, the serving Llama config at
1x32, and a T5 encoder config at 2x48. Without the pass the calls it keeps run at every call, as
ATen calls: for T5, whose position buckets lowering keeps as ATen calls so that they can be kept,
that is slower than before those calls were kept (they were native kernels then).
"""

from __future__ import annotations

import statistics
import time
import warnings

import configs  # benchmarks/configs.py, beside this script
import torch

import braze
from braze import passes
from braze.bench import build_model, first_tensor


def _models() -> dict[str, tuple[torch.nn.Module, tuple]]:
    from transformers import LlamaModel, T5Config, T5EncoderModel

    gpt2, _ = build_model("gpt2-tiny")
    torch.manual_seed(0)
    llama = LlamaModel(configs.llama()).eval()
    t5 = T5EncoderModel(T5Config(d_model=128, d_kv=32, d_ff=256, num_layers=2, num_heads=4, vocab_size=1000)).eval()
    ids = lambda b, s: (torch.randint(0, 1000, (b, s)),)  # noqa: E731
    return {
        "gpt2-tiny 2x128": build_model("gpt2-tiny"),
        "gpt2-tiny 1x32": (gpt2, ids(1, 32)),
        "llama 1x32": (llama, ids(1, 32)),
        "t5-encoder 2x48": (t5, ids(2, 48)),
    }


def _per_call_us(fn, x: tuple, n: int = 30) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn(*x)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def compare(name: str, model: torch.nn.Module, x: tuple, rounds: int = 11) -> None:
    full = passes.PIPELINE
    with torch.no_grad():
        kept = braze.compile(model)
        equal = torch.equal(first_tensor(kept(*x)), first_tensor(model(*x)))
        passes.PIPELINE = tuple(p for p in full if p is not passes.memoize)
        try:
            made = braze.compile(model)
            made(*x)
        finally:
            passes.PIPELINE = full
        fns = {"eager": model, "without memoize": made, "with memoize": kept}
        for fn in fns.values():
            for _ in range(10):
                fn(*x)
        us = {k: [] for k in fns}
        for _ in range(rounds):
            for k, fn in fns.items():
                us[k].append(_per_call_us(fn, x))
    eager = statistics.median(us["eager"])
    cells = ", ".join(f"{k} {statistics.median(v):.0f} us ({eager / statistics.median(v):.2f}x)" for k, v in us.items())
    print(f"{name}: torch.equal {equal}; {cells}")


def main() -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(2)
    for name, (model, x) in _models().items():
        compare(name, model, x)


if __name__ == "__main__":
    main()
