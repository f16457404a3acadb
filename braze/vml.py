"""MKL's vector math (VML) arithmetic that braze reproduces: tanh.

ATen's float32 tanh calls MKL's vmsTanh (high accuracy, denormals kept). On this AMD CPU MKL
runs its generic kernel (`EX`, SSE2): per element a degree-7 polynomial in double picked by the
input's bits, from a table inside libtorch_cpu.so (jit.mkl_tanh_table). An element's bits depend
on no neighbour, position or thread, so braze computes it in its elementwise loops (Op.TANH),
fused with what comes before and after (GPT-2's tanh GELU), where a probe shows it gives MKL's
bits here. Elsewhere (another MKL kernel, as MKL's AVX-512 one on Intel CPUs, or another wheel)
programs call vmsTanh, as before.
"""

from __future__ import annotations

import functools

import torch

from . import jit
from .codegen import mkl_tanh, run_elementwise

KERNEL = "braze_vml_tanh"


def run(x: torch.Tensor) -> torch.Tensor:
    """braze's tanh of a contiguous float32 tensor (for the probe and tests)."""
    return run_elementwise(KERNEL, mkl_tanh, x)


@functools.cache
def why_not_tanh() -> str | None:
    """None where braze's tanh gives ATen's bits here, else why programs call vmsTanh."""
    if jit.mkl_tanh_table() is None:
        return "libtorch_cpu.so is not the build whose MKL tanh table braze reads: vmsTanh called"
    if not _same():
        return "a probe found MKL runs another tanh kernel here (braze reproduces its generic one): vmsTanh called"
    return None


def _same() -> bool:
    """Every polynomial's interval (each quarter binade from the first to the bound, at its ends
    and inside), the denormals, special values, N(0, s) at five scales; lengths around the
    vector width. Once per process (VML's bits depend on no thread count)."""
    gen = torch.Generator().manual_seed(0)
    edges = torch.arange(0x3DE00000, 0x41600000, 1 << 21, dtype=torch.int64)
    edges = torch.cat([edges, edges - 1, edges + 1, torch.randint(0, 0x7F800000, (4096,), generator=gen)])
    edges = edges.to(torch.int32).view(torch.float32)
    special = [0.0, -0.0, 1e-45, -1e-40, 1e-30, 3e38, -3e38, float("inf"), -float("inf"), float("nan")]
    normal = torch.randn(5, 20000, generator=gen) * torch.tensor([0.01, 0.3, 1.0, 3.0, 10.0]).view(5, 1)
    x = torch.cat([edges, -edges, torch.tensor(special), normal.view(-1)])
    x = x[torch.randperm(x.numel(), generator=gen)]
    return all(jit.same_bits(run(x[:n]), torch.tanh(x[:n])) for n in (1, 7, 8, 9, 17, 33, x.numel()))
