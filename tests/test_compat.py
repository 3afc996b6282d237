"""The compatibility checks: supported range, missing or broken vLLM, per-release probes."""

from __future__ import annotations

import pytest

from kvdoctor.engine import compat
from kvdoctor.errors import EXIT_VLLM_UNAVAILABLE, VllmUnavailableError


@pytest.mark.parametrize("text, expected", [
    ("0.26.0", (0, 26, 0)), ("0.33.1", (0, 33, 1)), ("0.27.0rc1", (0, 27, 0)),
    ("0.30.1.dev12+gabcdef", (0, 30, 1)), ("1.0", (1, 0, 0)), ("garbage", None),
])
def test_parse_version(text, expected):
    assert compat.parse_version(text) == expected


@pytest.mark.parametrize("text", ["0.26.0", "0.29.3", "0.33.0", "0.33.9", "0.34.0"])
def test_supported_releases_pass(text):
    assert compat.check_supported(text)[:2] >= (0, 26)


@pytest.mark.parametrize("text", ["0.25.1", "0.35.0", "1.0.0", "nonsense"])
def test_unsupported_releases_are_exit_3(text):
    with pytest.raises(VllmUnavailableError) as info:
        compat.check_supported(text)
    assert info.value.exit_code == EXIT_VLLM_UNAVAILABLE
    assert "\n" not in str(info.value)


@pytest.fixture
def fresh_loader(monkeypatch):
    monkeypatch.setattr(compat, "_API", None)
    return monkeypatch


def test_missing_vllm_is_one_line_exit_3(fresh_loader):
    fresh_loader.setattr(compat, "installed_vllm_version", lambda: None)
    with pytest.raises(VllmUnavailableError, match="not installed"):
        compat.load()


def test_out_of_range_vllm_is_refused_before_import(fresh_loader):
    fresh_loader.setattr(compat, "installed_vllm_version", lambda: "0.20.0")
    with pytest.raises(VllmUnavailableError, match="outside kvdoctor's supported range"):
        compat.load()


def test_broken_import_names_the_module(fresh_loader):
    fresh_loader.setitem(compat._MODULES, "broken", "kvdoctor_test_no_such_module.sub")
    with pytest.raises(VllmUnavailableError) as info:
        compat.load()
    assert "importing kvdoctor_test_no_such_module.sub failed" in str(info.value)
    assert "\n" not in str(info.value)


def test_cli_reports_missing_vllm_as_exit_3(tmp_path):
    """A Python without vLLM: kvdoctor on the path, vllm hidden by a shadow package that fails."""
    import os
    import subprocess
    import sys

    from .conftest import ROOT

    code = ("import sys; import kvdoctor.engine.compat as c; c.installed_vllm_version = lambda: None; "
            "from kvdoctor.cli.app import main; sys.argv = ['kvdoctor', 'repro', 'queued-abort']; main()")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ})
    assert proc.returncode == 3
    assert proc.stderr.strip().count("\n") == 0 and "not installed" in proc.stderr


# What the feature probes answer, read off each release's code (measured, not derived from the number).
PROBES = {
    (0, 26): {"params": ("group_config", "num_offloadable_tokens"), "aborted_basis": False},
    (0, 33): {"params": ("group_config", "group_state", "num_offloadable_tokens"), "aborted_basis": True},
}
PROBES[(0, 34)] = {"params": ("group_config", "group_state", "num_offloadable_tokens", "apply_eagle_drop"),
                   "aborted_basis": True}  # read off vLLM 0.34.0's code (2026-12-02)
PROBES[(0, 30)] = PROBES[(0, 33)]  # read off vLLM 0.30.0's code (2026-12-03): the same as 0.33.0


def test_release_probes(api, release):
    from .conftest import expected_for

    want = expected_for(api, release, PROBES)
    assert api.storable_chunks_params == want["params"]
    assert api.storable_chunks_takes_group_state is ("group_state" in want["params"])
    assert api.aborted_store_counts_computed_tokens is want["aborted_basis"]


def test_a_failed_job_is_not_also_a_completed_one(api):
    """vLLM's own worker metadata: on a release with a failure path (0.34: mark_completed(success=False)
    puts the job in completed_jobs and failed_jobs) kvdoctor reads it as failed only; before, the worker
    cannot fail a job and kvdoctor reports it completed (its failed load goes to invalid_block_ids)."""
    meta = api.worker_metadata(completed=[1], failed=[2])
    output = api.kv_connector_output(meta, set(), set(), set())
    if api.worker_reports_failed_jobs:
        assert (api.completed_job_ids(output), api.failed_job_ids(output)) == ([1], [2])
    else:
        assert (api.completed_job_ids(output), api.failed_job_ids(output)) == ([1, 2], [])
