"""The OpInfo sweep (tests/opinfo.py): `make test` runs the fast subset, `make test-opinfo` all
of it (BRAZE_OPINFO=full)."""

from __future__ import annotations

import os

import pytest

from . import opinfo

FULL = os.environ.get("BRAZE_OPINFO") == "full"
OUTCOMES: list[opinfo.Outcome] = []  # conftest reports them after the session


@pytest.mark.parametrize("name,path", opinfo.cases(FULL), ids=lambda v: v)
def test_opinfo(name, path):
    bad = []
    for case in opinfo.runs(name, path, FULL):
        out = opinfo.run(case)
        OUTCOMES.append(out)
        if out.kind in opinfo.BAD:
            bad.append(f"sample {case.sample}, {case.threads} thread(s), {case.layout}: {out.kind}: {out.detail}")
    assert not bad, "\n".join(bad)
