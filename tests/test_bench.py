"""The benchmark harness itself: it writes the promised schema and can tell slow from fast."""

from __future__ import annotations

import json
import os
import subprocess
import sys

FIELDS = {"model", "backend", "first_call_s", "first_call_warm_s", "steady_us", "speedup_vs_eager", "equal",
          "max_abs_diff", "error_ratio", "peak_rss_mb", "error"}  # fmt: skip


def test_bench_smoke(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, BRAZE_BENCH_PLUGINS="tests.bench_plugin", PYTHONPATH=root)
    cmd = [sys.executable, "-m", "braze", "bench", "--models", "lesson", "--backends", "eager,braze,slowed",
           "--rounds", "3", "--quick", "--out", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "results.json").read_text())
    assert {"cpu", "cores", "torch", "torch_threads"} <= set(data["machine"])
    rows = {r["backend"]: r for r in data["results"]}
    assert set(rows) == {"eager", "braze", "slowed"}
    for r in rows.values():
        assert set(r) == FIELDS and r["error"] is None, r
        assert r["first_call_s"] > 0 and r["steady_us"] > 0 and r["peak_rss_mb"] > 0
        assert r["equal"] is True and r["max_abs_diff"] == 0 and r["error_ratio"] <= 1.0
    assert rows["slowed"]["steady_us"] > rows["eager"]["steady_us"] + 200
    assert rows["slowed"]["speedup_vs_eager"] < 0.5
    assert rows["eager"]["speedup_vs_eager"] == 1.0
    assert (tmp_path / "results.png").stat().st_size > 10_000
    assert "| lesson |" in proc.stdout
