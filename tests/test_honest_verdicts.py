"""Issue 8: no exit code, outcome or blame that the run did not earn.

Internal errors are injected at each layer (a scenario step, the snapshot, the
guard explanation, the report writer, kvdoctor's patched `storable_chunks`) and
must end as kvdoctor's own failure: exit 5, one line on stderr naming kvdoctor,
no traceback, and with `--json` a parsable error document on stdout.
"""

from __future__ import annotations

import json
import time

import pytest

from kvdoctor import SCHEMA_VERSION, app
from kvdoctor.engine.overrides import Overrides
from kvdoctor.errors import ExitStatus, UsageError
from kvdoctor.observe.verdict import Outcome

from .cli_runner import invoke as invoke_cli
from .conftest import ROOT, run_cli


class Boom(Exception):
    """An error raised by kvdoctor's own code (injected)."""


def _boom(*_args, **_kwargs):
    raise Boom("injected kvdoctor bug")


def invoke(*args: str):
    return invoke_cli(*args)


def assert_internal_error(result, json_out: bool = False) -> None:
    assert result.returncode == ExitStatus.INTERNAL_ERROR == 5, (result.returncode, result.stdout + result.stderr)
    err = result.stderr
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("kvdoctor: error: internal error:") and "bug in kvdoctor" in lines[0]
    assert "Traceback" not in result.stdout + err
    assert "reproduced" not in result.stdout.replace("not_reproduced", "")
    if json_out:
        doc = json.loads(result.stdout)
        assert doc["schema_version"] == SCHEMA_VERSION
        assert doc["error"]["kind"] == "internal_error" and doc["error"]["exit_code"] == 5


@pytest.fixture
def loaded(api):
    return api


@pytest.mark.parametrize("json_out", [False, True], ids=["tables", "json"])
def test_error_in_a_scenario_step_is_kvdoctors(loaded, monkeypatch, json_out):
    monkeypatch.setattr("kvdoctor.scenario.apply_to_harness", _boom)
    args = ["repro", "queued-abort", "--logic", "installed"] + (["--json"] if json_out else [])
    assert_internal_error(invoke(*args), json_out)


def test_error_in_the_snapshot_is_kvdoctors(loaded, monkeypatch):
    monkeypatch.setattr("kvdoctor.observe.snapshot.Observer.snapshot", _boom)
    assert_internal_error(invoke("repro", "queued-abort", "--logic", "fixed", "--json"), json_out=True)


def test_error_in_the_guard_explanation_is_kvdoctors(loaded, monkeypatch):
    monkeypatch.setattr("kvdoctor.scenario.explain_guards", _boom)
    assert_internal_error(invoke("repro", "queued-abort", "--logic", "fixed"))


def test_error_in_the_report_writer_is_kvdoctors(loaded, monkeypatch, tmp_path):
    monkeypatch.setattr("kvdoctor.report.markdown.render_markdown", _boom)
    assert_internal_error(invoke("repro", "queued-abort", "--logic", "fixed", "--report",
                                 str(tmp_path / "r.md")))


def test_error_inside_the_patched_storable_chunks_is_not_a_vllm_failure(loaded, monkeypatch):
    """vLLM calls kvdoctor's variant from `_build_store_jobs`: an error raised there is kvdoctor's."""
    monkeypatch.setattr("kvdoctor.logic.patch.evaluate", _boom)
    result = invoke("repro", "queued-abort", "--logic", "fixed")
    assert_internal_error(result)
    assert "storable_chunks" in result.stderr or "patch.py" in result.stderr or "Boom" in result.stderr


def test_recording_error_under_installed_logic_leaves_vllms_call_untouched(loaded, monkeypatch):
    """Under `installed`, a failure of kvdoctor's recording is never raised into vLLM's call."""
    from kvdoctor.logic import patch

    calls = []

    def failing_record(*args, **kwargs):
        calls.append(args)
        raise Boom("recording broke")

    monkeypatch.setattr(patch, "record_call", failing_record)
    result = invoke("repro", "queued-abort", "--logic", "installed")
    assert calls, "the recipe calls storable_chunks"
    assert_internal_error(result)
    assert "recording a storable_chunks call failed" in result.stderr


def test_installed_variant_returns_vllms_own_result(api):
    """The wrapper under `installed` returns exactly what vLLM's method returned, for every call."""
    from kvdoctor.logic.patch import CallLog, storable_chunks_variant

    cls = api.RequestOffloadState
    original = cls.storable_chunks
    seen = []

    def spy(self, *args, **kwargs):
        value = original(self, *args, **kwargs)
        seen.append(value)
        return value

    cls.storable_chunks = spy
    try:
        from kvdoctor.levels.scheduler import run_scenario
        from kvdoctor.recipes.builtins import resolve

        recipe = resolve("preemption")
        result = run_scenario(api, recipe, app.resolve_setup(recipe), "installed")
    finally:
        cls.storable_chunks = original
    assert seen, "vLLM called storable_chunks"
    assert result.outcome in (Outcome.REPRODUCED, Outcome.NOT_REPRODUCED)
    log = CallLog()
    assert cls.storable_chunks is original
    with storable_chunks_variant(api, "installed", log):
        assert cls.storable_chunks.__wrapped__ is original
    assert cls.storable_chunks is original


