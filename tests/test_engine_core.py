"""`--engine core`: recipes through vLLM's real EngineCore (kvdoctor/engine/core).

The verdict on the installed release is compared with kvdoctor's own measurements at the
scheduler level (kvdoctor/data/release_outcomes.toml): the engine must reach the same outcome
at the same failure site. A release the file has no row for skips.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvdoctor.engine.overrides import Overrides
from kvdoctor.matrix import data
from kvdoctor.matrix.runner import failure_site
from tests.cli_runner import invoke
from tests.conftest import run_cli

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def core_doc(api) -> dict:
    """In this process (tests/cli_runner.invoke): the engine level is under test, not the CLI's process
    (test_engine_levels plays whole audits at --engine core in-process too)."""
    proc = invoke("repro", "queued-abort", "--engine", "core", "--logic", "installed", "--json")
    if proc.returncode == 3:
        pytest.skip(f"no usable vLLM here: {proc.stderr.strip()}")
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.mark.vllm
def test_queued_abort_core_matches_the_measured_release_outcome(core_doc: dict) -> None:
    release = core_doc["vllm_version"]
    rows = [r for r in data.load() if r.release == release and r.recipe == "queued-abort"]
    if not rows:
        pytest.skip(f"kvdoctor/data/release_outcomes.toml has no queued-abort row for vLLM {release}")
    row = rows[0]
    result = core_doc["results"][0]
    assert result["logic"] == "installed"
    assert result["outcome"] == row.outcome, result.get("detail")
    if row.outcome == "reproduced":
        assert failure_site(result.get("failure"), result.get("violations")) == row.failure_site
        assert result["failure"]["function"] == "_build_store_jobs"
        # the engine's own step called the scheduler: EngineCore's frame is in the traceback
        assert any(f["file"].endswith("v1/engine/core.py") for f in result["failure"]["vllm_frames"])


@pytest.mark.vllm
def test_async_scheduling_goes_through_the_batch_queue(api) -> None:
    """Under async scheduling the engine's `step_with_batch_queue` calls the scheduler (one batch in flight)."""
    proc = invoke("repro", "queued-abort", "--engine", "core", "--async-scheduling", "--logic", "installed",
                  "--json")
    if proc.returncode == 3:
        pytest.skip(f"no usable vLLM here: {proc.stderr.strip()}")
    doc = json.loads(proc.stdout)
    rows = [r for r in data.load() if r.release == doc["vllm_version"] and r.recipe == "queued-abort"]
    if not rows:
        pytest.skip(f"kvdoctor/data/release_outcomes.toml has no queued-abort row for vLLM {doc['vllm_version']}")
    result = doc["results"][0]
    assert "EngineCore.step_with_batch_queue" in result["worker"]
    assert result["outcome"] == rows[0].outcome, result.get("detail")
    if rows[0].outcome == "reproduced":
        assert result["failure"]["vllm_frames"][0]["function"] == "step_with_batch_queue"


@pytest.mark.vllm
def test_reports_name_the_engine_level(core_doc: dict) -> None:
    assert core_doc["setup"]["engine"] == "core"
    assert "EngineCore" in core_doc["results"][0]["worker"]


def test_unknown_engine_level_is_a_usage_error_before_vllm() -> None:
    proc = run_cli("repro", "queued-abort", "--engine", "gpu", timeout=60)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--engine must be one of scheduler|core|serve" in lines[0], proc.stderr


def test_a_step_the_engine_cannot_play_makes_the_recipe_not_applicable_naming_it() -> None:
    from kvdoctor.levels.core import run_core_scenario
    from kvdoctor.recipes.builtins import resolve
    from kvdoctor.resolution import resolve_setup

    recipe = resolve("offload-keys-lag-blocks")
    setup = resolve_setup(recipe, Overrides(worker="simulated", engine="core"))
    result = run_core_scenario(None, recipe, setup, "installed")  # decided before vLLM builds anything
    assert result.outcome.value == "not_applicable"
    assert "`delay_block_hashes`" in result.detail and "EngineCore" in result.detail


def test_drain_is_playable_at_core_only_under_sync_scheduling() -> None:
    from kvdoctor.levels.table import why_not

    assert why_not("drain", "core", async_scheduling=False) is None
    assert "batch" in why_not("drain", "core", async_scheduling=True)
    assert why_not("delay_block_hashes", "scheduler") is None


def test_platform_plugin_declines_unless_kvdoctor_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvdoctor.engine.core import platform

    monkeypatch.delenv(platform.ENV, raising=False)
    assert platform.register() is None
    monkeypatch.setenv(platform.ENV, "1")
    assert platform.register() == "kvdoctor.engine.core.cpu_platform.KvdoctorCpuPlatform"


def test_pyproject_registers_the_platform_plugin() -> None:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["vllm.platform_plugins"] == {
        "kvdoctor_cpu": "kvdoctor.engine.core.platform:register"}


def test_docs_table_is_generated_from_the_code() -> None:
    from kvdoctor.levels.table import markdown_table

    assert markdown_table() in (ROOT / "docs" / "engine-levels.md").read_text()
