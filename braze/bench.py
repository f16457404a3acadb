"""`braze bench`: braze beside eager, Inductor (default and freezing), TorchScript, ONNX Runtime and
OpenVINO, on one machine, in one run.

Per model x backend it measures
  first_call_s       wrapping + first output, in a fresh subprocess with an empty compile cache
  first_call_warm_s  the same again with the cache that run left (backends that have one)
  steady_us          per-call time, fastest of interleaved rounds (each a loop of >= 0.2 s)
  speedup_vs_eager   median over the same rounds of eager's time / this backend's
  equal, max_abs_diff  against eager's output on the same inputs
  error_ratio        the output's largest error against a float64 copy of the model, as a
                     multiple of eager's (braze.check_accuracy's max ratio; fast mode: at most 4)
  peak_rss_mb        of the fresh subprocess
and writes DIR/results.json, DIR/results.png and a table on the terminal.

Extra backends can be added by a module named in BRAZE_BENCH_PLUGINS (comma-separated) that
calls `register_backend`; the harness's own test uses this to add a deliberately slow one.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import importlib
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from . import timing
from .accuracy import measure

# --- models -------------------------------------------------------------------------------------

# PyPI's torchvision is a CUDA build whose C ops do not load beside the CPU torch. Its model code
# needs none of them, but its import registers fake kernels for them and fails; so does
# transformers' import, which imports torchvision where it finds it. Skip those registrations.
sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations"))


def _lesson() -> tuple[torch.nn.Module, tuple]:
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    return model, (torch.randn(32, 64),)


class _WideMLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(1024, 4096), torch.nn.Linear(4096, 1024)
        self.norm = torch.nn.LayerNorm(1024)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.fc2(torch.nn.functional.gelu(self.fc1(x))))


def _mlp_wide() -> tuple[torch.nn.Module, tuple]:
    return _WideMLP(), (torch.randn(256, 1024),)


def _cnn_small() -> tuple[torch.nn.Module, tuple]:
    def block(cin: int, cout: int) -> list[torch.nn.Module]:
        return [torch.nn.Conv2d(cin, cout, 3, padding=1), torch.nn.BatchNorm2d(cout), torch.nn.ReLU()]

    nn = torch.nn
    layers = block(3, 32) + block(32, 64) + [nn.MaxPool2d(2)] + block(64, 64) + block(64, 128) + [nn.MaxPool2d(2)]
    model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10))
    return model, (torch.randn(8, 3, 64, 64),)


def _transformer_layer() -> tuple[torch.nn.Module, tuple]:
    layer = torch.nn.TransformerEncoderLayer(d_model=256, nhead=4, dim_feedforward=1024, batch_first=True, dropout=0)
    return layer, (torch.randn(4, 128, 256),)


def _bert_tiny() -> tuple[torch.nn.Module, tuple]:
    from transformers import BertConfig, BertModel

    cfg = BertConfig(
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=512,
        vocab_size=1000,
        use_cache=False,  # the output is the hidden states alone, which every peer can return
    )
    return BertModel(cfg), (torch.randint(0, 1000, (4, 64)),)


def _gpt2_tiny() -> tuple[torch.nn.Module, tuple]:
    from transformers import GPT2Config, GPT2Model

    # GPT-2's default special-token id (50256) lies outside a 1000-word vocabulary; the model never
    # reads it, but transformers warns. Any id inside the vocabulary changes nothing else.
    # use_cache=False: no key/value cache among the outputs (TorchScript cannot return one).
    cfg = GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=1000, bos_token_id=0, eos_token_id=0, use_cache=False)
    return GPT2Model(cfg), (torch.randint(0, 1000, (2, 128)),)


# Real models (`--models real`): what users run, built from configs with random weights. Text
# models take one sequence of 128 tokens, vision models one 224 x 224 image.


def _hf(config: str, model: str, **kw: Any) -> tuple[torch.nn.Module, tuple]:
    import transformers

    cfg = getattr(transformers, config)(**kw)
    if model == "ViTModel":
        return transformers.ViTModel(cfg), (torch.randn(1, 3, 224, 224),)
    return getattr(transformers, model)(cfg), (torch.randint(0, cfg.vocab_size, (1, 128)),)


_GPT2 = {"bos_token_id": 0, "eos_token_id": 0, "use_cache": False}  # as gpt2-tiny's
_TEXT = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 1024}


def _torchvision(name: str) -> tuple[torch.nn.Module, tuple]:
    import torchvision

    return getattr(torchvision.models, name)(), (torch.randn(1, 3, 224, 224),)


def _timm(name: str) -> tuple[torch.nn.Module, tuple]:
    import timm

    return timm.create_model(name, pretrained=False), (torch.randn(1, 3, 224, 224),)


MODELS: dict[str, Callable[[], tuple[torch.nn.Module, tuple]]] = {
    "lesson": _lesson,
    "mlp-wide": _mlp_wide,
    "cnn-small": _cnn_small,
    "transformer-layer": _transformer_layer,
    "bert-tiny": _bert_tiny,
    "gpt2-tiny": _gpt2_tiny,
}
REAL_MODELS: dict[str, Callable[[], tuple[torch.nn.Module, tuple]]] = {
    "bert": lambda: _hf("BertConfig", "BertModel", vocab_size=1000, **_TEXT),
    "distilbert": lambda: _hf(
        "DistilBertConfig", "DistilBertModel", vocab_size=1000, dim=256, hidden_dim=1024, n_layers=4, n_heads=4
    ),
    "gpt2": lambda: _hf("GPT2Config", "GPT2Model", vocab_size=1000, n_embd=256, n_layer=4, n_head=4, **_GPT2),
    "llama": lambda: _hf("LlamaConfig", "LlamaModel", vocab_size=1000, num_key_value_heads=2, use_cache=False, **_TEXT),
    "t5-encoder": lambda: _hf("T5Config", "T5EncoderModel", vocab_size=1000, d_model=256, d_ff=1024, num_layers=4),
    "hf-vit": lambda: _hf("ViTConfig", "ViTModel", **_TEXT),
    "resnet18": lambda: _torchvision("resnet18"),
    "mobilenet-v3-small": lambda: _torchvision("mobilenet_v3_small"),
    "vit-tiny": lambda: _timm("vit_tiny_patch16_224"),
    "convnext-atto": lambda: _timm("convnext_atto"),
}
REAL = list(REAL_MODELS)
ALL_MODELS = MODELS | REAL_MODELS
# the module each model needs beyond torch (the others need none)
NEEDS = dict.fromkeys(
    ("bert-tiny", "gpt2-tiny", "bert", "distilbert", "gpt2", "llama", "t5-encoder", "hf-vit"), "transformers"
)
NEEDS |= {"resnet18": "torchvision", "mobilenet-v3-small": "torchvision", "vit-tiny": "timm", "convnext-atto": "timm"}
QUICK = ["lesson", "mlp-wide"]


def build_model(name: str) -> tuple[torch.nn.Module, tuple]:
    torch.manual_seed(0)
    model, inputs = ALL_MODELS[name]()
    return model.eval(), inputs


# --- backends -----------------------------------------------------------------------------------
# Each takes (model, inputs) and returns a callable of the inputs; the clock runs while it
# does so and until the first output. `has_cache` says whether first_call_warm_s means anything.


def _eager(model: torch.nn.Module, inputs: tuple) -> Callable[..., Any]:
    return model


def _braze(model: torch.nn.Module, inputs: tuple) -> Callable[..., Any]:
    import braze

    return braze.compile(model)


def _braze_fast(model: torch.nn.Module, inputs: tuple) -> Callable[..., Any]:
    import braze

    return braze.compile(model, mode="fast")


def _inductor(model: torch.nn.Module, inputs: tuple) -> Callable[..., Any]:
    return torch.compile(model)


def _inductor_freezing(model: torch.nn.Module, inputs: tuple) -> Callable[..., Any]:
    # Intel's recommended CPU inference setting: weights folded into constants, packed for oneDNN.
    return torch.compile(model, options={"freezing": True})


def _torchscript(model: torch.nn.Module, inputs: tuple) -> Callable[..., Any]:
    with torch.no_grad():
        traced = torch.jit.trace(model, inputs, check_trace=False, strict=False)
        return torch.jit.freeze(traced)


def _onnxruntime(model: torch.nn.Module, inputs: tuple) -> Callable[..., Any]:
    import onnxruntime as ort

    path = os.path.join(tempfile.mkdtemp(prefix="braze-onnx-"), "model.onnx")
    names = [f"input{i}" for i in range(len(inputs))]
    with torch.no_grad():
        try:
            torch.onnx.export(model, inputs, path, input_names=names, dynamo=False)
        except Exception:  # e.g. fused ATen ops, Hugging Face models: the TorchDynamo exporter
            torch.onnx.export(model, inputs, path, input_names=names, dynamo=True)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = torch.get_num_threads()
    # ONNX Runtime's threads spin after each run by default and so slow whatever runs next in the
    # process (eager and braze, interleaved with it): 43 ms -> ~290 ms for eager's cnn-small.
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    sess = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])

    def run(*xs: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(sess.run(None, {n: x.numpy() for n, x in zip(names, xs)})[0])

    return run


def _openvino(model: torch.nn.Module, inputs: tuple) -> Callable[..., Any]:
    import openvino as ov

    with torch.no_grad():
        converted = ov.convert_model(model, example_input=inputs if len(inputs) > 1 else inputs[0])
    # f32: OpenVINO's default on a CPU with AVX512-BF16 (this one) is bfloat16 arithmetic, far
    # outside fast mode's accuracy contract; a latency hint and torch's thread count, as braze runs.
    config = {"INFERENCE_PRECISION_HINT": "f32", "PERFORMANCE_HINT": "LATENCY"}
    compiled = ov.Core().compile_model(converted, "CPU", config | {"INFERENCE_NUM_THREADS": torch.get_num_threads()})
    request = compiled.create_infer_request()

    def run(*xs: torch.Tensor) -> torch.Tensor:
        request.infer([x.numpy() for x in xs])
        return torch.from_numpy(request.get_output_tensor(0).data.copy())

    return run


BACKENDS: dict[str, tuple[Callable[..., Callable[..., Any]], bool, str | None]] = {
    # name: (prepare, has a compile cache, module it needs)
    "eager": (_eager, False, None),
    "braze": (_braze, True, None),  # (its kernels' machine code: kernelcache.py)
    "braze-fast": (_braze_fast, True, None),
    "inductor": (_inductor, True, None),
    "inductor-freezing": (_inductor_freezing, True, None),
    "torchscript": (_torchscript, False, None),
    "onnxruntime": (_onnxruntime, False, "onnxruntime"),
    "openvino": (_openvino, False, "openvino"),
}


def register_backend(name: str, prepare: Callable[..., Callable[..., Any]], has_cache: bool = False) -> None:
    BACKENDS[name] = (prepare, has_cache, None)


def _load_plugins() -> None:
    for mod in filter(None, os.environ.get("BRAZE_BENCH_PLUGINS", "").split(",")):
        importlib.import_module(mod)


def _available(module: str | None) -> bool:
    if module is None:
        return True
    try:
        importlib.import_module(module)
        return True
    except ImportError:
        return False


# --- measuring ----------------------------------------------------------------------------------


def first_tensor(out: Any) -> torch.Tensor:
    """The output compared across backends (the first tensor: last_hidden_state for HF models)."""
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    return next(t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor))


def _first_call_worker(model_name: str, backend: str) -> dict[str, Any]:
    """Runs in a fresh process: the time from wrapping to the first output, and peak RSS."""
    model, inputs = build_model(model_name)
    prepare = BACKENDS[backend][0]
    with torch.no_grad():
        t0 = time.perf_counter()
        fn = prepare(model, inputs)
        out = fn(*inputs)
        elapsed = time.perf_counter() - t0
        first_tensor(out)
    return {"first_call_s": elapsed, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _run_worker(model: str, backend: str, cache_dir: str, timeout: float) -> dict[str, Any]:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir, BRAZE_KERNEL_CACHE=cache_dir, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "braze.bench", "--worker", model, backend]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"first call did not finish in {timeout:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"first call failed: {tail[:300]}"}
    return json.loads(lines[-1])


def machine_facts() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    import braze

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "braze": braze.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }


class Progress:
    """One line on stderr: step k of n, what runs now, elapsed time."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled, self.t0 = total, 0, enabled, time.perf_counter()

    def step(self, what: str) -> None:
        self.done += 1
        if self.enabled:
            bar = "#" * int(20 * self.done / self.total)
            sys.stderr.write(
                f"\r[{bar:<20}] {self.done}/{self.total} {time.perf_counter() - self.t0:6.0f} s  {what:<50}"
            )
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


