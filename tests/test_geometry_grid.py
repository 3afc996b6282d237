"""Issue 23: no false all-clear at a user's geometry (a sampled subset of benchmarks/bench_geometry_grid.py).

Each cell runs the recipe as `kvdoctor repro <recipe> --logic installed <flags>` does, in this process. On a
vLLM with the K1/K2/K4/K8 bugs every cell is `reproduced`, or `untested` naming a flag the user fixed; on
one with their fixes `not_reproduced` (or untested, named); never `not_applicable` or another exit 0.
"""

from __future__ import annotations

import random

import pytest

from benchmarks.bench_geometry_grid import cells, run_cell, violation
from tests.conftest import expected_for

# Measured with benchmarks/bench_geometry_grid.py (all 432 cells, simulated worker) on 2026-12-04.
BUGS_PRESENT = {(0, 26): True, (0, 34): False}

# The issue's own cells first, then a fixed sample of the rest (seeded: the same cells every run).
ISSUE_CELLS = [("queued-abort", 16, 1, False, None), ("queued-abort", 16, 2, False, None),
               ("queued-abort", 16, 1, True, None), ("queued-abort", 16, 2, False, 8)]
SAMPLE = ISSUE_CELLS + random.Random(23).sample([c for c in cells() if c not in ISSUE_CELLS], 20)


@pytest.mark.vllm
@pytest.mark.parametrize("cell", SAMPLE, ids=lambda c: "-".join(str(v) for v in c))
def test_no_all_clear_at_the_users_geometry(api, release, cell):
    present = expected_for(api, release, BUGS_PRESENT)
    row = run_cell(api, cell)
    assert violation(row, bug_present=present) is None, row
    assert row["outcome"] != "not_applicable" and (row["exit"] != 0 or not present), row


@pytest.mark.vllm
def test_the_issues_false_all_clear_is_gone_on_the_default_worker(api, release):
    """queued-abort at block size 16, 2 blocks a chunk, on vLLM's own worker (the CLI's default)."""
    present = expected_for(api, release, BUGS_PRESENT)
    row = run_cell(api, ("queued-abort", 16, 2, True, None), worker="vllm")
    assert row["outcome"] == ("reproduced" if present else "not_reproduced"), row
    assert row["derived"] == ["gpu_blocks: 8 -> 10"], row
