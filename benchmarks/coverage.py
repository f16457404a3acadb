"""Coverage: many architectures through braze, as a user would try them (random weights).

    python benchmarks/coverage.py                 # every model (about 15 minutes on 2 cores)
    python benchmarks/coverage.py text            # Hugging Face text models only
    python benchmarks/coverage.py vision          # Hugging Face, torchvision and timm vision models
    python benchmarks/coverage.py falcon,bart     # by name
    python benchmarks/coverage.py --speed [...]   # exact and fast mode's speed-up vs eager instead

For each model: exact mode against eager (`torch.equal`, at two input shapes), what braze ran
eagerly (its warnings), how many programs (and native bodies) and ATen calls, the first call's time, and fast mode's
accuracy contract (braze.check_accuracy). Not a test (too slow for the suite): a sweep to rerun
after changes to capture or lowering. torchvision's and timm's models are skipped where those
packages cannot be imported. With --speed, each model's first input is timed instead: eager,
exact and fast mode interleaved in one process (braze.timing.compare), the median of the
per-round ratios (about 20 minutes for all).
"""

from __future__ import annotations

import copy
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

import braze
import braze.bench  # noqa: F401  (lets torchvision's model code import beside CPU torch)
from braze import timing

_SMALL = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 128}
_TEXT = {**_SMALL, "vocab_size": 500}
_DECODER = {**_TEXT, "use_cache": False}
_VISION = {**_SMALL, "image_size": 32}


def _hf(config: str, model: str, **kw: Any) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        import transformers

        return getattr(transformers, model)(getattr(transformers, config)(**kw)).eval()

    return build


def _ids(batch: int, length: int) -> tuple:
    return (torch.randint(0, 500, (batch, length)),)


def _encoder_decoder(batch: int, length: int) -> tuple:
    return (torch.randint(0, 500, (batch, length)), None, torch.randint(0, 500, (batch, length)))


def _image(batch: int, size: int) -> tuple:
    return (torch.randn(batch, 3, size, size),)


# Each text model's two calls: (batch, length)
TEXT_SHAPES = [(1, 16), (2, 37)]
TEXT = {
    "roberta": _hf("RobertaConfig", "RobertaModel", **_TEXT),
    "albert": _hf("AlbertConfig", "AlbertModel", embedding_size=32, **_TEXT),
    "electra": _hf("ElectraConfig", "ElectraModel", embedding_size=32, **_TEXT),
    "deberta-v2": _hf("DebertaV2Config", "DebertaV2Model", **_TEXT),
    "mpnet": _hf("MPNetConfig", "MPNetModel", **_TEXT),
    "mistral": _hf("MistralConfig", "MistralModel", num_key_value_heads=1, **_DECODER),
    "qwen2": _hf("Qwen2Config", "Qwen2Model", num_key_value_heads=1, **_DECODER),
    "qwen3": _hf("Qwen3Config", "Qwen3Model", num_key_value_heads=1, head_dim=32, **_DECODER),
    "phi": _hf("PhiConfig", "PhiModel", **_DECODER),
    "phi3": _hf("Phi3Config", "Phi3Model", pad_token_id=0, **_DECODER),
    "gemma": _hf("GemmaConfig", "GemmaModel", num_key_value_heads=1, head_dim=32, **_DECODER),
    "gemma2": _hf("Gemma2Config", "Gemma2Model", num_key_value_heads=1, head_dim=32, **_DECODER),
    "gpt-neox": _hf("GPTNeoXConfig", "GPTNeoXModel", **_DECODER),
    "falcon": _hf("FalconConfig", "FalconModel", **{k: v for k, v in _DECODER.items() if k != "intermediate_size"}),
    "opt": _hf(
        "OPTConfig",
        "OPTModel",
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        ffn_dim=128,
        word_embed_proj_dim=64,
        vocab_size=500,
        use_cache=False,
    ),
    "bloom": _hf("BloomConfig", "BloomModel", hidden_size=64, n_layer=2, n_head=2, vocab_size=500, use_cache=False),
    "gptj": _hf(
        "GPTJConfig", "GPTJModel", n_embd=64, n_layer=2, n_head=2, rotary_dim=16, vocab_size=500, use_cache=False
    ),
}
_SEQ2SEQ = {"vocab_size": 500, "use_cache": False}
SEQ2SEQ = {
    "bart": _hf(
        "BartConfig",
        "BartModel",
        d_model=64,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        **_SEQ2SEQ,
    ),
    "t5": _hf("T5Config", "T5Model", d_model=64, d_ff=128, num_layers=1, num_heads=2, d_kv=32, **_SEQ2SEQ),
}
HF_VISION = {
    "deit": _hf("DeiTConfig", "DeiTModel", patch_size=8, **_VISION),
    "clip-vision": _hf("CLIPVisionConfig", "CLIPVisionModel", patch_size=8, **_VISION),
    "swin": _hf(
        "SwinConfig",
        "SwinModel",
        image_size=32,
        patch_size=4,
        embed_dim=32,
        depths=[1, 1],
        num_heads=[2, 2],
        window_size=4,
    ),
    "convnext-hf": _hf("ConvNextConfig", "ConvNextModel", hidden_sizes=[16, 32], depths=[1, 1], num_stages=2),
    "resnet-hf": _hf("ResNetConfig", "ResNetModel", hidden_sizes=[16, 32], depths=[1, 1], embedding_size=16),
    "mobilevit-hf": _hf("MobileViTConfig", "MobileViTModel", image_size=64),
    "segformer": _hf(
        "SegformerConfig", "SegformerModel", hidden_sizes=[16, 32, 40, 64], num_encoder_blocks=4, depths=[1, 1, 1, 1]
    ),
}