def _empty_row(model: str, backend: str) -> dict[str, Any]:
    keys = ("first_call_s", "first_call_warm_s", "steady_us", "speedup_vs_eager", "equal", "max_abs_diff")
    keys += ("error_ratio",)
    return {"model": model, "backend": backend, **dict.fromkeys(keys), "peak_rss_mb": None, "error": None}


def bench_model(
    name: str, backends: list[str], rounds: int, seconds: float, progress: Progress, timeout: float
) -> list[dict[str, Any]]:
    rows = {b: _empty_row(name, b) for b in backends}
    for b in backends:  # first calls, each in a fresh process
        with tempfile.TemporaryDirectory(prefix="braze-bench-cache-") as cache:
            progress.step(f"{name} x {b}: first call")
            cold = _run_worker(name, b, cache, timeout)
            rows[b].update({k: cold.get(k) for k in ("first_call_s", "peak_rss_mb")})
            rows[b]["error"] = cold.get("error")
            if BACKENDS[b][1] and "error" not in cold:
                progress.step(f"{name} x {b}: first call, warm cache")
                rows[b]["first_call_warm_s"] = _run_worker(name, b, cache, timeout).get("first_call_s")
    _steady(name, backends, rows, rounds, seconds, progress)
    return list(rows.values())


def _steady(name: str, backends: list[str], rows: dict, rounds: int, seconds: float, progress: Progress) -> None:
    model, inputs = build_model(name)
    fns: dict[str, Callable[..., Any]] = {}
    with torch.no_grad():
        reference = first_tensor(model(*inputs))
        doubles = (t.double() if t.is_floating_point() else t for t in inputs)
        exact = first_tensor(copy.deepcopy(model).double()(*doubles))  # the float64 reference
        for b in backends:
            if rows[b]["error"] and b != "eager":
                continue
            progress.step(f"{name} x {b}: compile for timing")
            try:
                fn = BACKENDS[b][0](model, inputs)
                out = first_tensor(fn(*inputs))
            except Exception as e:  # a backend failing on a model is a result, not a crash
                rows[b]["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                continue
            rows[b]["equal"] = bool(out.shape == reference.shape and torch.equal(out, reference))
            same = out.shape == reference.shape
            rows[b]["max_abs_diff"] = float((out.double() - reference.double()).abs().max()) if same else None
            rows[b]["error_ratio"] = measure(out, reference, exact).max_ratio if same else None
            fns[b] = fn
        progress.step(f"{name}: interleaved timing of {len(fns)} backends")
        if "eager" not in fns:
            return
        result = timing.compare(fns, inputs, rounds=rounds, seconds=seconds)
    for b in fns:
        rows[b]["steady_us"] = result[b].us
        rows[b]["speedup_vs_eager"] = result.speedup(b, "eager")


# --- reporting ----------------------------------------------------------------------------------


def _fmt_s(v: float | None) -> str:
    return "-" if v is None else (f"{v * 1e3:.0f}ms" if v < 1 else f"{v:.1f}s")


def table(results: list[dict[str, Any]], backends: list[str]) -> str:
    models = list(dict.fromkeys(r["model"] for r in results))
    cell = {(r["model"], r["backend"]): r for r in results}
    head = "| model | " + " | ".join(backends) + " |"
    lines = [head, "|---" * (len(backends) + 1) + "|"]
    for m in models:
        cells = []
        for b in backends:
            r = cell.get((m, b))
            if r is None or (r["error"] and r["steady_us"] is None):
                cells.append("failed" if r else "-")
                continue
            ok = "=" if r["equal"] else f"~{r['max_abs_diff']:.0e}" if r["max_abs_diff"] is not None else "?"
            ok += f" ({r['error_ratio']:.1f}x)" if not r["equal"] and r.get("error_ratio") is not None else ""
            cells.append(f"{_fmt_s(r['first_call_s'])} / {r['steady_us']:.1f}us / {r['speedup_vs_eager']:.2f}x {ok}")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(
        "cell: first call / steady-state per call / speed-up vs eager; '=' torch.equal to eager, '~d' max |diff|,"
        " (rx) its largest error against float64 as a multiple of eager's"
    )
    errors = [f"- {r['model']} x {r['backend']}: {r['error']}" for r in results if r["error"]]
    return "\n".join(lines + (["", "errors:"] + errors if errors else []))


def chart(results: list[dict[str, Any]], backends: list[str], path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'braze[bench]'): no chart"
    models = list(dict.fromkeys(r["model"] for r in results))
    cell = {(r["model"], r["backend"]): r for r in results}
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(8, 1.6 * len(models) * len(backends) / 3), 8))
    width = 0.8 / len(backends)
    for i, b in enumerate(backends):
        xs = [m_i + i * width for m_i in range(len(models))]
        speed = [(cell.get((m, b)) or {}).get("speedup_vs_eager") or 0 for m in models]
        first = [(cell.get((m, b)) or {}).get("first_call_s") or 0 for m in models]
        ax1.bar(xs, speed, width, label=b)
        ax2.bar(xs, first, width, label=b)
    for ax in (ax1, ax2):
        ax.set_xticks([m_i + 0.4 - width / 2 for m_i in range(len(models))], models)
    ax1.axhline(1.0, color="black", linewidth=0.8)
    ax1.set_ylabel("steady-state speed-up vs eager (higher is better)")
    ax2.set_yscale("log")
    ax2.set_ylabel("first call, seconds (log; lower is better)")
    ax1.legend(ncol=len(backends), fontsize=8)
    fig.suptitle("braze bench: " + machine_facts()["cpu"])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


