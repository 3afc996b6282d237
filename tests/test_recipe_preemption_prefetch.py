"""The built-in K1 recipes `preemption` and `prefetch`, run on the installed vLLM.

Every scenario runs once per module (one vLLM import, twelve runs: two recipes,
two scheduling modes, three logic variants). The expected outcome per release
is kvdoctor's measurement in kvdoctor/data/release_outcomes.toml; a release or
dimension not measured there skips.
"""

from __future__ import annotations

import pytest

from kvdoctor import app
from kvdoctor.engine.overrides import Overrides
from kvdoctor.observe.verdict import Outcome
from kvdoctor.recipes.builtins import builtin_names, load_builtin
from kvdoctor.report.guards import guard_lines

from .recipe_runs import bug_present, measured

pytestmark = pytest.mark.vllm

RECIPES = ("preemption", "prefetch")
MODES = (False, True)
LOGICS = ("installed", "fixed", "unpatched")

R = Outcome.REPRODUCED
N = Outcome.NOT_REPRODUCED

# What the data file holds (measured 2026-12-02..04): on 0.26.0, no allocated-chunk cap, and an aborted
# request's final store counts all its tokens: both paths crash; the PR #49146 cap (fixed) prevents it.
# From 0.27.0 neither reproduces; on 0.30.0, 0.33.0 and 0.34.0 (measured by this module) both fixes are
# in, and with the cap removed (unpatched) an aborted request still counts only its computed tokens
# (PR #49285): 0 after preemption, the hit after a load.


@pytest.fixture(scope="module")
def reports(api):
    """Each recipe under each scheduling mode, all logic variants, timelines recorded."""
    return {
        (name, mode): app.repro(name, Overrides(async_scheduling=mode), "all", record_timeline=True)
        for name in RECIPES
        for mode in MODES
    }


def result(reports, name, mode, logic):
    return next(r for r in reports[(name, mode)].results if r.logic == logic)


def abort_index(run, request="B"):
    """Position in the timeline of the abort step of `request`."""
    for i, entry in enumerate(run.timeline):
        if entry.action == "abort" and entry.description == f"abort request={request}":
            return i
    raise AssertionError(f"no abort of {request} in the timeline")


def status_of(entry, request):
    return next((s.status for s in entry.requests if s.request == request), None)


# -- the recipes themselves --------------------------------------------------

@pytest.mark.parametrize("name", RECIPES)
def test_recipe_is_a_builtin_k1_recipe(name):
    assert name in builtin_names()
    recipe = load_builtin(name)
    assert recipe.name == name and recipe.bug == "K1"
    assert recipe.title and recipe.summary
    assert any("49118" in ref for ref in recipe.refs)
    assert any("49146" in ref for ref in recipe.refs)
    assert any("49285" in ref for ref in recipe.refs)
    assert recipe.signature.exception == "AssertionError"
    assert recipe.signature.function == "_build_store_jobs"
    assert recipe.signature.contains == "len(offload_keys) == len(offload_block_ids)"
    assert any(c.args.get("connector_state") == "released" for c in recipe.checks)


# -- the outcome matrix ------------------------------------------------------

@pytest.mark.parametrize("logic", LOGICS)
@pytest.mark.parametrize("mode", MODES, ids=["sync", "async"])
@pytest.mark.parametrize("name", RECIPES)
def test_outcome(reports, api, name, mode, logic):
    run = result(reports, name, mode, logic)
    want = measured(api, name, logic, mode)
    assert run.outcome is want, (
        f"{name} async={mode} {logic}: {run.outcome.value} ({run.detail}; "
        f"{run.failure and run.failure.message}), expected {want.value}")