def _torchvision(name: str, **kw: Any) -> Callable[[], torch.nn.Module]:
    return lambda: getattr(__import__("torchvision").models, name)(**kw).eval()


def _timm(name: str) -> Callable[[], torch.nn.Module]:
    return lambda: __import__("timm").create_model(name, pretrained=False).eval()


VISION = {
    "tv-squeezenet": _torchvision("squeezenet1_1"),
    "tv-shufflenet": _torchvision("shufflenet_v2_x0_5"),
    "tv-mnasnet": _torchvision("mnasnet0_5"),
    "tv-efficientnet": _torchvision("efficientnet_b0"),
    "tv-regnet": _torchvision("regnet_y_400mf"),
    "tv-googlenet": _torchvision("googlenet", init_weights=True, aux_logits=False),
    "tv-densenet": _torchvision("densenet121"),
    "tv-mobilenet-v2": _torchvision("mobilenet_v2"),
    "tv-alexnet": _torchvision("alexnet"),
    "tm-efficientnet-b0": _timm("efficientnet_b0"),
    "tm-regnetx": _timm("regnetx_002"),
    "tm-ghostnet": _timm("ghostnet_100"),
    "tm-deit-tiny": _timm("deit_tiny_patch16_224"),
    "tm-mixer": _timm("mixer_s32_224"),
    "tm-levit": _timm("levit_128s"),
    "tm-mobilevit": _timm("mobilevit_xxs"),
    "tm-resnet50": _timm("resnet50"),
    "tm-swin": _timm("swin_tiny_patch4_window7_224"),
    "tm-poolformer": _timm("poolformer_s12"),
    "tm-mobilenetv4": _timm("mobilenetv4_conv_small"),
    "tm-fastvit": _timm("fastvit_t8"),
    "tm-efficientvit": _timm("efficientvit_b0"),
    "tm-repvit": _timm("repvit_m0_9"),
    "tm-edgenext": _timm("edgenext_xx_small"),
}
# Models whose input size is fixed by their layers (position tables, windows, token mixing)
_FIXED_SIZE = ("deit", "mixer", "levit", "swin", "fastvit", "efficientvit")

