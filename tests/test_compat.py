"""The compatibility checks: the lower bound, missing or broken vLLM, support decided by feature probes."""

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


@pytest.mark.parametrize("text", ["0.26.0", "0.29.3", "0.33.0", "0.33.9", "0.34.0", "0.35.0", "0.35.0.dev3+gabc",
                                  "1.0.0"])
def test_supported_releases_pass(text):
    """Newer than the newest measured release is not refused by its number: the probes decide."""
    assert compat.check_supported(text)[:2] >= (0, 26)


@pytest.mark.parametrize("text, note", [
    ("0.34.0", None), ("0.34.0rc1", None), ("0.26.0", None),
    ("0.34.1", "vLLM 0.34.1 is newer than the newest release kvdoctor was measured on (0.34.0); "
               "results are from probes that hold"),
    ("0.35.0.dev3+gabc", "vLLM 0.35.0.dev3+gabc is newer than the newest release kvdoctor was measured on "
                         "(0.34.0); results are from probes that hold"),
])
def test_newer_release_note(text, note):
    assert compat.newer_release_note(text, compat.parse_version(text)) == note


@pytest.mark.parametrize("text", ["0.25.1", "0.20.0", "nonsense"])
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


def test_older_vllm_is_refused_before_import(fresh_loader):
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
# A fact about vLLM's method signatures, not a recipe's outcome: kvdoctor/data/release_outcomes.toml
# holds no such thing, so this table stays; a release not read here skips.
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


# -- support by probes: a newer release runs with a note; a failed probe is exit 3, named ----------

def _fake_version(monkeypatch, api, text):
    """A scoped patch: the installed vLLM reports `text` (its metadata and `vllm.__version__`)."""
    monkeypatch.setattr(compat, "installed_vllm_version", lambda: text)
    monkeypatch.setattr(api.mods["vllm"], "__version__", text)
    monkeypatch.setenv(compat.NOTED_ENV, "")  # this process has not noted it yet


def test_a_newer_release_loads_with_a_one_line_note(api, fresh_loader, capsys):
    _fake_version(fresh_loader, api, "0.35.0")
    loaded = compat.load()
    assert loaded.version == (0, 35, 0)
    assert capsys.readouterr().err == ("kvdoctor: note: vLLM 0.35.0 is newer than the newest release kvdoctor was "
                                       "measured on (0.34.0); results are from probes that hold\n")
    compat._API = None  # a second load in the same process does not repeat it (nor do spawned workers)
    compat.load()
    assert capsys.readouterr().err == ""


def test_a_measured_release_loads_without_a_note(api, fresh_loader, capsys):
    fresh_loader.setenv(compat.NOTED_ENV, "")
    compat.load()
    assert capsys.readouterr().err == ""


def _break_storable_chunks(monkeypatch, api):
    """A scoped patch: vLLM's storable_chunks takes arguments the adapter does not know."""
    monkeypatch.setattr(api.RequestOffloadState, "storable_chunks", lambda self, chunk_spec: 0)


def test_a_failed_probe_is_exit_3_naming_it(api, fresh_loader):
    from kvdoctor.errors import IncompatibleVllmError

    _break_storable_chunks(fresh_loader, api)
    with pytest.raises(IncompatibleVllmError) as info:
        compat.load()
    message = str(info.value)
    assert info.value.exit_code == EXIT_VLLM_UNAVAILABLE and "\n" not in message
    assert "probe storable_chunks-signature failed" in message
    assert "['self', 'chunk_spec']" in message  # what changed


def test_every_probe_holds_on_a_measured_release(api):
    from kvdoctor.engine.compat import probes

    results = probes.run(api, worker_side=True)
    assert [r.name for r in results] == [p.name for p in probes.PROBES]
    assert [r for r in results if not r.holds] == []


def test_each_probe_can_fail(api, monkeypatch):
    """Not vacuous: each of these probes fails when what it checks is gone (scoped patches)."""
    from kvdoctor.engine.compat import probes

    scheduler = api.OffloadingConnectorScheduler
    breakers = {
        "storable_chunks-signature": lambda scope: _break_storable_chunks(scope, api),
        "store-pass": lambda scope: scope.delattr(scheduler, "_build_store_jobs"),
        "connector-state": lambda scope: scope.delattr(scheduler, "_calc_num_offloadable_tokens"),
        "worker-metadata": lambda scope: scope.delattr(api.cls("offload_common", "OffloadingWorkerMetadata"),
                                                       "mark_completed"),
    }
    for name, breaker in breakers.items():
        with monkeypatch.context() as scope:
            breaker(scope)
            (result,) = [r for r in probes.run(compat.import_vllm(), worker_side=False) if r.name == name]
            assert not result.holds, name
    assert all(r.holds for r in probes.run(compat.import_vllm(), worker_side=False))  # all restored


def _cli(*args: str):
    """The command line, in this process (its vLLM import is the session's): tests/cli_runner.invoke, stdout
    and stderr apart, as `kvdoctor ...` would print them."""
    from .cli_runner import invoke

    return invoke(*args)


@pytest.mark.parametrize("args", [("repro", "queued-abort"), ("inspect", "queued-abort", "--step", "1"),
                                  ("audit",), ("explore", "--seed", "1", "--max-examples", "5", "--no-triage"),
                                  ("version",)], ids=lambda args: args[0])
def test_cli_runs_a_newer_release_with_the_note(api, fresh_loader, tmp_path, args):
    """Each command that imports vLLM, with vLLM's reported version faked to 0.35.0 (a scoped patch):
    it runs (its own verdict, not a refusal) and says once that the release is newer than measured."""
    _fake_version(fresh_loader, api, "0.35.0")
    if args[0] == "explore":
        args = (*args, "--out", str(tmp_path))
    result = _cli(*args)
    assert result.returncode in (0, 1, 4, 6), result.stderr  # a verdict of the run, not exit 2/3/5
    assert result.stdout.strip(), result.stderr
    notes = [line for line in result.stderr.splitlines() if "newer than the newest release" in line]
    assert notes == ["kvdoctor: note: vLLM 0.35.0 is newer than the newest release kvdoctor was measured on "
                     "(0.34.0); results are from probes that hold"], result.stderr


def test_cli_exits_3_naming_a_broken_probe(api, fresh_loader):
    """The same command with vLLM's storable_chunks given an unknown signature (a scoped patch)."""
    _break_storable_chunks(fresh_loader, api)
    result = _cli("repro", "queued-abort")
    assert result.returncode == EXIT_VLLM_UNAVAILABLE, result.stderr
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert "probe storable_chunks-signature failed" in result.stderr and "chunk_spec" in result.stderr
    assert "Traceback" not in result.stderr  # and no exception escaped the command: invoke would raise it