def test_audit_exits_4_when_a_row_ends_other_failure(api, monkeypatch):
    """A recipe whose signature does not match what vLLM raised is other_failure: audit exits 4, not 0."""
    from kvdoctor.recipes import builtins
    from kvdoctor.recipes.loader import load_recipe_text as load_text

    text = (ROOT / "tests" / "data" / "unexpected-vllm-exception.toml").read_text()
    odd = load_text(text, "unexpected-vllm-exception.toml")
    monkeypatch.setattr(builtins, "all_builtins", lambda: [odd])
    monkeypatch.setattr("kvdoctor.observe.metrics.measure_prefix_sharing", lambda api: _measured())
    report = app.audit()
    (row,) = report.rows
    assert row.installed.outcome is Outcome.OTHER_FAILURE, row.installed.detail
    assert row.installed.failure is not None and row.installed.failure.in_vllm
    assert report.exit_status == ExitStatus.SETUP_OR_OTHER_FAILURE
    result = invoke("audit", "--json")
    assert result.returncode == 4, result.stdout + result.stderr
    assert json.loads(result.stdout)["exit_code"] == 4


def test_audit_exits_4_on_setup_error_and_1_when_any_reproduces(api, monkeypatch, tmp_path):
    from kvdoctor.recipes import builtins
    from kvdoctor.recipes.loader import load_recipe_text as load_text

    text = (ROOT / "repros" / "queued-abort.toml").read_text()
    not_queued = load_text(text.replace("fill_pool = true", "prompt_chunks = 1", 1), "not-queued.toml")
    real = builtins.resolve("queued-abort")
    monkeypatch.setattr("kvdoctor.observe.metrics.measure_prefix_sharing", lambda api: _measured())
    monkeypatch.setattr(builtins, "all_builtins", lambda: [not_queued])
    report = app.audit()
    assert report.rows[0].installed.outcome is Outcome.SETUP_ERROR
    assert report.exit_status == 4
    monkeypatch.setattr(builtins, "all_builtins", lambda: [not_queued, real])
    report = app.audit()
    real_outcome = next(r for r in report.rows if r.recipe is real).installed.outcome
    assert report.exit_status == (1 if real_outcome is Outcome.REPRODUCED else 4)


def _measured():
    from kvdoctor.observe.metrics import PrefixSharingMetric

    return PrefixSharingMetric(requests=2, load_latency_steps=1, shared_steps=3, baseline_steps=3)


def test_a_failure_by_another_request_is_not_the_bug(api, tmp_path):
    """The signature names the request the failure must involve: the same assertion for another
    request is other_failure, explained."""
    normal = app.repro("queued-abort", Overrides(), "installed").results[0]
    if normal.outcome is not Outcome.REPRODUCED:
        pytest.skip(f"the installed logic does not fail on vLLM {api.version_text} (outcome {normal.outcome.value})")
    assert normal.failure.involved_request == "B"
    text = (ROOT / "repros" / "queued-abort.toml").read_text()
    recipe = tmp_path / "wrong-request.toml"
    recipe.write_text(text.replace('request = "B"  # the aborted request', 'request = "A"  # wrong on purpose', 1))
    (result,) = app.repro(str(recipe), Overrides(), "installed").results
    assert result.outcome is Outcome.OTHER_FAILURE
    assert "fired for request B" in result.detail and "must involve request A" in result.detail


def test_kv_transfer_config_keys_take_effect_or_are_refused(api):
    """Every key --kv-transfer-config accepts changes the KVTransferConfig vLLM builds, or is refused."""
    from kvdoctor.engine.harness import Harness
    from kvdoctor.engine.serve_args import PASSED_THROUGH_KV_TRANSFER_KEYS, parse_kv_transfer_config
    from kvdoctor.engine.setup import Setup

    values = {"kv_role": "kv_both", "kv_load_failure_policy": "fail", "kv_buffer_device": "cpu",
              "kv_buffer_size": 12345.0, "engine_id": "kvdoctor-engine-under-test"}
    assert set(values) == set(PASSED_THROUGH_KV_TRANSFER_KEYS)
    taken = refused = 0
    for key, value in values.items():
        overrides = parse_kv_transfer_config(json.dumps({"kv_connector": "OffloadingConnector", key: value}))
        setup = Setup().with_overrides(**overrides.given())
        assert setup.kv_transfer_fields == {key: value}
        try:
            harness = Harness(api, setup)
        except UsageError as exc:
            assert key in str(exc)
            refused += 1
            continue
        try:
            assert getattr(harness.scheduler.vllm_config.kv_transfer_config, key) == value
            taken += 1
        finally:
            harness.shutdown()
    assert taken >= 3, "kv_role, kv_buffer_* and engine_id exist on every release in range"
    with pytest.raises(UsageError, match="kv_connector_module_path"):
        parse_kv_transfer_config('{"kv_connector_module_path": "my.module"}')


