"""`kvdoctor matrix --ray` on a local Ray instance: the releases' kvdoctor runs are Ray tasks, and the
table and `--bisect` answer are those of the matrix without Ray.

"Without Ray" is kvdoctor's own measurement of these releases (kvdoctor/data/release_outcomes.toml,
written by `kvdoctor matrix --audit --write-data`, which runs the local runner): each cell's outcome
must equal it. Environments come from `--env-dir` (KVDOCTOR_MATRIX_ENV_DIR, default: this checkout,
whose environments .ci/run syncs first).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvdoctor.matrix.data import load

from .conftest import ROOT, run_cli

pytestmark = pytest.mark.vllm
pytest.importorskip("ray", reason="matrix --ray needs Ray (the dev group has it; pip install 'kvdoctor[ray]')")

RELEASES = ("0.26.0", "0.27.0", "0.27.1", "0.28.0")
RECIPE = "queued-abort"


def _env_dir() -> str:
    env_dir = os.environ.get("KVDOCTOR_MATRIX_ENV_DIR", str(ROOT))
    names = {"0.26.0": ".venv"} | {r: f".venv-vllm-{r.removesuffix('.0')}" for r in RELEASES[1:]}
    missing = [r for r in RELEASES if not (Path(env_dir) / names[r] / "bin" / "python").exists()]
    if missing:
        pytest.skip(f"no environment for {', '.join(missing)} under {env_dir} (.ci/run syncs them)")
    return env_dir


@pytest.fixture(scope="module")
def runs():
    env_dir = _env_dir()
    spec = f"{RELEASES[0]}..{RELEASES[-1]}"
    table = run_cli("matrix", RECIPE, "--vllm", spec, "--ray", "--json", "--env-dir", env_dir, timeout=1800)
    bisect = run_cli("matrix", RECIPE, "--vllm", spec, "--bisect", "--ray", "--json", "--env-dir", env_dir,
                     timeout=1800)
    return table, bisect


def test_the_table_on_ray_is_the_measured_table(runs):
    table, _ = runs
    assert table.returncode == 1, table.stderr[-2000:]  # 0.26.0 reproduces
    cells = {c["release"]: c for c in json.loads(table.stdout)["cells"]}
    measured = {row.release: row.outcome for row in load() if row.recipe == RECIPE and row.release in RELEASES}
    assert set(measured) == set(RELEASES), "the data file lacks a release of this test"
    assert {release: cells[release]["outcome"] for release in RELEASES} == measured
    assert {cells[r]["vllm_version"] for r in RELEASES} == set(RELEASES)  # each ran in its own environment


def test_bisect_on_ray_gives_the_same_answer(runs):
    _, bisect = runs
    assert bisect.returncode == 1, bisect.stderr[-2000:]
    (bisection,) = json.loads(bisect.stdout)["bisections"]
    measured = {row.release: row.outcome for row in load() if row.recipe == RECIPE and row.release in RELEASES}
    first_fixed = next(r for r in RELEASES if measured[r] == "not_reproduced")
    last_reproducing = max((r for r in RELEASES if measured[r] == "reproduced"), key=RELEASES.index)
    assert (bisection["first_not_reproducing"], bisection["last_reproducing"]) == (first_fixed, last_reproducing)


def test_no_ray_left_behind(runs):
    from kvdoctor.explore.ray_pool import unused_instance_dirs

    # a folder another test's live instance still uses (test_explore_ray's, beside this one under xdist) is not left
    assert not unused_instance_dirs()
