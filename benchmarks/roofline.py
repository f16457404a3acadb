"""How fast a model can run here at best: its floating-point work at the cores' peak, against
eager's and braze's measured times.

    python benchmarks/roofline.py bert-tiny transformer-layer gpt2-tiny

The work is torch's own count (torch.utils.flop_counter: matrix products, convolutions,
attention; elementwise work and normalisations not counted, so the bound is loose in braze's
favour). The peak is measured: a loop of independent AVX-512 FMAs (12 accumulators, the JIT's
code), on each of the threads at once. Then the largest speed-up over eager any program that
does this arithmetic can have: eager's time / (work / peak), beside braze's measured one
(exact and fast mode, interleaved with eager in one process: braze.timing, medians). Exact mode cannot do less
arithmetic than eager: its GEMMs are eager's, operation for operation.
"""

from __future__ import annotations

import ctypes
import statistics
import sys
import threading
import time

import llvmlite.ir as ll
import torch
from torch.utils.flop_counter import FlopCounterMode

import braze
from braze import jit, timing
from braze.bench import build_model
from braze.codegen import I64, LANES16, PTR, VOID, counted_loop, fma

_ACCUMULATORS = 12


def _fma_loop(module: ll.Module) -> None:
    """void braze_peak_loop(i64 n, float *out): n steps of 12 independent 16-lane FMAs (2 x 12 x
    16 flops each), their sum stored at out (so that the loop is not optimised away)."""
    f = ll.Function(module, ll.FunctionType(VOID, [I64, PTR]), "braze_peak_loop")
    b = ll.IRBuilder(f.append_basic_block("entry"))
    slots = [b.alloca(LANES16) for _ in range(_ACCUMULATORS)]
    for i, s in enumerate(slots):
        b.store(ll.Constant(LANES16, [float(i)] * 16), s)
    x, y = (ll.Constant(LANES16, [v] * 16) for v in (1.0000001, 0.9999999))
    with counted_loop(b, I64(0), f.args[0]):
        for s in slots:
            b.store(fma(b, b.load(s, typ=LANES16), x, y), s)
    total = b.load(slots[0], typ=LANES16)
    for s in slots[1:]:
        total = b.fadd(total, b.load(s, typ=LANES16))
    b.store(total, f.args[1])
    b.ret_void()


def peak_flops(threads: int, steps: int = 50_000_000) -> float:
    """Flops per second of the FMA loop, run on `threads` threads at once."""
    loop = ctypes.CFUNCTYPE(None, ctypes.c_int64, ctypes.c_void_p)(jit.kernel("braze_peak_loop", _fma_loop))
    out = torch.empty(threads, 16)
    loop(steps // 10, out.data_ptr())  # warm up the clock
    # (ctypes drops the GIL: the threads run at once)
    workers = [threading.Thread(target=loop, args=(steps, out[i].data_ptr())) for i in range(threads)]
    t0 = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return threads * steps * _ACCUMULATORS * 32 / (time.perf_counter() - t0)


def work(model: torch.nn.Module, inputs: tuple) -> int:
    """The model's flops as torch counts them (with nn.TransformerEncoderLayer's fused fast path
    off, whose one op the counter does not know: the same products, op by op)."""
    fastpath = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(*inputs)
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)
    return counter.get_total_flops()


def main(names: list[str]) -> None:
    threads = torch.get_num_threads()
    peak = peak_flops(threads)
    print(f"peak: {peak / 1e9:.0f} GFLOP/s on {threads} threads (an FMA loop)")
    for name in names:
        model, inputs = build_model(name)
        flops = work(model, inputs)
        fns = {"eager": model, "exact": braze.compile(model), "fast": braze.compile(model, mode="fast")}
        with torch.no_grad():
            t = timing.compare(fns, inputs)
        eager = statistics.median(t["eager"].rounds) * 1e-6
        bound = flops / peak
        print(
            f"{name:18s} {flops / 1e6:7.0f} MFLOP: at peak {bound * 1e3:.3f} ms; eager {eager * 1e3:.3f} ms "
            f"({flops / eager / 1e9:.0f} GFLOP/s), so at most {eager / bound:.2f}x eager; "
            f"braze exact {t.speedup('exact', 'eager'):.2f}x, fast {t.speedup('fast', 'eager'):.2f}x"
        )


if __name__ == "__main__":
    torch.set_num_threads(2)
    main(sys.argv[1:] or ["bert-tiny", "gpt2-tiny", "transformer-layer", "mlp-wide"])
