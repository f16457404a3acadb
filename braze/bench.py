"""`braze bench` (placeholder until the benchmark lands)."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true")


def main(args: argparse.Namespace) -> int:
    raise SystemExit("braze bench: not implemented yet")
