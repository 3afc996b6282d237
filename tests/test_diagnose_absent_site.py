"""A recipe whose crash statement is not in the installed release says so (issue 35), against the real vLLM.

A recipe written from another release's log (`diagnose --write-recipe`) quotes that release's statement; on
a release without it, coverage must not count some other statement that shares its words and report
"reached: held". Run as a user would: `kvdoctor repro FILE.toml --logic fixed` (K1's trigger held by the
PR #49146 cap, so the verdict rests on coverage alone).
"""

from __future__ import annotations

import json

import pytest

from .cli_runner import invoke
from .conftest import ROOT

QUEUED_ABORT = (ROOT / "repros" / "queued-abort.toml").read_text()
K1_CONTAINS = 'contains = "len(offload_keys) == len(offload_block_ids)"'


@pytest.fixture(scope="module")
def api():
    from kvdoctor.engine import compat

    try:
        return compat.load()
    except Exception as exc:  # no usable vLLM here: nothing to measure
        pytest.skip(f"vLLM not usable: {exc}")


def _coverage(tmp_path, contains: str) -> dict:
    assert K1_CONTAINS in QUEUED_ABORT
    recipe = tmp_path / "from-log.toml"
    recipe.write_text(QUEUED_ABORT.replace(K1_CONTAINS, f"contains = {json.dumps(contains)}"))
    proc = invoke("repro", str(recipe), "--logic", "fixed", "--worker", "simulated", "--json")
    assert proc.returncode in (0, 6), proc.stderr
    result = json.loads(proc.stdout)["results"][0]
    assert result["outcome"] != "reproduced"
    return result["coverage"]


def test_a_statement_of_another_release_is_absent_not_held(api, tmp_path):
    coverage = _coverage(tmp_path, "assert len(offload_keys) <= len(offload_block_ids) + 1")
    assert not coverage["reached"] and coverage["hits"] == 0
    assert coverage["gone"].startswith("the crash statement `assert len(offload_keys) <= len(offload_block_ids) + 1`"
                                       " is absent in this release")
    # the statement this release has instead is named, never counted as the site
    assert "`assert len(offload_keys) == len(offload_block_ids)`" in coverage["gone"]
    assert "held" not in coverage["summary"]


def test_a_fragment_of_an_assertion_counts_only_asserts(api, tmp_path):
    """`offload_keys` is in many statements of _build_store_jobs; the crash of an AssertionError is an assert
    (before: "reached 31x: held" over every statement naming it on 0.26.0)."""
    coverage = _coverage(tmp_path, "offload_keys")
    assert coverage["statement"].startswith("assert ")
    assert coverage["statement"] == "assert len(offload_keys) == len(offload_block_ids)"
    assert coverage["hits"] <= coverage["executed"] and coverage["hits"] < 5
