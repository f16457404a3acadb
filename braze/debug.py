"""What braze did, in words: `braze.explain` and the BRAZE_DEBUG printouts.

Levels (config.debug): 1 timings and ATen fallbacks; 2 + the captured FX graph and lowered IR;
3 + IR after each pass; 4 + LLVM IR; 5 + optimised LLVM IR; 6 + assembly.
With BRAZE_DEBUG_DIR set, the same texts go to files, one folder per program.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

from . import config
from .ir import Node, Op

if TYPE_CHECKING:
    from .runtime import Program


def log(text: str) -> None:
    print(text, file=sys.stderr)


class Report(str):
    """The text of `braze.explain`; also exposes the pieces as attributes."""

    program: Any  # the first graph's
    programs: list[Any]  # one per captured graph
    sections: dict[str, str]


def _timings(prog: Program) -> str:
    rows = [f"  {name:<22}{ms:9.3f} ms" for name, ms in prog.timings]
    total = getattr(prog, "total_ms", sum(ms for _, ms in prog.timings))
    return "\n".join(rows + [f"  {'total':<22}{total:9.3f} ms"])


def _fusion(prog: Program) -> str:
    lines = []
    for n in prog.graph.nodes:
        if n.op is Op.FUSED:
            lines.append(f"  {n.name}: loop over {list(n.meta.shape)} = " + " -> ".join(b.op.value for b in n.body))
        elif n.op is Op.GEMM:
            epi = " -> ".join(b.op.value for b in n.body)
            bias = "bias + " if n.inputs[2] is not None else ""
            one = " (on one thread)" if n.attrs.get("one_thread") else ""
            call = _gemm_kernel(n) if n.attrs.get("own_kernel") else f"sgemm_{one}"
            kept = n.attrs.get("own_kernel") and n.attrs.get("pack")
            pack = f" (weight {n.attrs['pack_source']} packed once, checked every call)" if kept else ""
            lines.append(
                f"  {n.name}: {call} {bias}{n.inputs[0]} @ {n.inputs[1]}{pack}" + (f", epilogue {epi}" if epi else "")
            )
        elif n.op is Op.CAT:
            lines.append(f"  {n.name}: copies of {', '.join(n.inputs)} along dimension {n.attrs['dim']}")
        elif n.op is Op.VML:
            lines.append(f"  {n.name}: MKL {n.attrs['fn']} on {n.inputs[0]}")
        elif n.op is Op.RMS_NORM:
            weight = f", times {n.inputs[1]}" if n.inputs[1] is not None else ""
            lines.append(f"  {n.name}: RMSNorm of the rows of {n.inputs[0]}{weight}")
        elif n.op is Op.BMM:
            batch = n.attrs["blas"]["batch"]
            own = n.attrs.get("own_kernel")
            call = "braze's GEMM kernel (MKL's order), matrix by matrix," if own else "cblas_sgemm_batch"
            lines.append(f"  {n.name}: {call} {n.inputs[0]} @ {n.inputs[1]}, {batch} matrices")
    return "\n".join(lines) or "  (no native kernels)"


def _gemm_kernel(n: Node) -> str:
    """Which order braze's GEMM kernel follows: fast mode's, on panels packed once, its own."""
    if n.attrs.get("pack"):
        return "braze's GEMM kernel"
    return "braze's GEMM kernel (" + ("oneDNN's" if n.attrs.get("order") else "MKL's") + " order)"


def _placement(prog: Program) -> str:
    native = [n.name for s in prog.segments for n in s.kernels]
    lines = [f"  native: {len(native)} kernel(s) in {len(prog.segments)} LLVM function(s)"]
    body = "native" if prog.native else f"generated Python ({prog.python_body_why})"
    lines.append(f"  entry: native guard; body: {body}")
    for label, why in prog.externs:
        lines.append(f"  ATen:   {label}  ({why})")
    return "\n".join(lines)


def compilations(wrapper: Any) -> str:
    """Each program a wrapper compiled (its TorchDynamo graphs' too), with why and how long."""
    rows = [(f"graph {i}: ", c) for i, sub in enumerate(wrapper._subgraphs) for c in sub.compilations]
    rows = [("", c) for c in wrapper.compilations] + rows
    lines = [f"  {n:>3}. {where}{c.why}  ({c.ms:.1f} ms)" for n, (where, c) in enumerate(rows, 1)]
    return "\n".join(lines) or "  (none yet)"


def sections(prog: Program, captured_graph: Any) -> dict[str, str]:
    out = {
        "captured graph (torch.fx)": str(captured_graph),
        "IR after lowering": str(prog.lowered.graph),
    }
    for rec in prog.pass_log.records:
        out[f"IR after {rec.name}"] = str(rec.graph)
    out["fusion groups"] = _fusion(prog)
    out["native vs ATen"] = _placement(prog)
    out["LLVM IR"] = prog.llvm_ir or "(no native code)"
    out["optimised LLVM IR"] = prog.optimized_ir or "(no native code)"
    out["assembly"] = prog.asm or "(no native code)"
    out["compile time per stage"] = _timings(prog)
    return out


_LEVEL = {
    "compile time per stage": 1,
    "native vs ATen": 1,
    "fusion groups": 1,
    "captured graph (torch.fx)": 2,
    "IR after lowering": 2,
    "LLVM IR": 4,
    "optimised LLVM IR": 5,
    "assembly": 6,
}


def report_compile(prog: Program, fn: Any) -> None:
    if not config.debug and not config.debug_dir:
        return
    from .capture import _name

    secs = sections(prog, getattr(prog, "captured_graph", ""))
    title = f"braze: compiled {_name(fn)} in {prog.total_ms:.2f} ms"
    if config.debug_dir:
        folder = os.path.join(config.debug_dir, f"program_{id(prog):x}")
        os.makedirs(folder, exist_ok=True)
        for name, text in secs.items():
            with open(os.path.join(folder, name.replace(" ", "_").replace("/", "_") + ".txt"), "w") as f:
                f.write(text + "\n")
    if config.debug:
        log(title)
        for name, text in secs.items():
            if _LEVEL.get(name, 3) <= config.debug:
                log(f"--- {name} ---\n{text}")
