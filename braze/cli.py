"""The `braze` command: `braze demo`, `braze bench`, `braze explain`."""

from __future__ import annotations

import argparse
import sys
import time


def _lesson():  # noqa: ANN202
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)).eval()
    return model, torch.randn(32, 64)


def demo(rounds: int) -> int:
    """The lesson's three-layer MLP: first-call time, exactness, steady-state speed-up."""
    import torch

    import braze
    from braze import timing

    model, x = _lesson()
    t0 = time.perf_counter()
    compiled = braze.compile(model)
    t1 = time.perf_counter()
    with torch.no_grad():
        out = compiled(x)
    t2 = time.perf_counter()
    with torch.no_grad():
        ref = model(x)
    print("braze demo: Linear(64, 64) -> ReLU -> Linear(64, 10), input 32x64, float32")
    print(f"  torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"  braze.compile(model) returned in {(t1 - t0) * 1e3:.3f} ms (nothing compiled yet)")
    print(f"  first call (capture + compile + run): {(t2 - t1) * 1e3:.1f} ms")
    print(f"  output shape: {tuple(out.shape)}; torch.equal with eager: {torch.equal(out, ref)}")
    with torch.no_grad():
        r = timing.compare({"eager": model, "braze": compiled}, (x,), rounds=rounds)
        # short rounds, many: more chances of a quiet moment on a shared machine
        split = timing.split(model, (x,), rounds=3 * rounds, seconds=0.02)
    eager, fast = r["eager"], r["braze"]
    print(f"  steady state, fastest of {rounds} interleaved rounds: eager {eager.us:.2f} us, braze {fast.us:.2f} us")
    print(f"  speed-up vs eager (median of per-round ratios): {r.speedup('braze', 'eager'):.2f}x")
    if split is not None:
        print(
            f"  braze's own time per call beside its BLAS calls: {split.own_us:.2f} us (a clocked build, fastest"
            f" of {3 * rounds} rounds of its own: {split.call_us:.2f} us per call, {split.blas_us:.2f} us in sgemm_)"
        )
    return 0 if torch.equal(out, ref) else 1


def explain(model_name: str) -> int:
    import braze

    model, x = _lesson()
    print(braze.explain(model, x))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="braze", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="compile the lesson MLP and compare it with eager")
    d.add_argument("--rounds", type=int, default=15)
    sub.add_parser("explain", help="print every stage of compiling the lesson MLP")
    b = sub.add_parser("bench", help="benchmark braze beside eager, Inductor, TorchScript, ONNX Runtime, OpenVINO")
    from . import bench

    bench.add_arguments(b)
    args = parser.parse_args(argv)
    if args.cmd == "demo":
        return demo(args.rounds)
    if args.cmd == "explain":
        return explain("lesson")
    return bench.main(args)


if __name__ == "__main__":
    sys.exit(main())