torch.manual_seed(0)  # (the calls' inputs are drawn here, at import: the same ones every run)
MODELS: dict[str, tuple[Callable[[], torch.nn.Module], list[tuple]]] = {
    **{n: (b, [_ids(*s) for s in TEXT_SHAPES]) for n, b in TEXT.items()},
    **{n: (b, [_encoder_decoder(*s) for s in TEXT_SHAPES]) for n, b in SEQ2SEQ.items()},
    **{n: (b, [_image(k, 64 if "mobilevit" in n else 32) for k in (1, 2)]) for n, b in HF_VISION.items()},
    **{
        n: (b, [_image(1, 224), _image(2, 224 if any(f in n for f in _FIXED_SIZE) else 160)]) for n, b in VISION.items()
    },
}
GROUPS = {"text": [*TEXT, *SEQ2SEQ], "vision": [*HF_VISION, *VISION]}


def _copies(inputs: tuple) -> tuple:
    return tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in inputs)


def _same(a: Any, b: Any) -> bool:
    la, lb = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
    return len(la) == len(lb) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(la, lb)
    )


def check(name: str, model: torch.nn.Module, calls: list[tuple]) -> str:
    """One model's line of the report."""
    exact, first = [], 0.0
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always", braze.BrazeWarning)
        compiled = braze.compile(model)
        for inputs in calls:
            try:
                expected = model(*_copies(inputs))
            except Exception as e:  # noqa: BLE001
                exact.append(f"eager raises {type(e).__name__}")
                continue
            t0 = time.perf_counter()
            try:
                actual = compiled(*_copies(inputs))
                exact.append("equal" if _same(actual, expected) else "DIFFERENT")
            except Exception as e:  # noqa: BLE001  (reported, and the sweep goes on)
                exact.append(f"RAISED {type(e).__name__}: {str(e)[:100]}")
            first = first or time.perf_counter() - t0
    eagerly = sorted({str(w.message)[:100] for w in caught if issubclass(w.category, braze.BrazeWarning)})
    programs = compiled.programs()
    aten = sum(len(p.externs) for p in programs)
    native = sum(p.native for p in programs)  # one native body, its ATen calls made from it
    try:
        acc = braze.check_accuracy(model, *calls[0], mode="fast")
        fast = (
            f"fast {'within' if acc.ok else 'OUTSIDE'} the contract (max {acc.max_ratio:.2f}, rms {acc.rms_ratio:.2f})"
        )
    except Exception as e:  # noqa: BLE001
        fast = f"fast RAISED {type(e).__name__}: {str(e)[:100]}"
    ran = f"; ran eagerly: {eagerly}" if eagerly else ""
    return (
        f"{name:20s} exact {exact}, {len(programs)} programs ({native} native bodies), {aten} ATen calls, "
        f"first call {first:.2f} s; {fast}{ran}"
    )


def speed(name: str, model: torch.nn.Module, calls: list[tuple]) -> str:
    """One model's speed-ups vs eager, exact and fast mode, on its first input."""
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore", braze.BrazeWarning)
        # (a copy for fast mode: TorchDynamo keeps one cache per code object and model)
        fast = braze.compile(copy.deepcopy(model), mode="fast")
        fns = {"eager": model, "exact": braze.compile(model), "fast": fast}
        timed = timing.compare(fns, calls[0], rounds=11, seconds=0.02)
    eager = timed["eager"].us / 1e3
    ratios = ", ".join(f"{mode} {timed.speedup(mode, 'eager'):.2f}x" for mode in ("exact", "fast"))
    return f"{name:20s} eager {eager:8.3f} ms; {ratios}"


def main(which: str, report: Callable[[str, torch.nn.Module, list[tuple]], str] = check) -> None:
    torch.set_num_threads(2)
    torch.manual_seed(0)
    names = GROUPS.get(which) or (list(MODELS) if which == "all" else which.split(","))
    for name in names:
        build, calls = MODELS[name]
        try:
            model = build()
        except ImportError as e:
            print(f"{name:20s} skipped ({e.name or e} cannot be imported)", flush=True)
            continue
        print(report(name, model, calls), flush=True)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--speed"]
    main(args[0] if args else "all", speed if "--speed" in sys.argv else check)
