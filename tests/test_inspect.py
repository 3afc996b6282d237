"""`kvdoctor inspect`: the timeline, the one-step-ahead marker, folding, --step."""

from __future__ import annotations

import json

import pytest

from kvdoctor import SCHEMA_VERSION
from kvdoctor.observe.verdict import Outcome
from kvdoctor.outcome_codes import exit_code_for

from .cli_runner import invoke
from .recipe_runs import measured

IDLE_RECIPE = """
[recipe]
name = "idle-tail"
summary = "A finishes quickly; the remaining steps change nothing and must fold."
[signature]
exception = "AssertionError"
function = "_build_store_jobs"
[[step]]
action = "add"
request = "A"
prompt_tokens = 8
max_tokens = 2
[[step]]
action = "schedule"
count = 9
"""


@pytest.fixture(scope="module")
def inspect_doc(api):
    proc = invoke("inspect", "queued-abort", "--json")
    assert "Traceback" not in proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def test_marker_one_step_before_the_crash(inspect_doc, api):
    # Whether the installed logic crashes on queued-abort here: kvdoctor's measurement of that recipe
    # at its default setup with the CLI's default worker (kvdoctor/data/release_outcomes.toml), which
    # is exactly what `inspect queued-abort` runs.
    want = measured(api, "queued-abort")
    code, doc = inspect_doc
    assert doc["schema_version"] == SCHEMA_VERSION
    (result,) = doc["results"]
    assert result["logic"] == "installed" and result["outcome"] == want.value, result["outcome"]
    timeline = result["timeline"]
    marked = [e["index"] for e in timeline if e["predicted_failure"] and not e["failed"]]
    assert code == exit_code_for(want), (code, want)
    if want is Outcome.REPRODUCED:
        failing = [e for e in timeline if e["failed"]]
        assert len(failing) == 1 and failing[0]["index"] == result["failure_step"]
        before = next(e for e in timeline if e["index"] == result["failure_step"] - 1)
        assert before["action"] == "abort" and before["predicted_failure"] == ["B"]
        assert marked == [result["failure_step"] - 1]
    else:
        assert marked == [] and not any(e["failed"] for e in timeline)


def test_timeline_records_per_request_state(inspect_doc):
    _, doc = inspect_doc
    timeline = doc["results"][0]["timeline"]
    waiting = [e for e in timeline if any(r["request"] == "B" and r["status"] == "WAITING" for r in e["requests"])]
    assert waiting, "B must be seen queued"
    first_schedule = next(e for e in timeline if e["action"] == "schedule")
    assert first_schedule["events"]["scheduled_tokens"] == {"A": 24}
    assert first_schedule["events"]["new_store_jobs"]


def test_step_option_shows_one_step(api):
    proc = invoke("inspect", "queued-abort", "--step", "2", "--json")
    doc = json.loads(proc.stdout)
    assert [e["index"] for e in doc["results"][0]["timeline"]] == [2]
    out_of_range = invoke("inspect", "queued-abort", "--step", "99")
    assert out_of_range.returncode == 2 and "--step 99" in out_of_range.stderr


def test_quiet_steps_fold_into_one_line(api, tmp_path):
    recipe = tmp_path / "idle.toml"
    recipe.write_text(IDLE_RECIPE)
    proc = invoke("inspect", str(recipe))
    assert proc.returncode == 0, proc.stderr
    folded = [line for line in proc.stdout.splitlines() if "no change" in line]
    assert len(folded) == 1 and "–" in folded[0], proc.stdout
