"""The native entry: what its guard refuses, what a native body returns, and that it neither
leaks nor crashes (it handles reference counts and raw pointers itself)."""

from __future__ import annotations

import gc
import resource
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

import braze
from braze.entry import W
from braze.runtime import MISS

from .helpers import assert_same, check_model


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)).eval()


def program(compiled: braze.CompiledModule) -> braze.runtime.Program:
    (prog,) = compiled.programs()
    return prog


def compiled_for(model: nn.Module, *args: torch.Tensor) -> tuple[braze.CompiledModule, braze.runtime.Program]:
    compiled = braze.compile(model)
    check_model(model, args, compiled=compiled)
    return compiled, program(compiled)


def test_a_matching_call_goes_straight_to_the_native_entry():
    compiled = check_model(mlp(), (torch.randn(8, 16),))
    prog = program(compiled)
    assert prog.native and type(compiled).__call__ is prog.entry
    assert type(compiled) is not braze.CompiledModule and isinstance(compiled, braze.CompiledModule)
    assert type(braze.compile(mlp())) is not type(compiled)  # one class per wrapper


@pytest.mark.parametrize(
    "fn,why",
    [
        (lambda x: (x * 2, x + 1), ""),  # a tuple of fresh tensors
        (lambda x: x.relu().view(-1), ""),  # a whole-buffer view is allocated as itself
        (lambda x: {"y": x * 2}, "it returns a dict"),  # other structures: the Python body
        (lambda x: ((x * 2, x + 1), x - 1), "it returns nested tuples"),
        (lambda x: (x * 2, x), "output 1 is an input or parameter, or a view of it"),
        (lambda x: torch.sinh(x) * 2, "the ATen call torch.sinh stays in Python: native code calls no op"),
        (lambda x: (x * 2)[1:], "output 0 is part of a buffer it computes, or a view of it"),
        (lambda x: torch.roll(x, 1, 0), ""),  # what an ATen call of the native body returns
        (lambda x: (torch.roll(x, 1, 0), x * 2), ""),
        (lambda x: (torch.roll(x, 1, 0),) * 2, "output 1 returns an ATen call's result a second time"),
        (lambda x: torch.roll(x, 1, 0)[1:], "output 0 is a view of part of an ATen call's result"),
        (lambda x: (torch.roll(x, 1, 0).view(-1), x + 1), ""),  # all of one, viewed
    ],
    ids=[
        "tuple",
        "view",
        "dict",
        "nested",
        "input",
        "extern",
        "slice",
        "aten",
        "aten-tuple",
        "aten-twice",
        "aten-slice",
        "aten-view",
    ],
)
def test_native_or_python_body(fn, why):
    compiled = braze.compile(fn)
    x = torch.randn(6, 5)
    for _ in range(2):  # the second call takes the entry
        check_model(fn, (x,), compiled=compiled)
    prog = program(compiled)
    assert prog.native == (not why) and prog.python_body_why.startswith(why)
    body = "native" if not why else f"generated Python ({why}"
    assert f"body: {body}" in str(braze.explain(fn, x))  # explain says why


def test_a_linear_on_a_3d_input_is_native():
    # The GEMM writes a 2-D buffer; the 3-D output is allocated as such and returned.
    compiled = braze.compile(nn.Linear(8, 3).eval())
    for _ in range(2):
        check_model(compiled.fn, (torch.randn(2, 5, 8),), compiled=compiled)
    assert program(compiled).native


class _PassThrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_the_guard_refuses_what_the_program_was_not_compiled_for():
    model, x = mlp(), torch.randn(8, 16)
    compiled, prog = compiled_for(model, x)
    prog.bind(lambda *a, **k: MISS)  # see the refusals instead of the slow path
    with torch.no_grad():
        assert prog.entry(x) is not MISS
        for args, kwargs in [
            ((torch.randn(9, 16),), {}),  # shape
            ((torch.randn(16, 8).t(),), {}),  # strides
            ((x.double(),), {}),  # dtype
            ((x, x), {}),  # argument count
            ((), {"inputs": x}),  # a keyword naming no parameter
            ((x,), {"input": x}),  # a parameter given twice
            (("text",), {}),  # not a tensor
            ((torch._neg_view(x),), {}),  # a lazily negated tensor: dispatch keys
        ]:
            assert prog.entry(*args, **kwargs) is MISS, (args, kwargs)
        assert_same(prog.entry(input=x), model(x))  # keywords naming the parameters: bound natively
        model.train()  # no module of this model reads its flag: the program still holds, once the
        assert prog.entry(x) is MISS  # slow path has seen that nothing else of the layers changed
        assert prog.rearm((x,)) == ""
        assert_same(prog.entry(x), model(x))
        model.eval()
        assert prog.rearm((x,)) == ""
        with torch.device("cpu"):  # a TorchFunctionMode
            assert prog.entry(x) is MISS
        with _PassThrough():  # a TorchDispatchMode
            assert prog.entry(x) is MISS
        with torch.autocast("cpu"):
            assert prog.entry(x) is MISS
        assert prog.entry(x) is not MISS
    assert prog.entry(x.clone().requires_grad_()) is MISS  # grad mode on and an input requires grad
    model[0].weight.requires_grad_(True)
    assert prog.entry(x) is MISS  # grad mode on and a parameter requires grad
    with torch.no_grad():
        model[0].weight.data = torch.randn(32, 16).t().contiguous().t()  # same shape, other strides
        assert prog.entry(x) is MISS


