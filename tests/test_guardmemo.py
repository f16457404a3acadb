"""The memo of TorchDynamo's guard checks (guardmemo.py, backend._GuardMemo): a call that finds
its witness holding skips the guards, so every change the guards would see must break the
witness. Each test changes one kind of state a guard reads and checks the next call is eager's,
with braze's debug mode on (config.debug: every call the witness passes runs TorchDynamo's
guards too and fails loudly if they disagree) and BrazeWarning an error (a failure inside the
memo would show as TorchDynamo's capture failing)."""

from __future__ import annotations

import contextlib
import sys
import warnings

import pytest
import torch

import braze
from braze import config, guardmemo

from .helpers import assert_same

SCALE = 2.0  # a module global the forward reads


def _activation(y: torch.Tensor) -> torch.Tensor:  # a global function the forward calls
    return torch.relu(y)


def _shifted(y: torch.Tensor, by: float = 1.0) -> torch.Tensor:  # its default is read
    return y + by


def _make_closure(factor: float):
    def scaled(y: torch.Tensor) -> torch.Tensor:
        return y * factor

    def set_factor(value: float) -> None:
        nonlocal factor
        factor = value

    return scaled, set_factor


_closed, _set_closed = _make_closure(1.5)


class Config:
    """A config with its own __getattribute__ mapping names, as Hugging Face's PretrainedConfig."""

    attribute_map = {"offset": "shift"}

    def __init__(self) -> None:
        self.shift = 0.5
        self.other = 0.25
        self._bias = 0.125

    def __getattribute__(self, key: str):
        if key != "attribute_map" and key in super().__getattribute__("attribute_map"):
            key = super().__getattribute__("attribute_map")[key]
        return super().__getattribute__(key)

    @property
    def bias(self) -> float:  # (a getter that returns an attribute: its read is words too)
        return self._bias


class Gate(torch.nn.Module):
    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return y * 2 if self.training else y


class Stateful(torch.nn.Module):
    """A **kwargs forward (TorchDynamo captures it) reading state of every kind a guard reads."""

    OFFSET = 1.0  # a class attribute

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.gate = Gate()
        self.scale = 2.0
        self.config = Config()
        self.table = {"act": "relu"}

    def forward(self, x: torch.Tensor, **kwargs):
        y = self.gate(self.fc(x)) * self.scale * SCALE + self.OFFSET + self.config.offset + self.config.bias
        y = _activation(y) if self.table["act"] == "relu" else torch.tanh(y)
        y = _closed(_shifted(y))
        if type(self.gate).__name__ != "Gate" or _shifted.__name__ != "_shifted":  # names read
            y = -y
        if kwargs.get("flag"):
            y = y * 3
        other = kwargs.get("other")
        return y if other is None else y + other


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()  # (each test's frames compile anew: no test meets the recompile limit)


@contextlib.contextmanager
def _strict():
    with config.patch(debug=1), warnings.catch_warnings():
        warnings.simplefilter("error", braze.BrazeWarning)
        yield


def _compiled(model: torch.nn.Module, x: torch.Tensor):
    """The model compiled, its memo holding after two calls (the second skipped the guards)."""
    compiled = braze.compile(model)
    for _ in range(3):
        assert_same(compiled(x), model(x))
    memo = compiled._dynamo.memo
    assert memo.witness is not None, memo.why
    assert memo.witness.count >= 20, "TorchDynamo traced the forward in the frame the memo covers"
    assert memo.hits >= 1
    return compiled, memo


def test_the_call_torchdynamo_compiles_for_leaves_the_witness():
    """The second call already skips the guards (it made the witness, ~10 ms for bert-tiny)."""
    model = Stateful().eval()
    x = torch.randn(4, 8)
    with torch.no_grad(), _strict():
        compiled = braze.compile(model)
        assert_same(compiled(x), model(x))
        memo = compiled._dynamo.memo
        assert memo.witness is not None and memo.hits == 0, memo.why
        assert not memo.witness.calls, "every read of Stateful's forward is words"
        assert_same(compiled(x), model(x))
        assert memo.hits == 1


def _follows(compiled, model, *args, **kwargs) -> None:
    """Eager's output (or error) from the compiled model, twice: the first call after a change
    records a witness again, the next uses it."""
    for _ in range(2):
        try:
            want = model(*args, **kwargs)
        except Exception as e:
            with pytest.raises(type(e)):
                compiled(*args, **kwargs)
            continue
        assert_same(compiled(*args, **kwargs), want)


