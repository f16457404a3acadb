"""The LLVM stage: what the generated code looks like and that it is strict IEEE code."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

import braze
from braze import config

from .helpers import check_model


def report(fn, *inputs):
    return braze.explain(fn, *inputs).sections


def test_strict_mode_emits_no_fast_math_flags():
    llvm = report(lambda x, y: torch.relu(x * y + 1.5) / y, torch.randn(64), torch.randn(64))
    for flag in (" fast ", " nnan ", " ninf ", " nsz ", " arcp ", " contract ", " afn ", " reassoc "):
        assert flag not in llvm["LLVM IR"] and flag not in llvm["optimised LLVM IR"]
    assert "fmuladd" not in llvm["optimised LLVM IR"]  # no contraction of x * y + 1.5 into an FMA


def test_one_loop_per_fused_kernel_and_one_function_per_segment():
    s = report(lambda x: torch.sinh((x + 1) * 2) - 3, torch.randn(100))
    ir = s["LLVM IR"]
    assert len(re.findall(r"define internal void @\"loop\d+\"", ir)) == 2
    assert len(re.findall(r"define void @\"braze\d+_seg\d+\"", ir)) == 2  # the extern sinh splits them


def test_contiguous_loops_are_vectorised():
    opt = report(lambda x: x * 2 + 1, torch.randn(1000))["optimised LLVM IR"]
    assert re.search(r"<\d+ x float>", opt), "the loop should use vector instructions"
    assert "ymm" in report(lambda x: x * 2 + 1, torch.randn(1000))["assembly"]


def test_large_loops_run_on_the_openmp_team():
    big = torch.randn(1 << 16)
    assert "GOMP_parallel" in report(lambda x: x.relu(), big)["LLVM IR"]
    assert "GOMP_parallel" not in report(lambda x: x.relu(), big[:100])["LLVM IR"]
    with config.patch(parallel_threshold=1 << 30):
        assert "GOMP_parallel" not in report(lambda x: x.relu(), big)["LLVM IR"]
    check_model(lambda x: (x * 3).relu() - x, (big,), kernels=1)


def test_every_function_aligns_the_stack_for_its_vector_spills():
    # 512-bit spills in 16-byte aligned slots straddle cache lines on some threads' stacks, where
    # reading one back stalls (a SiLU loop ran 1.7x slower on such a thread).
    s = report(lambda x: F.silu(x * 2) + 1, torch.randn(40000))
    defined = re.findall(r"^define .*$", s["LLVM IR"], re.M)
    assert defined and all("alignstack(64)" in line for line in defined), defined
    assert "andq\t$-64, %rsp" in s["assembly"]


def test_loops_keep_their_counters_and_pointers_in_registers():
    # Left unoptimised (optnone), loops still get the optimising register allocator: the fast
    # one kept each step's counter and pointers on the stack (in registers: bert-tiny 1.05x as fast).
    asm = report(lambda x: x * 2 + 1, torch.randn(1 << 16))["assembly"]
    loops = re.findall(r"^loop\d+:$(.*?)^\.Lfunc_end", asm, re.M | re.S)
    assert loops and not any(re.search(r"\(%rsp\)", body) for body in loops), loops


# A loop whose bound is read from memory each step and whose body adds 0: -O2 hoists the read
# out of the loop (LICM) and drops the addition; `light` (jit.LIGHT) only folds it away.
_LOOP = """
define void @f(ptr noalias %p, ptr noalias %n) {
entry:
  br label %loop
loop:
  %i = phi i64 [0, %entry], [%next, %loop]
  %at = getelementptr float, ptr %p, i64 %i
  %v = load float, ptr %at
  %w = fadd float %v, 1.0
  store float %w, ptr %at
  %zero = add i64 %i, 0
  %next = add i64 %zero, 1
  %count = load i64, ptr %n
  %more = icmp slt i64 %next, %count
  br i1 %more, label %loop, label %done
done:
  ret void
}
"""


@pytest.mark.parametrize("light", [False, True])
def test_light_kernels_get_only_the_light_passes(light):
    from braze import jit

    ir = jit.compile_module(_LOOP, ["f"], opt_level=2, want_text=True, light=light).optimized_ir
    body = ir[ir.index("define") :]
    assert "add i64 %i, 0" not in body  # folded by both
    in_loop = re.search(r"\nloop\S*:.*?br i1", body, re.S).group(0)
    assert ("load i64" in in_loop) == light  # hoisted by -O2 alone


def test_gemm_calls_mkl_with_atens_arguments():
    w, b = torch.randn(10, 64), torch.randn(10)
    with config.patch(one_thread_gemm_flops=0):
        ir = report(lambda x: F.linear(x, w, b), torch.randn(32, 64))["LLVM IR"]
    assert ir.count('call void @"sgemm_"') == 1 and "MKL_Set_Num_Threads_Local" not in ir


def test_a_one_thread_gemm_sets_mkls_threads_around_its_call_only(threads):
    w, b = torch.randn(10, 64), torch.randn(10)
    threads(2)
    ir = report(lambda x: F.linear(x, w, b), torch.randn(32, 64))["LLVM IR"]
    if "MKL_Set_Num_Threads_Local" not in ir:  # on this machine it is there (README)
        pytest.skip("MKL orders this GEMM's sums differently on one thread on this CPU")
    calls = [line.split("@")[1].split("(")[0] for line in ir.splitlines() if "call" in line and "@" in line]
    set_threads = '"MKL_Set_Num_Threads_Local"'
    assert calls[calls.index('"sgemm_"') - 1 : calls.index('"sgemm_"') + 2] == [set_threads, '"sgemm_"', set_threads]


def test_compile_times_are_recorded_per_stage():
    names = [n for n, _ in braze.explain(lambda x: x + 1, torch.randn(3)).program.timings]
    for stage in ("capture", "lower", "pass.fuse_elementwise", "codegen", "llvm.optimize", "llvm.machine_code"):
        assert stage in names


def test_in_place_selects_stay_plain_vector_stores():
    # LLVM turns store(select(c, v, load p), p) into vmaskmovps, microcoded on AMD: an in-place
    # relu, clamp or where must keep its plain stores, at -O2 too.
    w, b = torch.randn(64, 64), torch.randn(64)
    with config.patch(optimize_threshold=0):
        s = report(lambda x: F.linear(x, w, b).relu(), torch.randn(64, 64))
    assert "relu" in s["IR after plan_memory"] and "store='out'" in s["IR after plan_memory"]  # in place
    assert "vmaxps" in s["assembly"]
    assert "maskmov" not in s["assembly"]


def test_vector_math_calls_mkl_once_per_threads_share():
    ir = report(lambda x: torch.exp(x + 1), torch.randn(40000))["LLVM IR"]
    assert re.search(r'call void @"?vmsExp"?\(i32', ir) and "GOMP_parallel" in ir
    ir = report(lambda x: torch.exp(x.t()), torch.randn(5, 7))["LLVM IR"]  # dense: one call, as it is
    assert not re.findall(r"define internal void @\"loop\d+\"", ir) and "GOMP_parallel" not in ir
    ir = report(lambda x: torch.exp(x[:, ::2]), torch.randn(5, 8))["LLVM IR"]  # a copy, then in place
    assert len(re.findall(r"define internal void @\"loop\d+\"", ir)) == 1


def test_only_loops_left_scalar_go_through_the_optimiser():
    # Vector loops gain nothing from it and made the first call of timm's Swin seconds longer.
    w = torch.randn(16, 64)
    with config.patch(optimize_threshold=0):
        s = report(lambda x: F.linear((x.t() * 2).contiguous(), w).relu(), torch.randn(64, 32))
    functions = re.findall(r"define [^@]*@\"?([\w.]+)\"?\(.*\{", s["optimised LLVM IR"])
    optnone = re.findall(r"define [^@]*@\"?([\w.]+)\"?\(.*#(\d+)", s["optimised LLVM IR"])
    groups = {g: line for g, line in re.findall(r"^attributes #(\d+) = \{(.*)\}", s["optimised LLVM IR"], re.M)}
    skipped = {name for name, g in optnone if "optnone" in groups[g]}
    scalar = [f for f in functions if f not in skipped]
    assert len(scalar) == 1 and scalar[0].startswith("loop"), (functions, skipped)  # the strided x.t() * 2
    assert any(f.endswith("_seg0") for f in skipped)


def test_perf_map_names_the_jit_functions():
    """With perf_map, /tmp/perf-<pid>.map names each function a program loads (Linux perf's format:
    hex start, hex size, name), its size reaching no further than the next function's start."""
    import os

    path = f"/tmp/perf-{os.getpid()}.map"
    read = lambda: [line.split() for line in open(path)] if os.path.exists(path) else []  # noqa: E731
    before = {r[2] for r in read()}
    with config.patch(perf_map=True):
        check_model(lambda x: torch.relu(x * 3 - 1), (torch.randn(37, 5),), kernels=1)
    rows = read()
    assert rows and all(len(r) == 3 for r in rows)
    starts = sorted((int(a, 16), int(n, 16), name) for a, n, name in rows)
    assert all(a + n <= b for (a, n, _), (b, _, _) in zip(starts, starts[1:]))
    new = {name for _, _, name in starts} - before
    assert any(n.endswith("_entry") for n in new) and any(n.endswith("_body") for n in new), new