class _Halves(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return self.fc(x) * (0.5 if self.training else 1.0)


@pytest.mark.parametrize(
    "model,guarded",
    [
        (mlp(), []),  # Linear and ReLU never read their flag; Sequential only loops
        (nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.1)).eval(), ["1"]),  # the dropout was decided on
        (_Halves().eval(), [""]),  # its forward was inlined: it may branch on the flag
    ],
    ids=["mlp", "dropout", "custom-forward"],
)
def test_the_entry_checks_only_the_training_flags_the_program_depends_on(model, guarded):
    compiled, prog = compiled_for(model, torch.randn(4, 16))
    names = {id(m): name for name, m in model.named_modules()}
    assert [names[id(m)] for m in prog.flag_modules] == guarded


def test_specialised_python_arguments_are_checked_natively():
    def f(x, scale, shift):
        return x * scale + shift

    compiled = braze.compile(f)
    x = torch.randn(5)
    for scale, shift in [(2.0, 1), (2.0, 1), (3, 1), (2.0, 0.5), (2.0, True)]:
        check_model(f, (x, scale, shift), compiled=compiled)
    prog = compiled.programs()[0]
    prog.bind(lambda *a, **k: MISS)
    assert prog.entry(x, 2.0, 1) is not MISS
    assert prog.entry(x, 2, 1) is MISS  # same value, other type
    assert prog.entry(x, 2.5, 1) is MISS
    assert prog.entry(x, 2.0, True) is MISS


def test_replaced_parameter_data_is_read_without_recompiling():
    model = mlp()
    compiled = braze.compile(model)
    x = torch.randn(8, 16)
    check_model(model, (x,), compiled=compiled)
    with torch.no_grad():
        model[2].weight.data = torch.randn(32, 32)  # new memory, same layout
    check_model(model, (x,), compiled=compiled)
    assert len(compiled.programs()) == 1
    model.double()  # a new dtype: compiled again
    check_model(model, (x.double(),), compiled=compiled)


def test_outputs_are_inference_tensors_under_inference_mode():
    model = mlp()
    compiled = braze.compile(model)
    x = torch.randn(8, 16)
    with torch.inference_mode():
        for _ in range(2):
            out = compiled(x)
            assert out.is_inference() == model(x).is_inference()
    with torch.no_grad():
        assert not compiled(x).is_inference()


def test_zero_size_and_scalar_outputs():
    check_model(lambda x: (x * 2, x.sum(0) * 0 + 1), (torch.randn(0, 3),))
    compiled = braze.compile(lambda x: x * 2)
    for x in (torch.randn(0, 5), torch.randn(0, 5), torch.tensor(3.0), torch.tensor(3.0)):
        check_model(compiled.fn, (x,), compiled=compiled)


def test_no_reference_is_leaked_or_lost():
    model = mlp()
    compiled = braze.compile(model)
    x, other = torch.randn(8, 16), torch.randn(3, 16)
    watched = (x, other, MISS, compiled, *model.parameters())
    with torch.no_grad():
        for _ in range(2):  # both programs compiled, each entered once
            compiled(x)
            compiled(other)
        gc.collect()
        refs = [sys.getrefcount(o) for o in watched]
        for _ in range(1000):
            out = compiled(x)
        del out
        for _ in range(100):
            compiled(other)  # a miss each time: the slow path, then the other program's entry
            compiled(x)
        gc.collect()
        assert [sys.getrefcount(o) for o in watched] == refs


def _grown_mb(fn, x, calls: int) -> float:
    fn(x)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for _ in range(calls):
        fn(x)
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024


def test_outputs_and_their_handles_are_freed():
    compiled = braze.compile(lambda x: x * 2)
    assert _grown_mb(compiled, torch.randn(1 << 20), 500) < 100  # 4 MB outputs: 2 GB if kept
    assert _grown_mb(compiled, torch.randn(1), 300_000) < 4  # a lost 8-byte handle a call: ~10 MB


