"""Both capture paths keep eager's semantics: what FX would bake in at trace time and what
TorchDynamo would rewrite into other arithmetic (issue 15)."""

from __future__ import annotations

import copy
import functools
import sys
import threading
import time
import warnings

import pytest
import torch

import braze

from .helpers import assert_same, check_model


def dynamo_check(fn, *args) -> None:
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="braze")
    for _ in range(2):
        assert_same(compiled(*args), fn(*[a.clone() for a in args]))


A, B, C = (torch.randn(5, 7) for _ in range(3))


@pytest.mark.parametrize(
    "fn",
    [
        lambda a, b, c: torch.addcdiv(a, b, c, value=3.14),
        lambda a, b, c: torch.addcmul(a, b, c, value=0.3),
        lambda a, b, c: a.clone().addcdiv_(b, c, value=-1.7),
        lambda a, b, c: a.clone().addcmul_(b, c, value=torch.tensor(0.3)),
        lambda a, b, c: a.clone().add_(b, alpha=torch.tensor(2.9)),
        lambda a, b, c: torch.lerp(a, b, 0.3) + c,
    ],
    ids=["addcdiv", "addcmul", "addcdiv_", "addcmul_-tensor-value", "add_-tensor-alpha", "lerp"],
)
def test_dynamo_hands_braze_the_calls_eager_makes(fn):
    dynamo_check(fn, A, B, C)


def test_the_issue_addcdiv_snippet_through_dynamo():
    torch._dynamo.reset()
    g = lambda a, b, c: torch.addcdiv(a, b, c, value=3.14)  # noqa: E731
    assert torch.equal(torch.compile(g, backend="braze")(A, B, C), g(A, B, C))


def test_other_backends_still_see_dynamos_rewrite():
    """The rewrite declines only in traces for braze: another backend's graph is as before."""
    seen = []

    def backend(gm, example_inputs):
        seen.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        return gm

    torch._dynamo.reset()
    torch.compile(lambda a, b, c: torch.addcdiv(a, b, c, value=3.14), backend=backend)(A, B, C)
    assert torch.addcdiv not in seen and torch.div in seen


def test_setting_the_random_state_in_forward_is_not_traced_away():
    def f(x):
        torch.manual_seed(42)
        return x + torch.randn_like(x)

    compiled = braze.compile(f)
    x = torch.randn(6)
    for _ in range(2):
        torch.manual_seed(1)
        expected = f(x)
        torch.manual_seed(1)
        assert torch.equal(compiled(x), expected)
    assert torch.manual_seed.__module__ == "torch.random", "torch's own function is back after tracing"


def test_functions_of_star_args_are_traced_by_fx():
    def f(*xs):
        return xs[0] * 2 + xs[1]

    compiled = check_model(f, (A, B), kernels=1, externs=0)
    assert compiled._dynamo is None


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: torch.split(x, 2),
        lambda x: torch.split(x, 3)[1] * 2,
        lambda x: x.to_sparse() * 2,
        lambda x: torch.broadcast_shapes(x.shape, (3, 1, 7)),
        lambda x: x.shape,
    ],
    ids=["split", "split-item", "sparse", "size-from-tensor", "shape"],
)
def test_outputs_of_other_kinds(fn):
    compiled = braze.compile(fn)
    with warnings.catch_warnings():
        warnings.simplefilter("error", braze.BrazeWarning)
        actual = compiled(A)
    expected = fn(A)
    if isinstance(expected, torch.Tensor) and expected.is_sparse:
        assert actual.is_sparse and torch.equal(actual.to_dense(), expected.to_dense())
    else:
        assert_same(actual, expected)
        assert type(actual) is type(expected)