def test_unwritable_output_path_is_refused_before_vllm_is_imported():
    start = time.monotonic()
    proc = run_cli("repro", "queued-abort", "--svg", "/nonexistent-dir/x.svg", timeout=60)
    elapsed = time.monotonic() - start
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "/nonexistent-dir" in proc.stderr
    assert elapsed < 5, f"{elapsed:.1f} s: vLLM was imported before the path was checked"
    proc = run_cli("repro", "queued-abort", "--report", "/proc/kvdoctor-report.md", timeout=60)
    assert proc.returncode == 2 and "not writable" in proc.stderr, proc.stderr
    proc = invoke("explore", "--out", "/proc/kvdoctor-findings")
    assert proc.returncode == 2 and "--out" in proc.stderr, proc.stderr


def test_usage_error_with_json_writes_an_error_document():
    proc = invoke("repro", "no-such-recipe", "--json")
    assert proc.returncode == 2
    doc = json.loads(proc.stdout)
    assert doc["error"]["exit_code"] == 2 and doc["error"]["kind"] in ("usage_error", "recipe_error")
    assert "no-such-recipe" in doc["error"]["message"]


def test_debug_shows_the_traceback(loaded, monkeypatch):
    monkeypatch.setattr("kvdoctor.scenario.explain_guards", _boom)
    monkeypatch.setenv("KVDOCTOR_DEBUG", "1")
    result = invoke("repro", "queued-abort", "--logic", "fixed")
    assert result.returncode == 5
    assert "Traceback" in result.stderr and "Boom" in result.stderr


def test_exit_statuses_are_documented_once():
    from kvdoctor.cli.app import EXIT_CODES_HELP

    readme = (ROOT / "README.md").read_text()
    for status in ExitStatus:
        if status is ExitStatus.INTERRUPTED:  # Ctrl-C: not a verdict, not listed
            continue
        assert f"{int(status)} {status.meaning}" in EXIT_CODES_HELP
        assert f"| {int(status)} |" in readme
    assert len({int(s) for s in ExitStatus}) == len(ExitStatus)
    assert ExitStatus.INTERNAL_ERROR != ExitStatus.REPRODUCED


def test_a_check_that_does_not_hold_is_other_failure(api, tmp_path):
    """A run that survives but breaks a post-condition is not `not_reproduced`."""
    text = (ROOT / "repros" / "queued-abort.toml").read_text()
    recipe = tmp_path / "impossible-check.toml"
    recipe.write_text(text.replace("store_jobs_built = 0", "store_jobs_built = 5", 1))
    (result,) = app.repro(str(recipe), Overrides(), "fixed").results
    assert result.outcome is Outcome.OTHER_FAILURE
    assert result.detail.startswith("check failed: no store job was built")


def test_guard_explanations_name_only_what_bound():
    from kvdoctor.logic.patch import StorableCall
    from kvdoctor.report.guards import guard_line
    from kvdoctor.scenario import explain_guards

    def call(**kw):
        base = dict(req_id="B", group_idx=0, num_offloadable_tokens=0, token_chunks=0, allocated_chunks=0,
                    keyed_chunks=4, installed=0, fixed=0, unpatched=0, returned=0,
                    request_status="FINISHED_ABORTED", tokens_per_chunk=4, next_stored_chunk=0,
                    computed_tokens=0, full_token_chunks=4, keys_uncapped=0)
        base.update(kw)
        return StorableCall(**base)

    def explained(**kw):
        """The one guard record these calls give, and its wording (report.guards)."""
        (guard,) = explain_guards([call(**kw)])
        return guard, guard_line(guard)

    guard, aborted = explained()
    assert "PR #49285" in aborted and guard.aborted_counts_computed
    # The same numbers for a request that finished normally: the basis rule is not #49285's.
    guard, stopped = explained(request_status="FINISHED_STOPPED", computed_tokens=16)
    assert "PR #49285" not in stopped and "cannot name" in stopped and not guard.aborted_counts_computed
    # Held to the allocated chunks, but removing the cap would not raise it: no cap is named.
    guard, unknown = explained(num_offloadable_tokens=16, token_chunks=4, installed=0, unpatched=0,
                               computed_tokens=16, request_status="FINISHED_STOPPED")
    assert "cannot name" in unknown and "PR #49146" not in unknown and guard.cap is None
    guard, capped = explained(num_offloadable_tokens=16, token_chunks=4, installed=0, unpatched=4,
                              computed_tokens=16, request_status="FINISHED_STOPPED")
    assert "this release's allocated-chunk cap (PR #49146)" in capped and guard.cap == "allocated_chunks"
    guard, ours = explained(num_offloadable_tokens=16, token_chunks=4, installed=4, unpatched=4,
                            computed_tokens=16, request_status="FINISHED_STOPPED")
    assert "kvdoctor's fixed logic" in ours and guard.cap == "fixed_logic"
