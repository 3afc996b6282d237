"""`kvdoctor matrix` end to end on two real releases (0.26.0 still has K1, 0.27.0 has PR #49146).

The environments come from `--env-dir` (KVDOCTOR_MATRIX_ENV_DIR, default: this checkout,
whose `.venv` / `.venv-vllm-0.27` .ci/run syncs first); a release missing there is built
once into kvdoctor's cache (~/.cache/kvdoctor/envs, a few minutes) and reused after.
"""

from __future__ import annotations

import json
import os

import pytest

from kvdoctor.errors import ExitStatus
from tests.conftest import ROOT, run_cli

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def bisected(tmp_path_factory):
    report = tmp_path_factory.mktemp("matrix") / "matrix.md"
    env_dir = os.environ.get("KVDOCTOR_MATRIX_ENV_DIR", str(ROOT))
    proc = run_cli("matrix", "queued-abort", "--vllm", "0.26.0,0.27.0", "--bisect", "--json",
                   "--report", str(report), "--env-dir", env_dir, timeout=3600)
    return proc, report


def test_bisect_names_0_27_0_as_the_first_release_where_queued_abort_stops(bisected):
    proc, _ = bisected
    assert proc.returncode == ExitStatus.REPRODUCED, proc.stderr[-2000:]  # it reproduces on 0.26.0
    doc = json.loads(proc.stdout)
    (bisection,) = doc["bisections"]
    assert (bisection["first_not_reproducing"], bisection["last_reproducing"]) == ("0.27.0", "0.26.0")
    cells = {c["release"]: c for c in doc["cells"]}
    assert cells["0.26.0"]["outcome"] == "reproduced"
    assert "AssertionError at vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py" \
        in cells["0.26.0"]["failure_site"]
    assert "_build_store_jobs" in cells["0.26.0"]["failure_site"]
    assert cells["0.27.0"]["outcome"] == "not_reproduced"
    assert {c["vllm_version"] for c in cells.values()} == {"0.26.0", "0.27.0"}


def test_report_is_the_same_table_in_markdown(bisected):
    _, report = bisected
    text = report.read_text()
    assert "| 0.26.0 | reproduced: AssertionError at" in text
    assert "| 0.27.0 | not_reproduced |" in text
    assert "queued-abort: stops reproducing in vLLM 0.27.0 (last reproducing: 0.26.0" in text