class Branchy(torch.nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # FX cannot trace this: TorchDynamo captures
            return x * 2
        return x - 1


@pytest.mark.parametrize("how", ["torch.compile", "braze.compile"])
def test_dynamos_recompile_limit_is_said(how):
    """TorchDynamo stops compiling a function after its recompile limit and runs it eagerly,
    saying so only in a log line: braze says it as a warning."""
    torch._dynamo.reset()
    model = Branchy()
    if how == "torch.compile":
        compiled = torch.compile(model, backend="braze", dynamic=False)
    else:  # a graph per size: TorchDynamo's automatic dynamic shapes would make one for all
        compiled = braze.compile(model, dynamic=False)
    limit = torch._dynamo.config.recompile_limit
    with pytest.warns(braze.BrazeWarning, match="TorchDynamo stopped compiling"):
        for n in range(1, limit + 3):
            x = torch.ones(n)
            assert torch.equal(compiled(x), model(x))


@pytest.mark.parametrize("index", [[1, 2], ([0, 2], slice(None)), (Ellipsis, [1])], ids=str)
def test_advanced_indexing_copies(index):
    x = torch.randn(4, 5)
    check_model(lambda t: t[index] * 2, (x,))
    dynamo_check(lambda t: t[index] * 2, x)


class KwargsForward(torch.nn.Module):
    """A forward of **kwargs, as Hugging Face models have: FX cannot bind them positionally."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, input_ids=None, **kwargs):
        mask = kwargs.get("attention_mask")
        y = torch.relu(self.fc(input_ids))
        return y if mask is None else y * mask


def test_keyword_calls_of_a_kwargs_forward_are_compiled_by_dynamo():
    model = KwargsForward().eval()
    compiled = braze.compile(model)
    x, mask = torch.randn(4, 8), (torch.rand(4, 8) > 0.5).float()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error", braze.BrazeWarning)
        for kwargs in (
            {"input_ids": x, "attention_mask": mask},
            {"input_ids": x},
            {"input_ids": x, "attention_mask": mask},
        ):
            assert_same(compiled(**kwargs), model(**kwargs))
    assert compiled.programs(), "TorchDynamo's graphs are compiled by braze"


class UnusedKwargs(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x, **kwargs):
        return torch.relu(self.fc(x))


def test_a_kwargs_forward_fx_traces_is_compiled_by_fx_for_positional_calls():
    # torch.fx traces it (**kwargs unused): a call without keywords binds it to {} (it ran
    # eagerly: "missing argument '**kwargs'")
    model = UnusedKwargs().eval()
    compiled = check_model(model, (torch.randn(4, 8),))
    assert compiled.programs() and compiled._dynamo is None


class ScaledKwargs(torch.nn.Module):
    """A **kwargs forward (TorchDynamo captures it) reading a Python attribute and a config dict,
    as Hugging Face's models read their config."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.scale, self.config = 2.0, {"act": "relu"}

    def forward(self, x, **kwargs):
        y = self.fc(x) * self.scale
        return torch.relu(y) if self.config["act"] == "relu" else torch.tanh(y)


def _dynamo_frames(fn, *args) -> int:
    """How many times a call enters TorchDynamo's frame handling (torch.compile's wrapper)."""
    count = 0

    def profile(frame, event, arg):
        nonlocal count
        count += event == "call" and frame.f_code.co_name == "compile_wrapper"

    sys.setprofile(profile)
    try:
        fn(*args)
    finally:
        sys.setprofile(None)
    return count


def test_calls_through_dynamo_run_its_code_where_its_guards_pass():
    # braze evaluates TorchDynamo's own guards and calls the code it compiled, without its frame
    # handling; whatever the guards protect still makes TorchDynamo compile anew.
    model = ScaledKwargs().eval()
    compiled = braze.compile(model)
    x, y = torch.randn(3, 8), torch.randn(5, 8)
    call = functools.partial(compiled, flag=True)  # a keyword **kwargs takes: TorchDynamo binds it
    with torch.no_grad():
        for _ in range(2):
            assert_same(call(x), model(x))
        assert compiled._subgraphs and _dynamo_frames(call, x) == 0
        model.scale = 3.0  # a Python attribute the graph baked in
        assert_same(call(x), model(x))
        model.config["act"] = "tanh"  # a config value a branch read
        assert_same(call(x), model(x))
        assert_same(call(y), model(y))  # another size
        assert _dynamo_frames(call, x) == 0
        assert len(compiled._subgraphs) >= 3
        with torch.compiler.set_stance("force_eager"):  # the user's stance is TorchDynamo's to apply
            assert _dynamo_frames(call, x) == 1
            assert_same(call(x), model(x))
        with torch._dynamo.config.patch(disable=True):  # TorchDynamo's switch, read through its ContextVar
            assert _dynamo_frames(call, x) == 1
            assert_same(call(x), model(x))
        assert _dynamo_frames(call, x) == 0
    assert_same(call(x), model(x))  # grad mode on: the parameters need gradients


class BranchyLinear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        return y * 2 if y.sum() > 0 else y - 1  # FX cannot trace this: TorchDynamo captures


def test_bad_inputs_through_dynamo_raise_eagers_error_and_keep_compiling():
    model = BranchyLinear().eval()
    compiled = braze.compile(model)
    x = torch.ones(2, 4)
    with torch.no_grad():
        assert torch.equal(compiled(x), model(x))
        with pytest.raises(RuntimeError, match="cannot be multiplied"):
            compiled(torch.ones(2, 3))
        assert torch.equal(compiled(x), model(x))
    assert compiled._dynamo is not model, "TorchDynamo still captures after a bad call"


class CachesInForward(torch.nn.Module):
    """Fills a cache on its first call and counts its calls, as timm's LeViT caches its
    attention biases: state that FX would change once, on proxies, while tracing."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(4, 8))
        self.cache: dict[str, torch.Tensor] = {}
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if "bias" not in self.cache:
            self.cache["bias"] = self.table[:, :4].sum(0)
        return torch.relu(x + self.cache["bias"])


def test_a_forward_that_changes_module_state_keeps_eagers_state():
    model, twin = CachesInForward(), CachesInForward()
    twin.load_state_dict(model.state_dict())
    compiled = braze.compile(model)
    for _ in range(3):
        x = torch.randn(2, 4)
        with torch.no_grad():
            assert_same(compiled(x), twin(x))
    # no proxy left behind (copy.deepcopy of timm's LeViT failed on one), the calls counted as eager counts them
    assert model.calls == twin.calls == 3
    assert all(type(v) is torch.Tensor for v in model.cache.values()), model.cache
    copy.deepcopy(model)
    assert compiled._subgraphs, "TorchDynamo replays the state changes: it captures such a forward"


def test_a_graph_braze_runs_eagerly_keeps_running_through_dynamo():
    # A signature cached as eager was taken for a stale program on its second call: AttributeError.
    def f(x):
        y = x * 2
        y.t().add_(1)  # changes y through a view: braze runs this graph eagerly
        return y

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="braze")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", braze.BrazeWarning)
        for _ in range(3):
            x = torch.randn(3, 4)
            assert_same(compiled(x), f(x.clone()))


ZERO_SIGN = 1.0  # read by SignedReciprocal's forward: TorchDynamo guards it, and traces again when it changes


class SignedReciprocal(torch.nn.Module):
    """A forward FX cannot trace (a branch on a size), whose graph depends on a global's value
    only through a zero's sign."""

    def forward(self, x):
        y = x * 2 if x.dim() == 2 else x
        return 1 / (y * (0.0 if ZERO_SIGN > 0 else -0.0)) + y.sum()


def test_dynamo_graphs_equal_to_one_compiled_before_share_its_program(monkeypatch):
    model = SignedReciprocal()
    compiled = braze.compile(model)
    x = torch.randn(3, 5)
    assert_same(compiled(x), model(x))
    monkeypatch.setattr(sys.modules[__name__], "ZERO_SIGN", 2.0)  # TorchDynamo traces again: the same graph
    assert_same(compiled(x), model(x))
    assert len(compiled._subgraphs) == 1 and len(compiled._subgraphs[0].compilations) == 1
    monkeypatch.setattr(sys.modules[__name__], "ZERO_SIGN", -1.0)  # another graph: -0.0 is not 0.0
    assert_same(compiled(x), model(x))  # (each infinity's sign flips: the first graph's would not)
    assert len(compiled._subgraphs) == 2


def test_threads_first_calling_a_model_fx_cannot_trace_share_one_dynamo_capture(monkeypatch):
    # Threads waiting for the wrapper's lock while the first one found that FX cannot trace the
    # model each started a TorchDynamo capture of their own (4 threads: 4 captures).
    from braze import backend, capture

    captures, trace = [], capture.trace

    def slow_trace(*args, **kwargs):  # FX fails after a while: the other threads queue meanwhile
        time.sleep(0.2)
        return trace(*args, **kwargs)

    def counted(*args, **kwargs):
        captures.append(args)
        return fallback(*args, **kwargs)

    fallback = backend.dynamo_fallback
    monkeypatch.setattr(capture, "trace", slow_trace)
    monkeypatch.setattr(backend, "dynamo_fallback", counted)
    model = BranchyLinear().eval()
    compiled = braze.compile(model)
    x = torch.randn(3, 4)
    start, outs = threading.Barrier(4), [None] * 4

    def work(i: int) -> None:
        start.wait()
        with torch.no_grad():
            outs[i] = compiled(x)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with torch.no_grad():
        for out in outs:
            assert_same(out, model(x))
    assert len(captures) == 1
    alone = braze.compile(BranchyLinear().eval())  # one thread: the graphs of one capture (2: a graph break)
    with torch.no_grad():
        alone(x)
    assert len(compiled._subgraphs) == len(alone._subgraphs)
