"""Generation figures (issue 16): greedy generate() with a braze-compiled forward against eager.

    python benchmarks/generation.py            # needs transformers (a dev dependency)
    python benchmarks/generation.py llama braze # one model and backend (braze, braze-dynamic, inductor)

For a GPT-2 and a Llama config (random weights, no downloads): one warm-up generate of 32 new
tokens on a prompt of one length, then interleaved rounds of generate on a prompt of another
length, braze and eager; the tokens of every generate torch.equal to eager's; the median ratio
of eager's time to braze's per generate call; braze's compilations (the wrapper's and those of
each TorchDynamo graph); tokens per second. Backends: braze (`dynamic=None`, its default),
braze-dynamic (`dynamic=True`) and Inductor (`torch.compile(model.forward)`, not exact: its
tokens may differ from eager's).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
import warnings
from typing import Any

import configs  # benchmarks/configs.py, beside this script
import torch

import braze


def _models() -> dict[str, torch.nn.Module]:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaForCausalLM

    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=128, n_layer=2, n_head=2, vocab_size=1000, n_positions=256))
    llama = LlamaForCausalLM(configs.llama())
    return {"gpt2": gpt2.eval(), "llama": llama.eval()}


def _generate(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, float]:
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    return out, time.perf_counter() - t0


def _compiled(forward: Any, backend: str) -> Any:
    if backend == "inductor":
        return torch.compile(forward)
    return braze.compile(forward, dynamic=True if backend == "braze-dynamic" else None)


def run(name: str, model: torch.nn.Module, backend: str, rounds: int = 9) -> dict:
    """backend: braze (dynamic=None), braze-dynamic (dynamic=True) or inductor (torch.compile)."""
    eager = type(model)(model.config).eval()
    eager.load_state_dict(model.state_dict())
    compiled = _compiled(model.forward, backend)
    model.forward = compiled
    gen = torch.Generator().manual_seed(0)
    warm, prompt = (torch.randint(0, 1000, (1, n), generator=gen) for n in (11, 16))
    equal, times = True, []
    with torch.no_grad():
        first = _generate(model, warm)
        equal &= torch.equal(first[0], _generate(eager, warm)[0])
        second = _generate(model, prompt)[1]  # the first call at the new prompt length
        for i in range(rounds):
            if i % 2:
                a, tb = _generate(model, prompt)
                b, te = _generate(eager, prompt)
            else:
                b, te = _generate(eager, prompt)
                a, tb = _generate(model, prompt)
            equal &= torch.equal(a, b)
            times.append((te, tb))
    del model.forward
    speedup = statistics.median(te / tb for te, tb in times)
    rate = lambda k: NEW_TOKENS / statistics.median(t[k] for t in times)  # noqa: E731
    compiles = ""
    if backend != "inductor":
        n = compiled.compilation_count()
        compiles = f"; {n} braze compilations in {len(compiled._subgraphs)} TorchDynamo graphs"
    print(
        f"{name} {backend}: tokens torch.equal to eager's: {equal}{compiles}; warm-up generate "
        f"{first[1]:.2f} s, then at the new prompt length {second * 1e3:.0f} ms; steady: eager "
        f"{rate(0):.0f} tokens/s, {backend} {rate(1):.0f} tokens/s, {speedup:.2f}x (median of {rounds} "
        f"interleaved generate calls)"
    )
    return {"equal": equal, "speedup": speedup}


NEW_TOKENS = 32
BACKENDS = ("braze", "braze-dynamic", "inductor")


def main() -> None:
    """Each model and backend in a process of its own, as a server runs one model: TorchDynamo
    keeps per-function state (Hugging Face's decorators share one function between models)."""
    if len(sys.argv) == 3:
        warnings.simplefilter("ignore")
        warnings.simplefilter("always", braze.BrazeWarning)
        run(sys.argv[1], _models()[sys.argv[1]], sys.argv[2])
        return
    for backend in BACKENDS:
        for name in ("gpt2", "llama"):
            subprocess.run([sys.executable, __file__, name, backend], check=True)


if __name__ == "__main__":
    main()
