"""Machine code of the library kernels (jit.kernel: GEMM, convolution, row and pooling kernels)
kept on disk between processes, so that a process's first call does not build them again.

A kernel's object file is stored under a key of everything its code follows from: the LLVM IR
text (the kernel's whole definition), the optimisation level, and the machine: LLVM's version,
the target triple, the CPU's name and features. The same key always means the same code; a
change to any of them is another key. Files are written whole (a temporary file renamed into
place, so processes that compile at once never read half a file) with a SHA-256 of their
contents in front, checked on every read: a file that does not match is ignored (and the kernel
compiled again), never loaded. Programs (which hold the addresses of one process's tensors) are
not kept.

    config.kernel_cache   the directory ("" : none); BRAZE_KERNEL_CACHE, default
                          $XDG_CACHE_HOME/braze/kernels (~/.cache/braze/kernels)

Measured (2026-12-06, this AMD machine): building gemmkernel's kernels for a linear layer
took 0.17 s of `mlp-wide`'s 0.55-0.64 s first call in a fresh process.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile

import llvmlite
import llvmlite.binding as llvm

from . import config

FORMAT = b"braze-kernel-1\n"
taken = 0  # objects this process took from disk (tests read it)


def key(ir_text: str, opt_level: int | str, tm: llvm.TargetMachine) -> str:
    """What the object code of `ir_text` compiled at `opt_level` for this machine follows from."""
    machine = (
        llvmlite.__version__,
        llvm.llvm_version_info,
        tm.triple,
        llvm.get_host_cpu_name(),
        llvm.get_host_cpu_features().flatten(),
        opt_level,
    )
    return hashlib.sha256(FORMAT + repr(machine).encode() + ir_text.encode()).hexdigest()


def _path(name: str) -> str | None:
    return os.path.join(config.kernel_cache, name[:2], name[2:] + ".o") if config.kernel_cache else None


def load(name: str) -> bytes | None:
    """The object file kept under `name`, if there is one whose checksum holds."""
    path = _path(name)
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    head = len(FORMAT) + 32
    if data[: len(FORMAT)] != FORMAT or hashlib.sha256(data[head:]).digest() != data[len(FORMAT) : head]:
        return None
    global taken
    taken += 1
    return data[head:]


def store(name: str, obj: bytes) -> None:
    """Keep `obj` under `name` (nothing where there is no directory, or it cannot be written)."""
    path = _path(name)
    if path is None:
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    except OSError:
        return
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(FORMAT + hashlib.sha256(obj).digest() + obj)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
