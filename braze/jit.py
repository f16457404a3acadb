"""Stage 5, machine code: optimise an LLVM module for the host CPU and load it.

One MCJIT engine per process; modules are added to it. The symbols generated code calls are
bound to the exact functions the torch wheel loaded: MKL's `sgemm_` inside libtorch_cpu (the
routine eager's addmm calls) and the libgomp that ATen's parallel_for uses.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from dataclasses import dataclass

import llvmlite.binding as llvm
import torch

_lock = threading.Lock()
_state: dict[int, tuple[llvm.ExecutionEngine, llvm.TargetMachine]] = {}


def _torch_lib(name: str) -> ctypes.CDLL:
    return ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", name))


def _bind_symbols() -> None:
    cpu = _torch_lib("libtorch_cpu.so")
    llvm.add_symbol("sgemm_", ctypes.cast(cpu.sgemm_, ctypes.c_void_p).value)
    gomp = _torch_lib("libgomp.so.1")
    for name in ("GOMP_parallel", "omp_get_thread_num", "omp_get_num_threads"):
        llvm.add_symbol(name, ctypes.cast(getattr(gomp, name), ctypes.c_void_p).value)


def _target_machine(opt: int) -> llvm.TargetMachine:
    target = llvm.Target.from_default_triple()
    features = llvm.get_host_cpu_features().flatten()
    return target.create_target_machine(cpu=llvm.get_host_cpu_name(), features=features, opt=opt)


def _engine(codegen_opt: int) -> tuple[llvm.ExecutionEngine, llvm.TargetMachine]:
    """The JIT for one instruction-selection level: -O0 (FastISel) for small programs whose
    loops codegen already vectorised, -O2 after LLVM's optimiser for programs with much work."""
    if not _state:
        llvm.initialize_native_target()
        llvm.initialize_native_asmprinter()
        _bind_symbols()
    if codegen_opt not in _state:
        tm = _target_machine(codegen_opt)
        _state[codegen_opt] = (llvm.create_mcjit_compiler(llvm.parse_assembly(""), tm), tm)
    return _state[codegen_opt]  # type: ignore[return-value]


def target_machine() -> llvm.TargetMachine:
    return _engine(2)[1]


@dataclass
class Compiled:
    addresses: dict[str, int]
    llvm_ir: str
    optimized_ir: str
    asm: str
    timings: list[tuple[str, float]]


def compile_module(ir_text: str, names: list[str], opt_level: int, want_text: bool) -> Compiled:
    """Parse, verify, optimise and JIT-load `ir_text`; return the addresses of `names`.

    opt_level 0 skips LLVM's optimiser and selects instructions fast: codegen already writes
    vector loops, and this takes ~5 ms instead of ~20 ms for the lesson MLP. Higher levels run
    the new pass manager's pipeline at that speed level (for programs with much loop work).
    """
    with _lock:
        engine, tm = _engine(2 if opt_level else 0)
        t0 = time.perf_counter()
        mod = llvm.parse_assembly(ir_text)
        mod.triple = tm.triple
        mod.data_layout = str(tm.target_data)
        mod.verify()
        t1 = time.perf_counter()
        if opt_level:
            pto = llvm.create_pipeline_tuning_options(speed_level=opt_level)
            # Unrolling and interleaving quadruple compile time for loops that are memory-bound.
            pto.loop_unrolling = False
            pto.loop_interleaving = False
            pb = llvm.create_pass_builder(tm, pto)
            pb.getModulePassManager().run(mod, pb)
        t2 = time.perf_counter()
        optimized = str(mod) if want_text else ""
        asm = tm.emit_assembly(mod) if want_text else ""
        engine.add_module(mod)
        engine.finalize_object()
        addresses = {n: engine.get_function_address(n) for n in names}
        t3 = time.perf_counter()
    ms = lambda a, b: (b - a) * 1e3  # noqa: E731
    timings = [("llvm.parse", ms(t0, t1)), ("llvm.optimize", ms(t1, t2)), ("llvm.machine_code", ms(t2, t3))]
    return Compiled(addresses, ir_text if want_text else "", optimized, asm, timings)
