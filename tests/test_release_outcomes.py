"""The installed vLLM release's `kvdoctor audit --json`, compared with kvdoctor's own
measurements in kvdoctor/data/release_outcomes.toml (one row per release x recipe).

A difference fails: the data is re-measured with `kvdoctor matrix --audit --write-data`
and reviewed, never silently updated. A release the file has no rows for skips.
"""

from __future__ import annotations

import json

import pytest

from kvdoctor.matrix import data
from kvdoctor.matrix.runner import failure_site
from kvdoctor.recipes.builtins import builtin_names
from tests.conftest import run_cli

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def audit_doc() -> dict:
    proc = run_cli("audit", "--json", timeout=1800)
    if proc.returncode == 3:
        pytest.skip(f"no usable vLLM here: {proc.stderr.strip()}")
    assert proc.returncode in (0, 1, 4), proc.stderr[-2000:]
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def measured(audit_doc) -> dict[str, data.OutcomeRow]:
    release = audit_doc["vllm_version"]
    rows = {row.recipe: row for row in data.load() if row.release == release}
    if not rows:
        pytest.skip(f"kvdoctor/data/release_outcomes.toml has no measurements for vLLM {release}")
    return rows


@pytest.fixture(scope="module")
def observed(audit_doc) -> dict[str, tuple[str, str | None]]:
    return {row["recipe"]: (row["outcome"], failure_site(row["failure"], row["violations"])
                            if row["outcome"] == "reproduced" else None)
            for row in audit_doc["rows"]}


@pytest.mark.parametrize("recipe", builtin_names())
def test_recipe_outcome_matches_the_measurement(recipe, measured, observed, audit_doc):
    assert recipe in measured, (f"{recipe} was never measured on vLLM {audit_doc['vllm_version']}: "
                                "re-measure with kvdoctor matrix --audit --write-data")
    row = measured[recipe]
    assert observed[recipe] == (row.outcome, row.failure_site), (
        f"{recipe} on vLLM {row.release}: measured {row.outcome} ({row.failure_site}) on {row.measured_on} by "
        f"kvdoctor {row.kvdoctor_version}, now {observed[recipe]}")


def test_no_measurement_of_a_recipe_that_is_gone(measured, observed):
    assert sorted(measured) == sorted(observed)
