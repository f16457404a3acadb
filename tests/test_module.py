"""braze.compile(module) behaves like the module (as torch.compile's OptimizedModule does), and
travels: pickle, deepcopy, torch.save/torch.load, worker processes (issue 12)."""

from __future__ import annotations

import copy
import io
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import braze

from .helpers import check_model


def lesson() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)).eval()


X = torch.randn(32, 64)


def in_a_fresh_process(*lines: str) -> None:
    """Run `lines` in a new Python process; they must finish without an error."""
    code = "\n".join([*lines, "print('ok')"])
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "ok", result.stderr


def test_a_compiled_module_is_a_module_like_the_original():
    model = lesson()
    compiled = braze.compile(model)
    assert isinstance(compiled, nn.Module) and compiled._orig_mod is model
    assert not isinstance(braze.compile(torch.relu), nn.Module), "a function's wrapper stays a function"
    assert compiled.state_dict().keys() == model.state_dict().keys()
    assert [p is q for p, q in zip(compiled.parameters(), model.parameters())] == [True] * 4
    assert compiled.training is False
    assert compiled.train() is compiled and model.training and model[0].training
    assert compiled.eval() is compiled and not model.training
    assert dict(compiled.named_children()) == {"_orig_mod": model}
    model.threshold = 0.5
    assert compiled.threshold == 0.5, "other attributes are the model's"
    check_model(model, (X,), compiled=compiled, kernels=2, externs=0)
    assert type(compiled).__call__ is compiled.programs()[0].entry, "still the native entry"


def test_state_dict_loads_into_either():
    model, other = lesson(), lesson()
    torch.nn.init.normal_(other[0].weight)
    compiled = braze.compile(model)
    check_model(model, (X,), compiled=compiled)
    compiled.load_state_dict(other.state_dict())
    assert torch.equal(model[0].weight, other[0].weight)
    check_model(other, (X,), compiled=compiled)
    lesson().load_state_dict(compiled.state_dict())


def test_to_reaches_the_model():
    model = lesson()
    compiled = braze.compile(model)
    check_model(model, (X,), compiled=compiled)
    compiled.to(torch.float64)
    assert model[0].weight.dtype == torch.float64
    check_model(model, (X.double(),), compiled=compiled)


def test_pickle_deepcopy_and_torch_save_round_trips():
    model = lesson()
    compiled = braze.compile(model, cache_size=3)
    check_model(model, (X,), compiled=compiled)
    buffer = io.BytesIO()
    torch.save(compiled, buffer)
    copies = [pickle.loads(pickle.dumps(compiled)), copy.deepcopy(compiled)]
    buffer.seek(0)
    copies.append(torch.load(buffer, weights_only=False))
    for c in copies:
        assert isinstance(c, braze.CompiledModule) and c.cache_size == 3 and c.programs() == []
        assert c._orig_mod is not model
        check_model(model, (X,), compiled=c, kernels=2)  # the same weights, compiled again


def test_a_pickled_compiled_model_runs_in_a_fresh_process(tmp_path):
    model = lesson()
    compiled = braze.compile(model)
    torch.save((compiled, X, model(X).detach()), tmp_path / "compiled.pt")
    in_a_fresh_process(
        "import torch, braze",
        f"compiled, x, expected = torch.load({str(tmp_path / 'compiled.pt')!r}, weights_only=False)",
        "with torch.no_grad():",
        "    assert torch.equal(compiled(x), expected)",
        "assert len(compiled.compilations) == 1",
    )


def test_the_worker_pool_example_serves_eagers_answers():
    script = Path(__file__).parent.parent / "examples" / "serve_pool.py"
    args = [sys.executable, str(script), "--workers", "2", "--requests", "12"]
    result = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert result.stdout.strip() == "12 answers, every one torch.equal to eager", result.stderr


def test_another_torch_is_said_at_import_and_models_still_answer():
    in_a_fresh_process(
        "import warnings, torch",
        "torch.__version__ = '2.99.0'",
        "with warnings.catch_warnings(record=True) as said:",
        "    warnings.simplefilter('always')",
        "    import braze",
        "assert any('tested with torch 2.13' in str(w.message) for w in said), [str(w.message) for w in said]",
        "m = torch.nn.Linear(4, 2).eval()",
        "x = torch.randn(3, 4)",
        "with torch.no_grad():",
        "    assert torch.equal(braze.compile(m)(x), m(x))",
    )


def test_a_torch_whose_tensors_are_laid_out_otherwise_is_refused():
    from braze import jit

    cpu = jit._torch_lib("libtorch_cpu.so")
    jit._check_tensor_layout(cpu)
    before, jit.KEYSET_OFFSET = jit.KEYSET_OFFSET, jit.KEYSET_OFFSET + 8
    try:
        with pytest.raises(RuntimeError, match="lays out tensor objects differently"):
            jit._check_tensor_layout(cpu)
    finally:
        jit.KEYSET_OFFSET = before


@pytest.mark.parametrize("torch_first", [False, True])
def test_importing_braze_puts_torchs_objects_beyond_the_collector(torch_first):
    # (a full collection of them in a first call cost 60-75 ms: `braze demo` imports braze before
    # torch, and the freeze then held braze's few objects only)
    code = ("import torch; " if torch_first else "") + "import gc, braze; print(gc.get_freeze_count())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout.strip()) > 100_000
