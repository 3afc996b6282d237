"""The installed vLLM release's `kvdoctor audit --json`, compared with kvdoctor's own
measurements in kvdoctor/data/release_outcomes.toml (one row per release x recipe).

Each row also records the run's crash-site coverage; a `not_reproduced` counts only where the
run reached the recipe's crash site and it held, or the site is gone from that release's source
(checked on the data for every release, and on the installed release's own audit).

A difference fails: the data is re-measured with `kvdoctor matrix --audit --write-data`
and reviewed, never silently updated. A release the file has no rows for skips.
"""

from __future__ import annotations

import json

import pytest

from kvdoctor.matrix import data
from kvdoctor.matrix.data import coverage_class
from kvdoctor.matrix.runner import failure_site
from kvdoctor.recipes.builtins import all_builtins, builtin_names
from kvdoctor.recipes.geometry import measured_reasons

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def audit_doc(api) -> dict:
    """`kvdoctor audit --json`'s document, from the session's one in-process audit (the same application
    call and JSON builder the command uses; tests/recipe_runs.cli_audit)."""
    from kvdoctor.report.json_doc import audit_document, dumps

    from .recipe_runs import cli_audit

    report = cli_audit()
    assert int(report.exit_status) in (0, 1, 4)
    return json.loads(dumps(audit_document(report)))


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


@pytest.fixture(scope="module")
def observed_coverage(audit_doc) -> dict[str, str | None]:
    return {row["recipe"]: (row.get("coverage") or {}).get("summary") for row in audit_doc["rows"]}


@pytest.mark.parametrize("recipe", builtin_names())
def test_recipe_outcome_matches_the_measurement(recipe, measured, observed, audit_doc):
    assert recipe in measured, (f"{recipe} was never measured on vLLM {audit_doc['vllm_version']}: "
                                "re-measure with kvdoctor matrix --audit --write-data")
    row = measured[recipe]
    assert observed[recipe] == (row.outcome, row.failure_site), (
        f"{recipe} on vLLM {row.release}: measured {row.outcome} ({row.failure_site}) on {row.measured_on} by "
        f"kvdoctor {row.kvdoctor_version}, now {observed[recipe]}")


@pytest.mark.parametrize("recipe", builtin_names())
def test_not_reproduced_only_where_the_run_reached_its_crash_site(recipe, observed, observed_coverage, audit_doc):
    """On the installed release: a recipe that ran through reached its crash site and it held, or the
    site is gone from this vLLM's source; a run that never reached it says not_reached."""
    coverage = observed_coverage[recipe]
    assert coverage is not None, f"{recipe}: the audit's run measured no crash-site coverage"
    if observed[recipe][0] == "not_reproduced":
        assert coverage_class(coverage) in ("held", "gone"), f"{recipe} on {audit_doc['vllm_version']}: {coverage}"
    if coverage_class(coverage) == "not_reached":
        assert observed[recipe][0] in ("not_reached", "other_failure", "setup_error"), (recipe, coverage)


@pytest.mark.parametrize("recipe", builtin_names())
def test_recipe_coverage_matches_the_measurement(recipe, measured, observed_coverage):
    row = measured.get(recipe)
    if row is None or row.coverage is None:
        pytest.skip(f"{recipe}: no coverage measured on this release")
    assert coverage_class(observed_coverage[recipe]) == row.coverage_class, (
        f"{recipe} on vLLM {row.release}: measured '{row.coverage}' on {row.measured_on}, now "
        f"'{observed_coverage[recipe]}'")


@pytest.mark.parametrize("recipe", builtin_names())
def test_fixed_logic_outcome_matches_the_measurement(recipe, measured, audit_doc):
    """The audit runs kvdoctor's fixed logic beside the installed one: its outcome is measured too."""
    row = measured.get(recipe)
    if row is None or row.fixed_logic_outcome is None:
        pytest.skip(f"{recipe}: no fixed-logic outcome measured on this release")
    observed = next(r["fixed_logic_outcome"] for r in audit_doc["rows"] if r["recipe"] == recipe)
    assert observed == row.fixed_logic_outcome, (
        f"{recipe} on vLLM {row.release}: fixed logic measured {row.fixed_logic_outcome} on {row.measured_on}, "
        f"now {observed}")


def test_no_measurement_of_a_recipe_that_is_gone(measured, observed):
    assert sorted(measured) == sorted(observed)


# -- the data itself, for every release it holds (no vLLM needed) ---------------------------------

@pytest.mark.parametrize("row", [r for r in data.load() if r.outcome == "not_reproduced"],
                         ids=lambda r: f"{r.release}-{r.recipe}")
def test_no_measured_not_reproduced_without_reaching_the_site(row):
    """The table's not_reproduced rows: each run reached its crash site and it held, or the site is gone."""
    assert row.coverage_class in ("held", "gone"), f"{row.release} {row.recipe}: {row.coverage}"


def test_fixed_in_only_where_earned():
    """The audit hint "stops reproducing in X" names a release whose run reached the site and held."""
    from kvdoctor.matrix.known import fixed_in

    rows = data.load()
    for name in builtin_names():
        fix = fixed_in(name)
        if fix is not None:
            row = next(r for r in rows if r.recipe == name and r.release == fix.release)
            assert row.earns_fixed, (name, row)


_REASONS = [(recipe.name, requirement) for recipe in all_builtins() for requirement in measured_reasons(recipe)]


@pytest.mark.parametrize("recipe_name, requirement", _REASONS, ids=[f"{n}-{r}" for n, r in _REASONS])
def test_measured_reason_matches_a_run_at_the_value_that_breaks_it(recipe_name, requirement, measured, api):
    """`reason_outcomes` is a measurement: the recipe played at the value that breaks the reason (what
    `matrix --write-data` runs) shows the recorded outcome on the installed release."""
    from kvdoctor.engine.overrides import Overrides
    from kvdoctor.levels.runners import runner
    from kvdoctor.recipes.builtins import resolve
    from kvdoctor.recipes.geometry import reason_alternative
    from kvdoctor.resolution import resolve_setup

    row = measured.get(recipe_name)
    if row is None or not row.reason_outcomes or requirement not in row.reason_outcomes:
        pytest.skip(f"{recipe_name}: {requirement} not measured on this release")
    recipe = resolve(recipe_name)
    values = reason_alternative(recipe, requirement, resolve_setup(recipe, Overrides(worker="simulated")))
    setup = resolve_setup(recipe, Overrides(**values), default_worker="vllm")
    result = runner("scheduler").judged_run(api, recipe, setup, "installed")
    played = (result.played_outcome or result.outcome).value
    assert played == row.reason_outcomes[requirement], (
        f"{recipe_name} at {values} on vLLM {row.release}: measured {row.reason_outcomes[requirement]} on "
        f"{row.measured_on}, now {played} ({result.detail})")
