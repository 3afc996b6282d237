"""`kvdoctor version`: versions and which adapter probes hold, for a bug report; exit 3 when one fails."""

from __future__ import annotations

import json

import pytest

from kvdoctor.engine import compat
from kvdoctor.engine.compat import probes
from kvdoctor.errors import EXIT_VLLM_UNAVAILABLE

from .cli_runner import invoke


@pytest.fixture
def fresh_loader(monkeypatch):
    monkeypatch.setattr(compat, "_API", None)
    return monkeypatch


def test_report_on_the_installed_release(api):
    from kvdoctor.report.version import version_text
    from kvdoctor.version_report import version_report

    report = version_report()
    assert report.vllm == api.version_text and report.torch and report.python and report.problem is None
    assert [p.name for p in report.probes] == [p.name for p in probes.PROBES]
    assert report.all_probes_hold and report.exit_code == 0
    text = version_text(report)
    assert f"vLLM: {api.version_text}" in text
    assert f"probes: {len(probes.PROBES)} of {len(probes.PROBES)} hold" in text
    assert "FAILS" not in text


def test_a_failed_probe_is_listed_and_exit_3(api, fresh_loader):
    """vLLM's storable_chunks given an unknown signature (a scoped patch): every probe is still answered."""
    from kvdoctor.report.version import version_text
    from kvdoctor.version_report import version_report

    fresh_loader.setattr(api.RequestOffloadState, "storable_chunks", lambda self, chunk_spec: 0)
    report = version_report()
    assert report.exit_code == EXIT_VLLM_UNAVAILABLE
    failed = [p for p in report.probes if not p.holds]
    assert [p.name for p in failed] == ["storable_chunks-signature"]
    assert "chunk_spec" in failed[0].answer
    assert len(report.probes) == len(probes.PROBES)
    assert "storable_chunks-signature  FAILS" in version_text(report)


def test_missing_vllm_is_reported_and_exit_3(fresh_loader):
    from kvdoctor.version_report import version_report

    fresh_loader.setattr(compat, "installed_vllm_version", lambda: None)
    report = version_report()
    assert report.vllm is None and "not installed" in report.problem
    assert report.probes == [] and report.exit_code == EXIT_VLLM_UNAVAILABLE
    assert report.as_dict()["all_probes_hold"] is False


def test_cli_version_json(api):
    proc = invoke("version", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["vllm"] == api.version_text and doc["kvdoctor"] and doc["torch"] and doc["python"]
    assert doc["all_probes_hold"] is True and doc["exit_code"] == 0
    assert [p["name"] for p in doc["probes"]] == [p.name for p in probes.PROBES]
    assert all(p["holds"] and p["answer"] for p in doc["probes"])


def test_dash_dash_version_stays_instant():
    """`--version` prints kvdoctor's version only (no vLLM versions, no probes)."""
    proc = invoke("--version", timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip().startswith("kvdoctor ")
    assert "vLLM" not in proc.stdout


def test_help_generates_its_exit_codes():
    from kvdoctor.errors import ExitStatus

    proc = invoke("version", "--help", env={"COLUMNS": "100"}, timeout=60)
    assert proc.returncode == 0, proc.stderr
    flat = " ".join(proc.stdout.split())
    assert "0 vLLM imports and every probe holds" in flat
    assert f"{int(ExitStatus.VLLM_UNAVAILABLE)} vLLM missing, broken on import or too old, or a probe fails" in flat
    assert "kvdoctor version --json" in proc.stdout