@pytest.mark.parametrize("mode", MODES, ids=["sync", "async"])
@pytest.mark.parametrize("name", RECIPES)
def test_reproductions_fire_on_the_step_after_the_abort(reports, name, mode):
    runs = [run for run in (result(reports, name, mode, logic) for logic in LOGICS) if run.outcome is R]
    if not runs:
        pytest.skip(f"{name} does not reproduce on this release")
    for run in runs:
        assert run.failure.function == "_build_store_jobs"
        assert "len(offload_keys) == len(offload_block_ids)" in run.failure.code
        last = run.timeline[-1]
        assert last.failed and last.action == "schedule"
        assert len(run.timeline) - 1 == abort_index(run) + 1


@pytest.mark.parametrize("mode", MODES, ids=["sync", "async"])
@pytest.mark.parametrize("name", RECIPES)
def test_surviving_runs_release_the_aborted_request(reports, name, mode):
    runs = [run for run in (result(reports, name, mode, logic) for logic in LOGICS) if run.outcome is N]
    if not runs:
        pytest.skip(f"{name} survives under no logic on this release")
    for run in runs:
        final_b = next(s for s in run.requests if s.request == "B")
        assert final_b.status == "FINISHED_ABORTED" and not final_b.connector_state


# The guard kvdoctor names for B. Where K1 is (the recipe reproduces, as measured: 0.26.0) only the
# PR #49146 cap (what "fixed" adds) keeps the store in bounds; where it is fixed a preempted B has 0
# computed tokens and every variant is held by PR #49285's basis rule (measured on 0.30.0, 0.33.0,
# 0.34.0; prefetch's B has its hit computed, so no guard is named for it there).
def wanted_guards(api, name) -> dict[str, str]:
    if bug_present(api, name):
        return {"fixed": "PR #49146"}
    return {logic: "PR #49285" for logic in LOGICS} if name == "preemption" else {}


@pytest.mark.parametrize("mode", MODES, ids=["sync", "async"])
@pytest.mark.parametrize("name", RECIPES)
def test_the_guard_that_held_is_named(reports, api, name, mode):
    wanted = wanted_guards(api, name)
    if not wanted:
        pytest.skip(f"no guard measured for {name} on this release")
    for logic, ref in wanted.items():
        guards = guard_lines(result(reports, name, mode, logic))
        assert any(g.startswith("B:") and ref in g for g in guards), (logic, guards)


# -- the paths the recipes claim to take --------------------------------------

@pytest.mark.parametrize("mode", MODES, ids=["sync", "async"])
def test_preemption_timeline_shows_b_preempted_before_its_abort(reports, mode):
    for logic in LOGICS:
        run = result(reports, "preemption", mode, logic)
        aborted_at = abort_index(run)
        before = run.timeline[:aborted_at]
        assert any(e.events is not None and "B" in e.events.preempted for e in before), logic
        assert status_of(before[-1], "B") == "PREEMPTED", logic
        preempted = [e for e in before if status_of(e, "B") == "PREEMPTED"]
        # re-considered for admission: its connector block ids were cleared while PREEMPTED
        assert any(sum(g.allocated_blocks for g in s.groups) == 0 and s.connector_state
                   for e in preempted for s in e.requests if s.request == "B"), logic
        assert status_of(run.timeline[aborted_at], "B") == "FINISHED_ABORTED"


@pytest.mark.parametrize("mode", MODES, ids=["sync", "async"])
def test_prefetch_timeline_shows_a_load_in_flight_at_the_abort(reports, mode):
    for logic in LOGICS:
        run = result(reports, "prefetch", mode, logic)
        aborted_at = abort_index(run)
        before = run.timeline[:aborted_at]
        assert any(e.events is not None and "B" in e.events.new_load_jobs.values() for e in before), logic
        waiting = before[-1]
        assert status_of(waiting, "B") == "WAITING_FOR_REMOTE_KVS", logic
        b = next(s for s in waiting.requests if s.request == "B")
        assert any(job.startswith("load#") for job in b.in_flight_jobs), logic
        assert status_of(run.timeline[aborted_at], "B") == "FINISHED_ABORTED"