CHANGES = {
    "attribute": lambda m, mp: setattr(m, "scale", 3.0),
    "module global": lambda m, mp: mp.setattr(sys.modules[__name__], "SCALE", 4.0),
    "global function": lambda m, mp: mp.setattr(sys.modules[__name__], "_activation", torch.tanh),
    "class attribute": lambda m, mp: mp.setattr(Stateful, "OFFSET", 5.0),
    "custom __getattribute__": lambda m, mp: setattr(m.config, "shift", 1.5),
    "its attribute map": lambda m, mp: mp.setitem(Config.attribute_map, "offset", "other"),
    "its own attribute map": lambda m, mp: setattr(m.config, "attribute_map", {"offset": "other"}),
    "what a property returns": lambda m, mp: setattr(m.config, "_bias", 0.75),
    "a property replaced": lambda m, mp: mp.setattr(Config, "bias", property(lambda self: 2.0)),
    "__dict__ replaced": lambda m, mp: setattr(m, "__dict__", {**m.__dict__, "scale": 3.0}),
    "class name": lambda m, mp: setattr(Gate, "__name__", "Other"),  # (monkeypatch would delete it)
    "function name": lambda m, mp: mp.setattr(_shifted, "__name__", "other"),
    "dict item": lambda m, mp: m.table.__setitem__("act", "tanh"),
    "training flag": lambda m, mp: m.gate.train(),
    "forward hook": lambda m, mp: m.fc.register_forward_hook(lambda mod, inp, out: out * -1),
    "function code": lambda m, mp: mp.setattr(_shifted, "__code__", (lambda y, by=1.0: y - by).__code__),
    "function defaults": lambda m, mp: mp.setattr(_shifted, "__defaults__", (7.0,)),
    "closure cell": lambda m, mp: _set_closed(0.25),
    "parameter replaced": lambda m, mp: setattr(m.fc, "weight", torch.nn.Parameter(torch.randn(8, 8))),
    "weight changed in place": lambda m, mp: m.fc.weight.data.mul_(-1),
    "weight's layout changed in place": lambda m, mp: setattr(m.fc.weight, "data", torch.randn(8, 8).t()),
    "submodule replaced": lambda m, mp: setattr(m, "gate", torch.nn.Identity()),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_change_the_guards_see_is_followed(change, monkeypatch):  # (monkeypatch undoes its changes)
    model = Stateful().eval()
    x = torch.randn(4, 8)
    try:
        with torch.no_grad(), _strict():
            compiled, memo = _compiled(model, x)
            CHANGES[change](model, monkeypatch)
            _follows(compiled, model, x)
            hits = memo.hits
            _follows(compiled, model, x)
            assert memo.hits > hits, "the memo holds again once the new state is seen"
    finally:
        _set_closed(1.5)
        Gate.__name__ = "Gate"


def test_arguments_are_compared_whole():
    model = Stateful().eval()
    x = torch.randn(4, 8)
    with torch.no_grad(), _strict():
        compiled, memo = _compiled(model, x)
        _follows(compiled, model, torch.randn(6, 8))  # another size
        _follows(compiled, model, x.double())  # another dtype (eager's error or result)
        _follows(compiled, model, x.t().contiguous().t())  # another layout
        _follows(compiled, model, x, flag=True)  # a keyword, then its value
        _follows(compiled, model, x, flag=False)
        _follows(compiled, model, x, other=x)  # one tensor twice
        _follows(compiled, model, x, other=x.clone())
        hits = memo.hits
        _follows(compiled, model, x, other=x.clone())
        assert memo.hits > hits


def test_global_state_is_compared():
    model = Stateful().eval()
    x = torch.randn(4, 8)
    with torch.no_grad(), _strict():
        compiled, memo = _compiled(model, x)
    with pytest.warns(braze.BrazeWarning, match="gradients are needed"):
        assert_same(compiled(x), model(x))  # grad mode on: the weights need gradients (eager runs)
    with _strict():
        with torch.inference_mode():
            _follows(compiled, model, x)
        with torch.no_grad():
            model.fc.weight.requires_grad_(False)
            _follows(compiled, model, x)
            threads = torch.get_num_threads()
            torch.set_num_threads(1 if threads > 1 else 2)
            try:
                _follows(compiled, model, x)
            finally:
                torch.set_num_threads(threads)


def test_after_a_reset_of_torchdynamo_the_answers_stay_eager_s():
    """The witness's code stays in use while it holds (backend._guarded_code); a change then
    compiles anew."""
    model = Stateful().eval()
    x = torch.randn(4, 8)
    with torch.no_grad(), _strict():
        compiled, memo = _compiled(model, x)
        torch._dynamo.reset()
        hits = memo.hits
        _follows(compiled, model, x)
        assert memo.hits > hits
        model.scale = 3.0
        _follows(compiled, model, x)


def test_switched_off_the_guards_run_every_call():
    model = Stateful().eval()
    x = torch.randn(4, 8)
    with torch.no_grad(), _strict():
        compiled, memo = _compiled(model, x)
        hits = memo.hits
        with config.patch(guard_memo=False):
            model.scale = 5.0
            _follows(compiled, model, x)
        assert memo.hits == hits


class ListReader(torch.nn.Module):
    """Reads a list's length: a list has no version, so the read is asked again every call."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.items = [1.0]

    def forward(self, x: torch.Tensor, **kwargs):
        y = self.fc(x) * len(self.items)
        return y * 3 if kwargs.get("flag") else y


def test_a_read_without_a_version_is_asked_again():
    model = ListReader().eval()
    x = torch.randn(4, 8)
    with torch.no_grad(), _strict():
        compiled, memo = _compiled(model, x)
        model.items.append(2.0)
        _follows(compiled, model, x)


def test_an_unsupported_guard_leaves_the_guards_running():
    builder = guardmemo._Builder(lambda: None, {})
    with pytest.raises(guardmemo.Unsupported):
        builder.guard("WEAKREF_ALIVE", None, {})


def test_hugging_face_models_take_the_memo():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=100
    )
    model = transformers.BertModel(cfg).eval()
    ids = torch.randint(0, 100, (2, 7))
    with torch.no_grad(), _strict():
        compiled = braze.compile(model)
        for _ in range(3):
            assert_same(compiled(ids).last_hidden_state, model(ids).last_hidden_state)
        memo = compiled._dynamo.memo
        assert memo.witness is not None and memo.hits >= 1, memo.why
        # its config's reads (through transformers' own __getattribute__) are words (_HOOKS)
        assert not [c for c in memo.witness.calls if c[0] == "getattr" and c[1] is model.config]
        model.config.output_hidden_states = True  # read by the forward: its guard sees it
        for _ in range(2):
            got, want = compiled(ids), model(ids)
            assert len(got.hidden_states) == len(want.hidden_states) == 2
            assert_same(got.last_hidden_state, want.last_hidden_state)
