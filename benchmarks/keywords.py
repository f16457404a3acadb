"""Keyword calls (issue 16): Hugging Face models called positionally, by keyword and with
`**inputs`, through one braze wrapper: each form torch.equal to eager, and its speed-up.

    python benchmarks/keywords.py          # BERT, GPT-2 and Llama configs, each in its own process
    python benchmarks/keywords.py llama    # one model

For each model (random weights, input ids and attention mask of 2 x 32): the three call forms
interleaved with eager's positional call over 15 rounds of 20 calls; the median ratio of eager's
time to braze's per form, and braze's compilations over all of them.
"""

from __future__ import annotations

import inspect
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import configs  # benchmarks/configs.py, beside this script
import torch

import braze


def _model(name: str) -> torch.nn.Module:
    from transformers import BertConfig, BertModel, GPT2Config, GPT2Model, LlamaModel

    torch.manual_seed(0)
    build = {
        "bert": lambda: BertModel(
            BertConfig(
                hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512, vocab_size=1000
            )
        ),
        "gpt2": lambda: GPT2Model(GPT2Config(n_embd=128, n_layer=2, n_head=2, vocab_size=1000, n_positions=256)),
        "llama": lambda: LlamaModel(configs.llama()),
    }
    return build[name]().eval()


def _calls(model: torch.nn.Module) -> dict[str, Callable[[Any], Any]]:
    ids = torch.randint(0, 1000, (2, 32), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 32, dtype=torch.long)
    params = list(inspect.signature(model.forward).parameters)
    positional: list[Any] = [None] * (params.index("attention_mask") + 1)
    positional[0], positional[-1] = ids, mask
    return {
        "positional": lambda f: f(*positional),
        "keywords": lambda f: f(input_ids=ids, attention_mask=mask),
        "**inputs": lambda f: f(**{"input_ids": ids, "attention_mask": mask}),
    }


def run(name: str, rounds: int = 15, calls: int = 20) -> None:
    model = _model(name)
    forms = _calls(model)
    compiled = braze.compile(model)

    def clock(f: Any, call: Callable[[Any], Any]) -> float:
        t0 = time.perf_counter()
        for _ in range(calls):
            call(f)
        return time.perf_counter() - t0

    with torch.no_grad():
        want = forms["positional"](model).last_hidden_state
        equal = {form: torch.equal(call(compiled).last_hidden_state, want) for form, call in forms.items()}
        ratios: dict[str, list[float]] = {form: [] for form in forms}
        for _ in range(rounds):
            eager = clock(model, forms["positional"])
            for form, call in forms.items():
                ratios[form].append(eager / clock(compiled, call))
    n = compiled.compilation_count()
    cells = ", ".join(f"{form} {statistics.median(r):.2f}x (equal: {equal[form]})" for form, r in ratios.items())
    print(f"{name}: {cells}; {n} braze compilations")


def main() -> None:
    if len(sys.argv) == 2:
        warnings.simplefilter("ignore")
        warnings.simplefilter("always", braze.BrazeWarning)
        run(sys.argv[1])
        return
    for name in ("bert", "gpt2", "llama"):
        subprocess.run([sys.executable, __file__, name], check=True)


if __name__ == "__main__":
    main()
