"""A deliberately slow backend for the benchmark's own test (loaded via BRAZE_BENCH_PLUGINS)."""

import time

from braze import bench


def _slowed(model, inputs):
    def run(*xs):
        end = time.perf_counter() + 300e-6  # 0.3 ms of busy waiting per call
        out = model(*xs)
        while time.perf_counter() < end:
            pass
        return out

    return run


bench.register_backend("slowed", _slowed)
