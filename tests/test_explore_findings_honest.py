"""Issue 27: explore reports no false findings, loses nothing it found, and states each finding's impact.

- The two false positives explore reported, as shrunk recipes under tests/data: each runs through
  with its invariant quiet on the installed release; K11's own recipe still reproduces for its own
  reason (re-admission after a preemption) where the release has K11.
- A known bug labels a finding only when the finding took the bug's path.
- A run killed after its first finding (as `timeout` kills it) leaves that finding's recipe on disk,
  and `--time-budget` bounds the run from vLLM's import on: search, shrinking and triage.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvdoctor import app as application
from kvdoctor.engine.overrides import Overrides
from kvdoctor.explore.findings import known_bug
from kvdoctor.explore.impact import CALL_FAILS, ENGINE_DIES, LOST_HITS, WRONG_KV, impact_of
from kvdoctor.observe.verdict import Outcome
from kvdoctor.recipes.model import Signature

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
FALSE_POSITIVES = ("full-prompt-hit-not-readmitted.toml", "final-store-flushed-before-forward.toml")


@pytest.mark.parametrize("name", FALSE_POSITIVES)
def test_former_false_positive_runs_through_with_its_invariant_quiet(api, name):
    report = application.repro(str(DATA / name), Overrides(), "installed")
    result = report.results[0]
    assert result.outcome is Outcome.NOT_REPRODUCED, f"{result.outcome.value}: {result.detail}"
    assert not result.violations


def test_k11_still_reproduces_for_its_own_reason(api):
    report = application.repro("readmitted-stale-store-cursor", Overrides(), "installed")
    result = report.results[0]
    if result.outcome is Outcome.NOT_REPRODUCED:
        pytest.skip("this release offers a re-admitted request's chunks again (K11 fixed here)")
    assert result.outcome is Outcome.REPRODUCED, f"{result.outcome.value}: {result.detail}"
    assert "re-admitted after a preemption" in result.detail, result.detail


def test_a_known_bug_labels_only_a_finding_on_its_path():
    k11 = Signature(invariant="readmitted-chunks-offered-again")
    assert known_bug(k11, detail="B (group 0): its store cursor is at chunk 2 but it runs from 1 computed tokens") \
        is None
    assert known_bug(k11, detail="B (group 0), re-admitted after a preemption: its store cursor ...")[0] == "K11"
    k9 = Signature(invariant="reused-blocks-are-flushed")
    assert known_bug(k9, setup={"block_size": 16}, detail="store job #3 still reads block(s) [2]") is None
    assert known_bug(k9, setup={"multi_connector": True}, detail="store job #3 still reads block(s) [2]")[0] == "K9"
    k5 = Signature(invariant="final-store-covers-computed-chunks")
    assert known_bug(k5, setup={}, detail="A (group 0, FINISHED_STOPPED): ...") is None
    assert known_bug(k5, setup={"layout": "eagle-pair"}, detail="A (group 1, FINISHED_STOPPED): ...")[0] == "K5"


def test_impact_follows_where_the_engine_core_meets_the_failure():
    assert impact_of("exception", None, "schedule").kind == ENGINE_DIES
    assert impact_of("exception", None, "abort").kind == ENGINE_DIES
    assert impact_of("exception", None, "reset_prefix_cache").kind == CALL_FAILS
    assert impact_of("invariant", "store-copies-computed-kv", None).kind == WRONG_KV
    assert impact_of("invariant", "readmitted-chunks-offered-again", None).kind == LOST_HITS


def _explore(out: Path, budget: float, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "kvdoctor", "explore", "--seed", "1", "--time-budget", str(budget),
                             "--out", str(out), *extra], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_a_run_killed_after_its_first_finding_keeps_its_recipe(api, tmp_path):
    """`timeout` sends SIGTERM: the first finding's recipe must already be on disk when it is announced."""
    out = tmp_path / "findings"
    process = _explore(out, 600)
    try:
        line = ""
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline:
            line = process.stderr.readline()
            if not line or line.startswith("kvdoctor explore: found"):
                break
        assert line.startswith("kvdoctor explore: found"), f"no finding announced: {line!r}"
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode != 0  # killed, not finished
    recipes = sorted(out.glob("*.toml"))
    assert recipes, f"nothing left in {out}"
    from kvdoctor.recipes.loader import load_recipe_file

    for recipe in recipes:
        assert "Impact: " in load_recipe_file(recipe).summary, recipe.read_text()


def test_the_time_budget_bounds_the_whole_run(api, tmp_path):
    # The budget's clock starts once vLLM is imported (app.explore): search, shrinking (SHRINK_GRACE_S past the
    # deadline at most, for a round already shrinking) and triage (one begun before the end) run on it.
    from kvdoctor.explore.search import SHRINK_GRACE_S

    budget = 40.0
    started = time.monotonic()
    process = _explore(tmp_path / "findings", budget, "--json")
    try:
        stdout, stderr = process.communicate(timeout=budget + SHRINK_GRACE_S + 180)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    wall = time.monotonic() - started
    assert process.returncode in (0, 1), stderr[-2000:]
    document = json.loads(stdout)
    assert document["examples"] > 0
    # A triage begun before the end is the few seconds past it (measured: under 10 s, CI's loaded machine too).
    assert document["wall_s"] <= budget + SHRINK_GRACE_S + 15, f"{document['wall_s']:.1f} s for a {budget:g} s budget"
    # The rest of the process is the interpreter and vLLM's import and warm-up, which the machine's load decides
    # (measured: 15-20 s idle, 105 s beside five other vLLM processes on 2 cores): not asserted, only shown.
    print(f"explore: {document['wall_s']:.1f} s on the budget's clock, {wall:.1f} s in all")
