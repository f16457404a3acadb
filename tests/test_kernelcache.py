"""Library kernels' machine code kept between processes (kernelcache.py): taken from disk by a
later process, the same code; a damaged file is never loaded; none kept where there is no
directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from braze import config, jit, kernelcache

# A process building gemmkernel's linear kernel and running it: how many objects it took from
# disk, and the result's bits
_SCRIPT = """
import json, torch
from braze import gemmkernel, kernelcache
gen = torch.Generator().manual_seed(0)
x, w, b = torch.randn(40, 200, generator=gen), torch.randn(33, 200, generator=gen), torch.randn(33, generator=gen)
out = gemmkernel.gemm(x, w, b, linear=True)
print(json.dumps({"taken": kernelcache.taken, "bits": out.view(torch.int32).flatten().tolist()}))
"""


def _run(directory: str) -> dict:
    env = dict(os.environ, BRAZE_KERNEL_CACHE=directory)
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, check=True)
    return json.loads(proc.stdout.splitlines()[-1])


def _objects(directory: str) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, files in os.walk(directory) for f in files if f.endswith(".o"))


def test_a_later_process_takes_the_kernels_from_disk(tmp_path):
    first = _run(str(tmp_path))
    kept = _objects(str(tmp_path))
    assert first["taken"] == 0 and len(kept) >= 2  # the block kernels and the linear's
    second = _run(str(tmp_path))
    assert second["taken"] == len(kept) and second["bits"] == first["bits"]
    assert _objects(str(tmp_path)) == kept


def test_a_damaged_file_is_not_loaded_and_is_written_again(tmp_path):
    _run(str(tmp_path))
    kept = _objects(str(tmp_path))
    with open(kept[0], "r+b") as f:
        f.seek(-5, os.SEEK_END)
        f.write(b"\xff\x00\xff\x00\xff")
    again = _run(str(tmp_path))
    assert again["taken"] == len(kept) - 1
    assert _run(str(tmp_path))["taken"] == len(kept)  # (the damaged one compiled and kept anew)


def test_nothing_is_kept_without_a_directory(tmp_path, monkeypatch):
    monkeypatch.setattr(config, "kernel_cache", "")
    assert kernelcache.load("ab" * 32) is None
    kernelcache.store("ab" * 32, b"object")
    monkeypatch.setattr(config, "kernel_cache", str(tmp_path))
    assert kernelcache.load("ab" * 32) is None
    kernelcache.store("ab" * 32, b"object")
    assert kernelcache.load("ab" * 32) == b"object"


def test_the_key_follows_the_code_and_its_optimisation():
    tm = jit.target_machine()
    code = ("define void @f() {ret void}", "; other")
    keys = {kernelcache.key(ir, level, tm) for ir in code for level in (1, 2, "light")}
    assert len(keys) == 6
    assert kernelcache.key("; other", 2, tm) == kernelcache.key("; other", 2, tm)
