"""Serving figures (issue 12): how often braze compiles when shapes change, and what it costs.

    python benchmarks/serving.py            # needs transformers (pip install -e '.[bench]')

- llama: Hugging Face LlamaModel (hidden 128, 2 layers, 4 heads, 2 KV heads, vocab 1000), ids
  2x32: compilations, torch.equal to eager, steady speed-up (median of interleaved rounds).
- bert-stream: BertModel (hidden 128, 2 layers, 2 heads, intermediate 512, vocab 1000), 80
  calls with batch 1-8 and sequence 1-128 (seeded): every output torch.equal to eager,
  compilations, braze's and eager's total time over calls 11-80 (each call timed alone,
  braze and eager interleaved).
- lesson-stream: the lesson MLP, 80 calls with batch 1-256: the same figures; then, on a batch of
  32, the generic program's steady speed against a program specialised to 32.
- gpt2-generate: GPT2LMHeadModel (hidden 128, 2 layers, 4 heads, vocab 1000) with its forward
  compiled, greedy generate of 24 tokens for 2 prompts of 9 (one left-padded: an attention mask),
  three times: the tokens torch.equal to eager's, compilations after each, each generate's time
  against eager's.
"""

from __future__ import annotations

import copy
import statistics
import time
import warnings

import configs  # benchmarks/configs.py, beside this script
import torch

import braze


def _timed(fn, *args, **kwargs) -> tuple[object, float]:
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0


def _first(out):
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out


def stream(name: str, model: torch.nn.Module, calls: list[tuple[tuple, dict]]) -> dict:
    """Each call (args, kwargs) of compiled and eager, interleaved; calls 11- timed."""
    compiled = braze.compile(model)
    equal, eager_s, braze_s = True, 0.0, 0.0
    with torch.no_grad():
        for i, (args, kwargs) in enumerate(calls):
            order = (model, compiled) if i % 2 else (compiled, model)
            outs = {}
            for fn in order:
                outs[fn is model], took = _timed(fn, *args, **kwargs)
                if i >= 10:
                    if fn is model:
                        eager_s += took
                    else:
                        braze_s += took
            equal &= torch.equal(_first(outs[True]), _first(outs[False]))
    n = compiled.compilation_count()
    print(
        f"{name}: {len(calls)} calls, all torch.equal to eager: {equal}; {n} compilations; "
        f"calls 11-{len(calls)}: braze {braze_s * 1e3:.1f} ms, eager {eager_s * 1e3:.1f} ms "
        f"({eager_s / braze_s:.2f}x)"
    )
    return {"equal": equal, "compilations": n, "braze_s": braze_s, "eager_s": eager_s}


def steady(name: str, model: torch.nn.Module, kwargs: dict, rounds: int = 15, number: int = 20) -> dict:
    compiled = braze.compile(model)
    with torch.no_grad():
        first = _timed(compiled, **kwargs)[1]
        equal = torch.equal(_first(compiled(**kwargs)), _first(model(**kwargs)))
        ratios = []
        for _ in range(rounds):
            e = min(_timed(lambda: [model(**kwargs) for _ in range(number)])[1] for _ in range(2))
            b = min(_timed(lambda: [compiled(**kwargs) for _ in range(number)])[1] for _ in range(2))
            ratios.append(e / b)
    n = compiled.compilation_count()
    print(
        f"{name}: first call {first * 1e3:.0f} ms; torch.equal: {equal}; {n} compilation(s); "
        f"speed-up vs eager {statistics.median(ratios):.2f}x (median of {rounds} interleaved rounds)"
    )
    return {"equal": equal, "compilations": n, "speedup": statistics.median(ratios)}


def generate(name: str, model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, tokens: int = 24) -> dict:
    eager = copy.deepcopy(model)
    compiled = braze.compile(model.forward)
    model.forward = compiled
    kwargs = {"attention_mask": mask, "max_new_tokens": tokens, "do_sample": False, "pad_token_id": 0}
    counts, times, equal = [], [], True
    with torch.no_grad():
        want, eager_s = _timed(eager.generate, ids, **kwargs)
        for _ in range(3):
            got, took = _timed(model.generate, ids, **kwargs)
            equal = equal and torch.equal(got, want)  # (each generate's tokens)
            counts.append(compiled.compilation_count())
            times.append(f"{took * 1e3:.0f}")
    print(
        f"{name}: tokens torch.equal to eager: {equal}; compilations after each generate {counts}; "
        f"generate {', '.join(times)} ms, eager {eager_s * 1e3:.0f} ms"
    )
    return {"equal": equal, "compilations": counts}


def main() -> None:
    from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel, LlamaModel

    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    llama = LlamaModel(configs.llama()).eval()
    steady("llama", llama, {"input_ids": torch.randint(0, 1000, (2, 32))})

    bert = BertModel(
        BertConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512, vocab_size=1000)
    ).eval()
    gen = torch.Generator().manual_seed(0)
    sizes = [
        (int(torch.randint(1, 9, (), generator=gen)), int(torch.randint(1, 129, (), generator=gen))) for _ in range(80)
    ]
    stream("bert-stream", bert, [((), {"input_ids": torch.randint(0, 1000, s, generator=gen)}) for s in sizes])

    lesson = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)).eval()
    batches = [int(torch.randint(1, 257, (), generator=gen)) for _ in range(80)]
    stream("lesson-stream", lesson, [((torch.randn(b, 64, generator=gen),), {}) for b in batches])
    x = torch.randn(32, 64)
    fixed = braze.compile(lesson, dynamic=False)
    generic = braze.compile(lesson)
    with torch.no_grad():
        fixed(x), generic(torch.randn(100, 64)), generic(x)  # generic: compiled at 100, then for every batch
    ratio = _interleaved(lambda: generic(x), lambda: fixed(x))
    print(f"lesson batch 32: the generic program's speed / the specialised one's: {ratio:.3f} (median of 21 rounds)")

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1000, bos_token_id=0, eos_token_id=0))
    ids = torch.randint(1, 1000, (2, 9), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    generate("gpt2-generate", gpt2.eval(), ids, mask)


def _interleaved(a, b, rounds: int = 21, number: int = 2000) -> float:
    """Median over rounds of (time of b) / (time of a), each round timing both."""
    ratios = []
    with torch.no_grad():
        for _ in range(rounds):
            ta = _timed(lambda: [a() for _ in range(number)])[1]
            tb = _timed(lambda: [b() for _ in range(number)])[1]
            ratios.append(tb / ta)
    return statistics.median(ratios)


if __name__ == "__main__":
    main()