def test_a_second_thread_inside_the_program_gets_buffers_of_its_own():
    model, x = mlp(), torch.randn(64, 16)
    compiled, prog = compiled_for(model, x)
    assert prog.layout.scratch_bytes, "the test needs a program with scratch buffers"
    words = prog._descriptor.words
    words[W["busy"]] = 1  # as if another thread were running it now
    try:
        check_model(model, (x,), compiled=compiled)
    finally:
        words[W["busy"]] = 0


def test_bad_outputs_of_a_binding_are_not_native_concerns():
    # The slow path's own answer (here an exception from eager) passes through the entry.
    model = mlp()
    compiled = braze.compile(model)
    with torch.no_grad():
        compiled(torch.randn(2, 16))
        with pytest.raises(RuntimeError):
            compiled(torch.randn(2, 17))
        assert_same(compiled(torch.ones(2, 16)), model(torch.ones(2, 16)))


def test_a_python_body_drops_intermediates_after_their_last_use():
    # As eager does: ATen's next allocation then reuses their memory instead of faulting in pages.
    layers = (nn.Conv2d(3, 8, 3), nn.Conv2d(8, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3), nn.Softplus())
    model = nn.Sequential(*layers).eval()  # (softplus: an ATen call native code does not make)
    compiled = check_model(model, (torch.randn(2, 3, 16, 16),))
    source = program(compiled).source
    assert "del e3" in source and source.index("del e3") < source.index("_seg0")  # the first convolution's


def test_keyword_calls_take_the_native_entry():
    class Two(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)

        def forward(self, x, y, scale=2.0):
            return torch.relu(self.fc(x)) * scale + y

    model = Two().eval()
    compiled = braze.compile(model)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    with torch.no_grad():
        compiled(x, y, 2.0)
        slow = compiled._slow_calls
        for call in ({"x": x, "y": y, "scale": 2.0}, {"y": y, "x": x, "scale": 2.0}, {"scale": 2.0, "y": y, "x": x}):
            assert torch.equal(compiled(**call), model(**call))
        assert torch.equal(compiled(x, y=y, scale=2.0), model(x, y=y, scale=2.0))
        assert compiled._slow_calls == slow, "keywords naming every parameter are bound natively"
        assert torch.equal(compiled(x, y), model(x, y))  # the default filled in on the slow path
        assert torch.equal(compiled(x, y=y, scale=3.0), model(x, y=y, scale=3.0))  # another constant
        for bad in ({"x": x, "z": y, "scale": 2.0}, {"x": x, "y": y, "scale": 2.0, "w": 1}):
            with pytest.raises(TypeError) as eager_error:
                model(**bad)
            with pytest.raises(TypeError) as braze_error:
                compiled(**bad)
            assert str(braze_error.value) == str(eager_error.value)
        with pytest.raises(TypeError):
            compiled(x, x=x, y=y)  # given twice
    assert compiled._dynamo is None, "a bad keyword call does not hand the model to TorchDynamo"


class _Attention(nn.Module):
    """Scores through ATen's sdpa (its optional tensor and float arguments given), then a gather
    by a buffer of indices: two ATen calls between native kernels."""

    def __init__(self, causal: bool) -> None:
        super().__init__()
        self.qkv, self.causal = nn.Linear(16, 48), causal
        self.register_buffer("order", torch.tensor([[2, 0, 1, 3]]))

    def forward(self, x, mask):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 2, 8).permute(2, 0, 3, 1, 4)
        mask = None if self.causal else mask
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal, scale=0.3)
        y = y.transpose(1, 2).reshape(b, t, 16)
        return torch.gather(y[:, :, :4], 2, self.order.expand(b, t, 4)) * 2 + 1


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_aten_calls_of_dispatched_ops_run_from_the_native_body(causal, threads):
    model = _Attention(causal).eval()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for t in (1, 7, 33):
            x, mask = torch.randn(2, t, 16), torch.randn(2, 1, t, t)
            compiled, prog = compiled_for(model, x, mask)
            assert prog.native and prog._body_globals is None  # no Python body made
            for _ in range(2):  # the second call takes the entry
                check_model(model, (x, mask), compiled=compiled)
        torch._dynamo.reset()  # (explain's TorchDynamo capture counts towards its recompile limit)
        report = braze.explain(model, x, mask)
        assert report.count("called from native code") == 2 and "body: native" in report, report
    finally:
        torch.set_num_threads(before)


