"""Issue 23: no false all-clear at a user's geometry (a sampled subset of benchmarks/bench_geometry_grid.py).

Each cell runs the recipe as `kvdoctor repro <recipe> --logic installed <flags>` does, in this process. On a
vLLM with the cell's bug (K1/K2/K4/K8: its recipe reproduces at its default setup there, as
kvdoctor/data/release_outcomes.toml measured) every cell is `reproduced`, or `untested` naming a flag the
user fixed; on one with the fix `not_reproduced` or `not_reached` (or untested, named); never
`not_applicable` or another exit 0.
"""

from __future__ import annotations

import random

import pytest

from benchmarks.bench_geometry_grid import cells, run_cell, violation
from tests.recipe_runs import bug_present

# The whole grid: benchmarks/bench_geometry_grid.py (all 432 cells, simulated worker; 0.26.0 and 0.34.0,
# 2026-12-04).

# The issue's own cells first, then a fixed sample of the rest (seeded: the same cells every run).
ISSUE_CELLS = [("queued-abort", 16, 1, False, None), ("queued-abort", 16, 2, False, None),
               ("queued-abort", 16, 1, True, None), ("queued-abort", 16, 2, False, 8)]
SAMPLE = ISSUE_CELLS + random.Random(23).sample([c for c in cells() if c not in ISSUE_CELLS], 20)


@pytest.mark.vllm
@pytest.mark.parametrize("cell", SAMPLE, ids=lambda c: "-".join(str(v) for v in c))
def test_no_all_clear_at_the_users_geometry(api, cell):
    present = bug_present(api, cell[0])
    row = run_cell(api, cell)
    assert violation(row, bug_present=present) is None, row
    assert row["outcome"] != "not_applicable" and (row["exit"] != 0 or not present), row


@pytest.mark.vllm
def test_the_issues_false_all_clear_is_gone_on_the_default_worker(api):
    """queued-abort at block size 16, 2 blocks a chunk, on vLLM's own worker (the CLI's default)."""
    present = bug_present(api, "queued-abort")
    row = run_cell(api, ("queued-abort", 16, 2, True, None), worker="vllm")
    assert row["outcome"] == ("reproduced" if present else "not_reproduced"), row
    assert row["derived"] == ["gpu_blocks: 8 -> 10"], row
