"""Every knob braze has, with its environment default. See docs/env_vars.md.

Tests change knobs with ``config.patch(debug=3)``; nothing else reads the environment.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


# 0 quiet; 1 timings and fallbacks; 2 + captured graph; 3 + IR after each pass; 4 + LLVM IR;
# 5 + optimised LLVM IR; 6 + assembly.
debug: int = _env_int("BRAZE_DEBUG", 0)
# Where debug output goes as files (one folder per compiled program); empty prints to stderr.
debug_dir: str = os.environ.get("BRAZE_DEBUG_DIR", "")
# Compiled specialisations (input shapes/strides/dtypes) kept per wrapper before the oldest goes.
cache_size: int = _env_int("BRAZE_CACHE_SIZE", 8)
# Run ir.verify after every pass (always on in tests and when debug >= 1).
verify: bool = bool(_env_int("BRAZE_VERIFY", 0))
# LLVM optimiser speed level for the loops codegen could not vectorise (strided innermost
# accesses), in programs where those touch at least `optimize_threshold` elements per call; the
# rest of the program skips the optimiser (codegen writes vector loops itself). 0 never optimises.
opt_level: int = _env_int("BRAZE_OPT", 2)
optimize_threshold: int = _env_int("BRAZE_OPTIMIZE_THRESHOLD", 1 << 16)
# Elementwise loops with at least this many elements run on torch.get_num_threads() threads
# (ATen's own grain size, so braze splits work where eager does).
parallel_threshold: int = _env_int("BRAZE_PARALLEL_THRESHOLD", 32768)
# A native body releases the GIL around its kernels (so other Python threads run meanwhile) when
# they do at least this many floating-point operations; below, the ~0.1 us it costs is not worth it.
release_gil_flops: int = _env_int("BRAZE_RELEASE_GIL_FLOPS", 1 << 20)
# GEMMs below this many floating-point operations call sgemm_ on one thread, where MKL gives the
# same bits on one thread as on its thread count (probed when compiling; see jit.one_thread_same):
# there, splitting the work between cores costs more than it saves (0.26 MFLOP: 8% slower on two
# threads here; 1 MFLOP: 0-20% faster), and the core that runs the bias copy and the epilogue
# keeps the whole output in its cache.
one_thread_gemm_flops: int = _env_int("BRAZE_ONE_THREAD_GEMM_FLOPS", 1 << 19)
# GEMMs of a weight (linear's [N, K], GPT-2's Conv1D [K, N]) run braze's own kernel in MKL's order
# of operations (gemmkernel.py) where its probe gives eager's bits; 0: always MKL's sgemm_.
own_gemm: bool = bool(_env_int("BRAZE_OWN_GEMM", 1))
# Exact mode's scaled_dot_product_attention runs braze's kernel of ATen's flash attention
# (attention.py) where its probe gives eager's bits; 0: always ATen's call.
exact_attention: bool = bool(_env_int("BRAZE_EXACT_ATTENTION", 1))
# A model captured through TorchDynamo skips its guards on calls where a witness of what they
# read shows nothing changed (guardmemo.py); 0: TorchDynamo's guards run on every call.
guard_memo: bool = bool(_env_int("BRAZE_GUARD_MEMO", 1))
# A program whose kept scratch buffers take at least this many bytes gets them on 2 MB pages
# (transparent huge pages, asked for with madvise). On 4 KB pages, the thread with the upper half
# of a GEMM's rows ran 10-20% longer (a Linear 128 -> 512 + GELU + Linear on 256 rows: 472 us a
# call, 422 us on huge pages, its threads then even); bert-tiny 1.03-1.05x, transformer-layer
# 1.02x faster, the other bench models unchanged (one process, interleaved). 0: never.
huge_scratch: int = _env_int("BRAZE_HUGE_SCRATCH", 1 << 18)
# Set to 1 to skip native code entirely (every op goes through ATen); a debugging aid.
disable_native: bool = bool(_env_int("BRAZE_DISABLE_NATIVE", 0))
# Programs compiled with this set count the CPU cycles their BLAS calls take (timing.split uses
# it to tell braze's own time per call from its BLAS calls' time). Off: no counting code at all.
blas_clock: bool = bool(_env_int("BRAZE_BLAS_CLOCK", 0))
# Name braze's JIT functions for Linux perf (/tmp/perf-<pid>.map): `perf report` then shows
# braze_layer_norm_rows or a program's kernel where it otherwise shows bare addresses.
perf_map: bool = bool(_env_int("BRAZE_PERF_MAP", 0))

# Where the library kernels' machine code is kept between processes (kernelcache.py); "": nowhere.
_CACHE_HOME = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")  # ("~/..." if no home)
kernel_cache: str = os.environ.get(
    "BRAZE_KERNEL_CACHE", "" if _CACHE_HOME.startswith("~") else os.path.join(_CACHE_HOME, "braze", "kernels")
)

# At import, move the objects that exist (torch's own modules and functions, ~165k objects) out of
# the cyclic garbage collector's reach (gc.freeze), so no first call pays ~100 ms for a full
# collection of them. They live until exit anyway.
gc_freeze: bool = bool(_env_int("BRAZE_GC_FREEZE", 1))

_KNOBS = (
    "debug",
    "debug_dir",
    "cache_size",
    "verify",
    "opt_level",
    "optimize_threshold",
    "parallel_threshold",
    "release_gil_flops",
    "one_thread_gemm_flops",
    "own_gemm",
    "exact_attention",
    "guard_memo",
    "huge_scratch",
    "disable_native",
    "blas_clock",
    "perf_map",
    "gc_freeze",
    "kernel_cache",
)


@contextlib.contextmanager
def patch(**changes: object) -> Iterator[None]:
    """Temporarily set knobs, e.g. ``with config.patch(debug=3): ...``."""
    g = globals()
    unknown = set(changes) - set(_KNOBS)
    if unknown:
        raise AttributeError(f"unknown braze config knob(s): {sorted(unknown)}")
    saved = {k: g[k] for k in changes}
    g.update(changes)
    try:
        yield
    finally:
        g.update(saved)