def test_a_failing_aten_call_raises_what_eager_raises_without_recompiling():
    model, x, mask = _Attention(False).eval(), torch.randn(2, 5, 16), torch.randn(2, 1, 5, 5)
    compiled, prog = compiled_for(model, x, mask)
    assert prog.native
    with torch.no_grad():
        model.order[0, 1] = 9  # out of range for gather: the call raises inside the native body
        with pytest.raises(RuntimeError) as eager:
            model(x, mask)
        with pytest.raises(RuntimeError) as ours:
            compiled(x, mask)
        assert str(ours.value) == str(eager.value)
        model.order[0, 1] = 3
        check_model(model, (x, mask), compiled=compiled)
    assert compiled.programs() == [prog] and braze.debug.compilations(compiled).count("\n") == 0


def test_an_aten_result_laid_out_otherwise_than_compiled_goes_stale(monkeypatch):
    # ATen's math attention (chosen by the setting) returns another layout than its flash
    # attention: the native body's check sees it, and the call is compiled again. (Programs are
    # keyed on the setting since exact mode's attention reproduces the flash kernel: left out of
    # the key here, it stands for any setting that changes an ATen call's layout unseen.)
    state = braze.signatures.global_state
    monkeypatch.setattr(braze.signatures, "global_state", lambda: state()[:-1])
    model, x, mask = _Attention(False).eval(), torch.randn(2, 5, 16), torch.randn(2, 1, 5, 5)
    compiled, _ = compiled_for(model, x, mask)
    with sdpa_kernel(SDPBackend.MATH):
        for _ in range(2):
            check_model(model, (x, mask), compiled=compiled)
    assert "another layout" in braze.debug.compilations(compiled)


def test_aten_results_and_argument_handles_are_freed():
    class Gather(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("index", torch.arange(1 << 20).flip(0))

        def forward(self, x):
            return torch.gather(x, 0, self.index) * 2

    compiled = braze.compile(Gather())
    assert _grown_mb(compiled, torch.randn(1 << 20), 500) < 100  # 4 MB results: 2 GB if kept
    assert program(compiled).native
    small = braze.compile(lambda x, i: torch.gather(x, 0, i) + 1)
    x, i = torch.randn(3), torch.tensor([2, 0])
    assert _grown_mb(lambda x: small(x, i), x, 100_000) < 4  # lost handles: ~100 bytes each a call
    returned = braze.compile(lambda x: torch.gather(x, 0, Gather().index))  # the result is the output
    assert _grown_mb(returned, torch.randn(1 << 20), 500) < 100
    assert program(returned).native


def test_a_failing_aten_call_whose_result_is_the_output_raises_what_eager_raises():
    fn = lambda x, i: torch.gather(x, 0, i)  # noqa: E731
    compiled, x = braze.compile(fn), torch.randn(5)
    check_model(fn, (x, torch.tensor([4, 0])), compiled=compiled)
    assert program(compiled).native
    with pytest.raises(RuntimeError) as eager:
        fn(x, torch.tensor([4, 7]))
    with pytest.raises(RuntimeError) as ours:
        compiled(x, torch.tensor([4, 7]))
    assert str(ours.value) == str(eager.value)
    check_model(fn, (x, torch.tensor([1, 2])), compiled=compiled)
    assert len(compiled.programs()) == 1


@pytest.mark.parametrize("threshold", [0, 1 << 18])
def test_large_kept_scratch_goes_on_huge_pages(threshold):
    model, x = mlp(), torch.randn(4096, 16)  # 4096 x 32 floats a buffer: 0.5 MB each
    with braze.config.patch(huge_scratch=threshold):
        compiled, prog = compiled_for(model, x)
        check_model(model, (x,), compiled=compiled)  # the entry's call: the kept memory
    words = prog._descriptor.words
    assert sum(prog.layout.scratch_bytes.values()) >= 1 << 20 and words[W["kept"]]
    huge = words[W["kept"]] % (2 << 20) == 0 and words[W["capacity"]] >= 1 << 18
    assert huge or not threshold


_TEARDOWN = """
import ctypes, gc
from braze import jit
f = jit.pyfunction(ctypes.cast(ctypes.pythonapi.Py_IncRef, ctypes.c_void_p).value, "braze_probe_fn", False, None)
vars(jit).clear()  # what the interpreter does to modules at exit, before the last objects go
gc.collect()
junk = [bytes([i % 251]) * n for i in range(20000) for n in (13, 31, 47)]  # reuses freed memory
print(f.__name__)
"""


def test_a_native_functions_definition_outlives_the_module_that_made_it():
    # CPython reads a builtin function's method definition when it frees the function, which at
    # exit can come after braze.jit's own objects are gone: the definition must not be one of them
    proc = subprocess.run([sys.executable, "-c", _TEARDOWN], capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout.strip()) == (0, "braze_probe_fn"), proc.stderr[-2000:]
