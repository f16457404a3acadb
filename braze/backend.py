"""`torch.compile(model, backend="braze")`: TorchDynamo captures, braze compiles each graph.

Registered through the `torch_dynamo_backends` entry point (pyproject.toml), so importing
braze never imports TorchDynamo.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .api import CompiledModule
from .capture import from_graph_module


def braze_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    """A TorchDynamo backend: returns a braze wrapper of `gm` (compiled on its first call)."""
    wrapper = CompiledModule(gm)
    wrapper.use_capture(from_graph_module(gm))
    return wrapper
