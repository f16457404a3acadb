"""Stage 1, capture: turn a model or function into a torch.fx graph.

The fast path is symbolic tracing (milliseconds). Code that FX cannot trace (Python control flow
on tensor values, say) raises here; the caller then hands the model to TorchDynamo with braze as
its backend, and if that fails too it runs eagerly with one warning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx


class CaptureError(RuntimeError):
    pass


@dataclass
class Captured:
    graph: torch.fx.Graph
    root: torch.nn.Module  # what get_attr and call_module targets resolve against


class _Tracer(torch.fx.Tracer):
    # Keep torch.nn's own modules as single nodes (the default) so lowering sees nn.Linear whole.
    pass


def trace(fn: Callable[..., Any]) -> Captured:
    """Symbolically trace `fn` (an nn.Module or a function of tensors) into an FX graph."""
    root = fn if isinstance(fn, torch.nn.Module) else torch.nn.Module()
    try:
        graph = _Tracer().trace(fn)
    except Exception as e:  # FX raises many kinds: TraceError, TypeError, NotImplementedError...
        raise CaptureError(f"torch.fx could not trace {_name(fn)}: {type(e).__name__}: {e}") from e
    return Captured(graph, root)


def from_graph_module(gm: torch.fx.GraphModule) -> Captured:
    """A graph that TorchDynamo (or the user) already captured."""
    return Captured(gm.graph, gm)


def _name(fn: Callable[..., Any]) -> str:
    return type(fn).__name__ if isinstance(fn, torch.nn.Module) else getattr(fn, "__name__", repr(fn))
