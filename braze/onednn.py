"""oneDNN's arithmetic inside ATen calls that braze reproduces: gelu's erf form.

ATen's gelu (approximate="none") of a contiguous float32 tensor of 2 or more elements calls
oneDNN's eltwise kernel while torch.backends.mkldnn is enabled; on an avx512_core CPU that
kernel evaluates one of 25 degree-5 polynomials picked by the input's bits (codegen's
`gelu_erf`). Its bits depend on no neighbour, position or thread, so braze computes it in its
elementwise loops (Op.GELU_ERF), fused with what comes before and after, where a probe shows it
gives ATen's bits here. Other inputs take ATen's own kernel (an erf of Sleef's exp): sleef.py's.
"""

from __future__ import annotations

import functools

import torch

from . import jit
from .codegen import gelu_erf, run_elementwise
from .sleef import other_capability

KERNEL = "braze_onednn_gelu"


def run(x: torch.Tensor) -> torch.Tensor:
    """braze's gelu of a contiguous float32 tensor (for the probe and tests), at each width its
    loops take."""
    return run_elementwise(KERNEL, gelu_erf, x, wide=True)


def why_not_gelu() -> str | None:
    """None where braze's gelu (erf form) gives ATen's bits here, else why it is not used."""
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return "gelu with torch.backends.mkldnn disabled runs ATen's own kernel: not reproduced"
    other = other_capability()  # oneDNN's avx512_core kernel, which the code generated here also needs
    if other:
        return other
    if not _same(torch.get_num_threads()):
        return "a probe found braze's gelu (oneDNN's polynomials) does not give ATen's bits here"
    return None


@functools.cache
def _same(threads: int) -> bool:  # threads: in the cache key
    """Every polynomial's interval (each quarter binade from the denormals to the bound, at its
    ends and inside), special values, N(0, s) at five scales; lengths around the vector width and
    past ATen's split between threads. Once per process and thread count."""
    gen = torch.Generator().manual_seed(0)
    edges = torch.arange(0, 0x41000000, 1 << 21, dtype=torch.int64)
    edges = torch.cat([edges, edges - 1, edges + 1, torch.tensor([0x40B15CEE, 0x40B15CEF, 0x40B15CED])]).clamp(min=0)
    edges = edges.to(torch.int32).view(torch.float32)
    special = torch.tensor([0.0, -0.0, 1e-45, -1e-40, 3e38, -3e38, float("inf"), -float("inf"), float("nan")])
    normal = torch.randn(5, 20000, generator=gen) * torch.tensor([0.01, 0.3, 1.0, 3.0, 10.0]).view(5, 1)
    x = torch.cat([edges, -edges, special, normal.view(-1)])
    x = x[torch.randperm(x.numel(), generator=gen)]
    for n in (2, 7, 8, 9, 16, 17, 25, 33, x.numel()):  # (16 lanes, 8, one: each alone and after another)
        if not jit.same_bits(run(x[:n]), torch.nn.functional.gelu(x[:n]), nan_payloads=False):
            return False
    return True