# --- command line -------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--models", default=None, help=f"comma-separated, from {', '.join(ALL_MODELS)}; 'real': the real models"
    )
    p.add_argument("--backends", default=None, help=f"comma-separated, from {', '.join(BACKENDS)}")
    p.add_argument("--out", default="bench-out", help="folder for results.json and results.png")
    p.add_argument("--quick", action="store_true", help="lesson and mlp-wide only, fewer rounds")
    p.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds (default 7, quick 3)")
    p.add_argument("--timeout", type=float, default=900, help="seconds allowed for one first call")


def _select(arg: str | None, known: dict, default: list[str]) -> list[str]:
    names = default if arg is None else [n.strip() for n in arg.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"braze bench: unknown {unknown}; choose from {list(known)}")
    return names


def main(args: argparse.Namespace) -> int:
    _load_plugins()
    default_models = QUICK if args.quick else list(MODELS)
    models = _select(args.models, ALL_MODELS | {"real": None}, default_models)
    models = [r for m in models for r in (REAL if m == "real" else [m])]
    notes = []
    missing = [m for m in models if not _available(NEEDS.get(m))]
    if missing:
        needed = ", ".join(sorted({NEEDS[m] for m in missing}))
        notes.append(f"skipped {', '.join(missing)}: {needed} cannot be imported (README, 'braze bench')")
        models = [m for m in models if m not in missing]
    default_backends = [b for b, (_, _, mod) in BACKENDS.items() if _available(mod)]
    backends = _select(args.backends, BACKENDS, default_backends)
    if "eager" not in backends:
        backends = ["eager"] + backends  # every speed-up is relative to it
    rounds = args.rounds or (3 if args.quick else 7)
    seconds = 0.1 if args.quick else 0.2
    cached = sum(BACKENDS[b][1] for b in backends)
    progress = Progress(len(models) * (2 * len(backends) + cached + 1), sys.stderr.isatty())
    results = []
    for m in models:
        results += bench_model(m, backends, rounds, seconds, progress, args.timeout)
    progress.close()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"machine": machine_facts(), "results": results}, f, indent=2)
    note = chart(results, backends, os.path.join(args.out, "results.png"))
    print(table(results, backends))
    for n in notes + ([note] if note else []):
        print(f"note: {n}")
    print(f"wrote {os.path.join(args.out, 'results.json')}" + ("" if note else " and results.png"))
    return 0


if __name__ == "__main__":
    # Run as `python -m braze.bench --worker MODEL BACKEND`; use the package's module, which
    # is the one plugins register backends in (this file runs as a second copy, __main__).
    from braze import bench as _bench

    if len(sys.argv) != 4 or sys.argv[1] != "--worker":
        sys.exit("usage: python -m braze.bench --worker MODEL BACKEND (the benchmark itself: braze bench)")
    _bench._load_plugins()
    print(json.dumps(_bench._first_call_worker(sys.argv[2], sys.argv[3])))
