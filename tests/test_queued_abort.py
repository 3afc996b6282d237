"""queued-abort (K1, vLLM #49118) on the real scheduler: the outcome matrix per release."""

from __future__ import annotations

import json

import pytest

from kvdoctor import SCHEMA_VERSION, app
from kvdoctor.engine.overrides import Overrides
from kvdoctor.observe.verdict import Outcome
from kvdoctor.report.guards import guard_lines

from .recipe_runs import measured

GEOMETRIES = {
    "issue-49118": {},  # block size 4, 1 block per chunk, 8 GPU blocks
    "bs8-chunk2": {"block_size": 8, "blocks_per_chunk": 2, "gpu_blocks": 10},
}
MODES = {"sync": False, "async": True}


@pytest.fixture(scope="module")
def reports(api):
    return {
        (geometry, mode): app.repro("queued-abort", Overrides(**{**overrides, "async_scheduling": is_async}), "all")
        for geometry, overrides in GEOMETRIES.items()
        for mode, is_async in MODES.items()
    }


CASES = [(g, m) for g in GEOMETRIES for m in MODES]


def by_logic(report):
    return {r.logic: r for r in report.results}


R, N = Outcome.REPRODUCED, Outcome.NOT_REPRODUCED


@pytest.fixture(scope="module")
def expected(api):
    """Outcome per logic and scheduling mode as kvdoctor measured queued-abort on this release (the data
    file, at the recipe's own geometry: the other geometry here must end the same), and the guard named
    for B. Where K1 is (installed reproduces; measured on 0.26.0) the fixed logic's store is held by the
    PR #49146 cap; where it is fixed (0.30.0, 0.33.0, 0.34.0 measured) removing the cap alone does not
    bring the crash back: aborted requests count only computed tokens (PR #49285), and the output must
    say so."""
    present = measured(api, "queued-abort") is R
    outcomes = {mode: {logic: measured(api, "queued-abort", logic, is_async)
                       for logic in ("installed", "fixed", "unpatched")} for mode, is_async in MODES.items()}
    return {**outcomes, "installed": outcomes["sync"]["installed"],
            "unpatched_guard": None if present else "PR #49285",
            "fixed_guard": "allocated-chunk cap of PR #49146" if present else None}


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_outcome_matrix(reports, expected, case):
    results = by_logic(reports[case])
    assert reports[case].setup.async_scheduling is MODES[case[1]]
    for logic in ("installed", "fixed", "unpatched"):
        assert results[logic].outcome is expected[case[1]][logic], (logic, results[logic].detail)
    if expected["unpatched_guard"]:
        assert any(expected["unpatched_guard"] in g and g.startswith("B:") for g in guard_lines(results["unpatched"]))


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_failure_location_and_state(reports, case):
    result = by_logic(reports[case])["installed"]
    if result.outcome is not R:
        pytest.skip("the installed logic does not fail on this release")
    failure = result.failure
    assert failure.exception == "AssertionError"
    assert failure.function == "_build_store_jobs"
    assert failure.file.endswith("kv_connector/v1/offloading/scheduler.py")
    assert "len(offload_keys) == len(offload_block_ids)" in failure.code
    assert [f.function for f in failure.vllm_frames][:1] == ["schedule"]
    b = next(r for r in result.requests if r.request == "B")
    assert b.status == "FINISHED_ABORTED" and b.computed_tokens == 0
    (group,) = b.groups
    assert group.allocated_blocks == 0 and group.allocated_chunks == 0
    assert group.offload_keys == 4 and group.storable_installed == 4 and group.storable_fixed == 0
    assert b.would_trip


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_fixed_logic_passes_upstream_regression_checks(reports, case):
    result = by_logic(reports[case])["fixed"]
    assert [c.passed for c in result.checks] == [True, True]
    b = next(r for r in result.requests if r.request == "B")
    assert b.store_jobs_built == 0 and not b.connector_state


def test_fixed_logic_names_the_cap(reports, expected):
    if not expected["fixed_guard"]:
        pytest.skip("this release never reaches the cap for a queued abort")
    guards = guard_lines(by_logic(reports[("issue-49118", "sync")])["fixed"])
    assert any(expected["fixed_guard"] in g and g.startswith("B:") for g in guards), guards


def test_cli_json_document_and_exit_code(expected, release):
    """`kvdoctor repro queued-abort --json`, in this process (tests/cli_runner.invoke, stdout and stderr apart;
    an exception escaping the command would raise out of invoke)."""
    from .cli_runner import invoke

    proc = invoke("repro", "queued-abort", "--json")
    assert proc.returncode == (1 if expected["installed"] is R else 0), proc.stderr
    assert "Traceback" not in proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["schema_version"] == SCHEMA_VERSION and doc["recipe"]["name"] == "queued-abort"
    assert doc["vllm_version"].startswith(f"{release[0]}.{release[1]}.")
    assert [r["logic"] for r in doc["results"]] == ["installed", "fixed", "unpatched"]
    installed = doc["results"][0]
    assert installed["outcome"] == expected["installed"].value
    if expected["installed"] is R:
        assert installed["failure"]["function"] == "_build_store_jobs"
        assert {"exception", "message", "file", "line", "function"} <= set(installed["failure"])
        states = {r["request"]: r for r in installed["requests"]}
        assert states["B"]["groups"][0]["allocated_chunks"] == 0
    else:
        assert installed["outcome"] == "not_reproduced" and installed["failure"] is None


def test_a_precondition_that_does_not_hold_is_a_setup_error(api, tmp_path):
    """If B is not queued there is no verdict, only the observed state (exit 4)."""
    from .cli_runner import invoke
    from .conftest import ROOT

    text = (ROOT / "repros" / "queued-abort.toml").read_text()
    # A no longer fills the pool: B gets blocks at once.
    recipe = tmp_path / "not-queued.toml"
    recipe.write_text(text.replace("fill_pool = true", "prompt_chunks = 1", 1))
    report = app.repro(str(recipe), Overrides(), "installed", record_timeline=True)
    (result,) = report.results
    assert result.outcome is Outcome.SETUP_ERROR
    assert "B must be queued" in result.detail and "observed B: status=RUNNING" in result.detail
    assert result.timeline[-1].action == "expect" and result.timeline[-1].failed
    outcome = invoke("repro", str(recipe), "--logic", "installed")
    assert outcome.returncode == 4, outcome.stdout + outcome.stderr
