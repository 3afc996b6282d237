"""`kvdoctor diagnose` end to end on the installed vLLM: the matching recipes really run."""

from __future__ import annotations

import json

import pytest

from .recipe_runs import measured
from .test_diagnose import LOGS, MATCHES, REAL, SYNTHETIC

pytestmark = pytest.mark.vllm


def expected_of(api, recipe: str, async_scheduling: bool = False) -> dict:
    """What a matched recipe's run must show: its installed and fixed logic's outcomes as kvdoctor measured
    them on this release (kvdoctor/data/release_outcomes.toml, in the run's scheduling mode; the run at a
    log's geometry must end as at the recipe's own), and the exit status the installed outcome earns."""
    from kvdoctor.outcome_codes import exit_code_for

    installed = measured(api, recipe, "installed", async_scheduling)
    return {"installed": installed.value, "fixed": measured(api, recipe, "fixed", async_scheduling).value,
            "exit": int(exit_code_for(installed.value))}


@pytest.fixture(scope="module")
def real_51013(api):
    from kvdoctor.diagnose.app import diagnose

    return diagnose(str(LOGS / "vllm-51013-k1-tail.log"))


@pytest.fixture(scope="module")
def synthetic_cli(api):
    """The synthetic log (production geometry) on stdin, through the command line (in this process:
    tests/cli_runner.invoke, stdout and stderr apart): JSON and exit code."""
    from .cli_runner import invoke

    return invoke("diagnose", "-", "--json", stdin=SYNTHETIC)


def test_real_log_runs_one_recipe_per_matching_bug(real_51013, api):
    expected = expected_of(api, "queued-abort")
    report = real_51013
    # K1's simplest path and K6: the assert both bugs hit, one run each, in the catalogue's order
    assert [run.recipe.name for run in report.runs] == ["queued-abort", "offload-keys-lag-blocks"]
    best = report.runs[0]
    assert best.geometry == "recipe"  # the paste has no serve arguments
    assert {r.logic: r.outcome.value for r in best.results} == {"installed": expected["installed"],
                                                                 "fixed": expected["fixed"]}
    assert int(report.exit_status) == expected["exit"]
    assert report.installed_vllm == api.version_text
    assert "RECIPE = json.loads" in report.script  # the exported standalone reproducer
    # the fixing release, from kvdoctor's matrix measurements (release_outcomes.toml), on every run
    fixes = {name: (fix.release, fix.last_reproducing) for name, fix in report.fixed_in.items()}
    assert fixes["queued-abort"] == ("0.27.0", "0.26.0") and fixes["offload-keys-lag-blocks"] == ("0.30.0", "0.29.0")


def test_markdown_attachment_of_the_real_log(real_51013):
    from kvdoctor.report.diagnose import render_diagnose_markdown

    text = render_diagnose_markdown(real_51013)
    assert "vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py:975 in _build_store_jobs()" in text
    assert "https://github.com/vllm-project/vllm/issues/49118" in text
    assert "workaround:" in text and "```python" in text
    assert "fixed in vLLM 0.27.0; last reproducing 0.26.0" in text
    assert "/usr/local" not in text and "dist-packages" not in text


def test_synthetic_log_geometry_scaled_and_versions(synthetic_cli, api):
    expected = expected_of(api, "queued-abort", async_scheduling=True)  # the log's --async-scheduling
    proc = synthetic_cli
    assert proc.returncode == expected["exit"], proc.stderr[-2000:]
    doc = json.loads(proc.stdout)
    assert any("gpu_blocks 100,000 is production-sized" in note for note in doc["geometry_scaled"])
    best = doc["runs"][0]
    assert best["recipe"] == "queued-abort" and best["geometry"] == "log"
    assert (best["setup"]["block_size"], best["setup"]["blocks_per_chunk"], best["setup"]["async_scheduling"]) \
        == (16, 4, True)
    assert best["setup"]["gpu_blocks"] == 512  # scaled down from the log's 100,000 blocks
    assert {r["logic"]: r["outcome"] for r in best["results"]} == {"installed": expected["installed"],
                                                                    "fixed": expected["fixed"]}
    assert doc["versions_differ"] is (api.version_text != "0.26.0")
    assert "sk-" not in proc.stdout and "10.1.2.3" not in proc.stdout
    assert best["fixed_in"] == "0.27.0" and best["last_reproducing"] == "0.26.0"
    assert "diagnose: running" not in proc.stderr  # progress is for a terminal; piped, it stays quiet


@pytest.mark.parametrize("name", sorted(REAL))
def test_every_real_log_runs_what_it_matches(name, api):
    """Each real log: the recipes of the bugs it matches run on the installed vLLM (installed and fixed
    logic), at the log's geometry when it names one; a log that matches nothing runs nothing."""
    from kvdoctor.diagnose.app import diagnose

    report = diagnose(str(LOGS / name))
    assert {run.recipe.bug for run in report.runs} == MATCHES[name]
    if not MATCHES[name]:
        # a crash no known bug matches exits 7 (ExitStatus.UNNAMED_CRASH); only the log without one exits 0
        assert int(report.exit_status) == (7 if report.summary.holds_crash else 0) and not report.vllm_error
        assert report.summary.holds_crash is (name != "vllm-24162-banner-args-no-crash.log")
        assert bool(report.starting_recipe) is bool(REAL[name].complete)
        return
    for run in report.runs:
        expected = expected_of(api, run.recipe.name, run.setup.async_scheduling)
        assert run.geometry == ("log" if REAL[name].overrides else "recipe")
        assert {r.logic: r.outcome.value for r in run.results}["fixed"] == expected["fixed"]
        assert run.installed.outcome.value == expected["installed"]
    # the best match (the catalogue's first bug) decides the exit status
    first = report.runs[0]
    assert int(report.exit_status) == expected_of(api, first.recipe.name, first.setup.async_scheduling)["exit"]
