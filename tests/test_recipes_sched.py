"""The built-in recipes for K5, K6, K9 and K11, run on the installed vLLM's real scheduler.

One vLLM import for the module: every recipe runs once per scheduling mode it
supports, under all three logic variants, timelines recorded. The expected
outcomes per release are kvdoctor's measurements in
kvdoctor/data/release_outcomes.toml (sync and --async-scheduling, installed and
fixed logic); a release or dimension not measured there skips.
The new invariants are also checked on synthetic steps, so a check that cannot
fire is caught without vLLM.
"""

from __future__ import annotations

import pytest

from kvdoctor import app
from kvdoctor.engine.harness import StepEvents
from kvdoctor.engine.overrides import Overrides
from kvdoctor.logic.patch import StorableCall
from kvdoctor.observe.invariants import StepContext, check_all
from kvdoctor.observe.verdict import Outcome
from kvdoctor.recipes.builtins import load_builtin

from .recipe_runs import LOGICS, assert_outcome, index_of, load_described_builtins, reproduced_runs, result, snap

K5 = "eagle-final-chunk-unstored"
K6 = "offload-keys-lag-blocks"
K9 = "reused-block-unfenced-multiconnector"
K11 = "readmitted-stale-store-cursor"
RECIPES = (K5, K6, K9, K11)
MODES = (False, True)

N = Outcome.NOT_REPRODUCED
# Measured 2026-12-03 (0.26.0, 0.30.0, 0.34.0): none of these bugs is held by the PR #49146 allocated-chunk
# cap, the three logics agree (K6: the blocks are allocated, the keys are missing; K5, K9 and K11 are not
# storable_chunks-bound). Under --async-scheduling K11 is untested, naming the flag (issue 23).


@pytest.fixture(scope="module")
def reports(api):
    return {(name, mode): app.repro(name, Overrides(async_scheduling=mode), "all", record_timeline=True)
            for name in RECIPES for mode in MODES}


# -- the recipes themselves ---------------------------------------------------

def test_recipes_are_builtins():
    load_described_builtins(RECIPES)
    k5, k6, k11 = (load_builtin(name) for name in (K5, K6, K11))
    assert k5.bug == "K5" and any("52735" in ref for ref in k5.refs) and any("52771" in ref for ref in k5.refs)
    assert k5.signature.invariant == "final-store-covers-computed-chunks"
    assert k5.setup["layout"] == "eagle-pair" and "kv_cache_group_field:is_eagle_group" in k5.requires
    assert k6.bug == "K6" and any("52170" in ref for ref in k6.refs) and any("52923" in ref for ref in k6.refs)
    assert (k6.signature.exception, k6.signature.function, k6.signature.request) == (
        "AssertionError", "_build_store_jobs", "A")
    assert [s.action for s in k6.steps].count("delay_block_hashes") == 1
    k9 = load_builtin(K9)
    assert k9.bug == "K9" and any("46951" in ref for ref in k9.refs)
    assert k9.signature.invariant == "reused-blocks-are-flushed" and k9.setup["multi_connector"] is True
    assert k11.bug == "K11" and any("52211" in ref for ref in k11.refs)
    assert k11.signature.invariant == "readmitted-chunks-offered-again"


# -- the outcome matrix -------------------------------------------------------

@pytest.mark.parametrize("logic", LOGICS)
@pytest.mark.parametrize("mode", MODES, ids=["sync", "async"])
@pytest.mark.parametrize("name", RECIPES)
def test_outcome(api, reports, name, mode, logic):
    assert_outcome(api, reports, name, mode, logic)


def test_k11_async_is_untested_naming_the_flag(reports):
    """K11's trigger needs synchronous scheduling: under the user's --async-scheduling the run is untested and
    says why, on every release (never not_applicable, exit 0)."""
    for logic in LOGICS:
        run = result(reports, K11, True, logic)
        assert run.outcome is Outcome.UNTESTED and "async-scheduling" in (run.detail or ""), (logic, run.detail)


# -- K5: an EAGLE group's final chunk is never stored --------------------------

def test_k5_runs_on_an_eagle_group(reports):
    run = result(reports, K5, False, "installed")
    assert run.kv_plan is not None and any(group.eagle for group in run.kv_plan.groups), run.kv_plan


@pytest.mark.parametrize("mode", MODES, ids=["sync", "async"])
def test_k5_violation_names_the_unstored_chunk(reports, mode):
    for run in reproduced_runs(reports, K5, mode):
        assert run.failure is None
        assert [v.invariant for v in run.violations] == ["final-store-covers-computed-chunks"]
        message = run.violations[0].message
        assert "A (group 0, FINISHED_LENGTH_CAPPED)" in message and "chunk 1 will never be stored" in message
        assert "33 computed tokens" in message
        a = snap(run.timeline[-1], "A")
        assert a.status == "FINISHED_LENGTH_CAPPED" and a.store_jobs_built == 1


def test_k5_fixed_release_stores_the_final_chunk(reports, release):
    run = result(reports, K5, False, "installed")
    if run.outcome is not N:
        pytest.skip(f"K5 reproduces on {release}")
    final = [e for e in run.timeline if e.events is not None and "A" in e.events.new_store_jobs.values()]
    assert len(final) == 2 and snap(final[-1], "A").status == "FINISHED_LENGTH_CAPPED"


# -- K6: offload keys lag allocated blocks --------------------------------------

@pytest.mark.parametrize("mode", MODES, ids=["sync", "async"])
def test_k6_fires_while_the_hash_is_withheld(reports, mode):
    for run in reproduced_runs(reports, K6, mode):
        assert run.failure.function == "_build_store_jobs" and run.failure.involved_request == "A"
        assert "len(offload_keys) == len(offload_block_ids)" in run.failure.code
        assert run.timeline[-1].failed and run.timeline[-1].action == "schedule"
        assert index_of(run, "delay_block_hashes") < len(run.timeline) - 1
        assert not any(e.action == "release_block_hashes" for e in run.timeline)
        group = snap(run.timeline[-1], "A").groups[0]
        # the state K6 needs: fewer offload keys than allocated chunks at store time
        assert group.offload_keys == 1 and group.allocated_chunks >= 2 and group.next_stored_chunk == 1


def test_k6_fixed_logic_does_not_hold_it(reports):
    """The PR #49146 cap bounds chunks by allocated blocks; here the blocks exist and the keys do not."""
    for mode in MODES:
        installed, fixed = (result(reports, K6, mode, logic) for logic in ("installed", "fixed"))
        assert fixed.outcome is installed.outcome


def test_k6_fixed_release_stores_the_chunk_once_its_key_arrives(reports, release):
    run = result(reports, K6, False, "installed")
    if run.outcome is not N:
        pytest.skip(f"K6 reproduces on {release}")
    release_at = index_of(run, "release_block_hashes")
    stores = [i for i, e in enumerate(run.timeline) if e.events is not None and "A" in e.events.new_store_jobs.values()]
    assert len(stores) == 2 and stores[0] < index_of(run, "delay_block_hashes") < release_at < stores[1]


# -- K9: a block another connector loads into is not fenced -----------------------

@pytest.mark.parametrize("mode", MODES, ids=["sync", "async"])
def test_k9_runs_under_a_multiconnector(reports, mode):
    """The load comes from the second OffloadingConnector: C waits with no load of the watched one."""
    run = result(reports, K9, mode, "installed")
    step = next(e for e in run.timeline if e.events is not None and e.events.reused_while_storing)
    c = snap(step, "C")
    assert c.status == "WAITING_FOR_REMOTE_KVS" and c.computed_tokens == 192 and not c.in_flight_jobs
    assert not step.events.new_load_jobs  # not the watched connector's load
    assert step.events.reused_while_storing == {0: [1]}  # A's pending store, A's freed block


@pytest.mark.parametrize("mode", MODES, ids=["sync", "async"])
def test_k9_violation_names_the_unfenced_store(reports, mode):
    for run in reproduced_runs(reports, K9, mode):
        assert [v.invariant for v in run.violations] == ["reused-blocks-are-flushed"]
        assert "store job #0 (request A) still reads block(s) [1]" in run.violations[0].message
        assert not run.timeline[-1].events.jobs_to_flush
        assert snap(run.timeline[-1], "A").in_flight_jobs == ["store#0"]  # still reading block 1


def test_k9_fixed_release_flushes_in_the_load_step(reports, release):
    run = result(reports, K9, False, "installed")
    if run.outcome is not N:
        pytest.skip(f"K9 reproduces on {release}")
    step = next(e for e in run.timeline if e.events is not None and e.events.reused_while_storing)
    assert set(step.events.reused_while_storing) <= set(step.events.jobs_to_flush)


# -- K11: stale store cursor after re-admission ----------------------------------

def test_k11_violation_names_the_skipped_chunk(reports):
    for run in reproduced_runs(reports, K11, False):
        assert [v.invariant for v in run.violations] == ["readmitted-chunks-offered-again"]
        message = run.violations[0].message
        assert ("B (group 0), re-admitted after a preemption: its store cursor is at chunk 2 but it runs from 64 "
                "computed tokens") in message
        assert "chunk 1," in message
        last = run.timeline[-1]
        assert last.failed and last.action == "schedule" and last.events.scheduled_tokens.get("B")
        before = snap(run.timeline[-2], "B")
        assert before.status == "PREEMPTED"
        assert snap(last, "B").status == "RUNNING"


def test_k11_fixed_release_offers_the_chunks_again(reports, release):
    run = result(reports, K11, False, "installed")
    if run.outcome is not N:
        pytest.skip(f"K11 reproduces on {release}")
    b = snap(run.timeline[-1], "B")
    assert b.status in ("RUNNING", "FINISHED_LENGTH_CAPPED")
    assert all(g.next_stored_chunk <= -(-b.computed_tokens // 64) for g in b.groups)


# -- the new invariants on synthetic steps (no vLLM) ------------------------------

def _call(**overrides) -> StorableCall:
    values = dict(req_id="A", group_idx=0, num_offloadable_tokens=34, token_chunks=2, allocated_chunks=3,
                  keyed_chunks=2, installed=1, fixed=1, unpatched=1, returned=1,
                  request_status="FINISHED_LENGTH_CAPPED", tokens_per_chunk=16, next_stored_chunk=1,
                  computed_tokens=33, full_token_chunks=2)
    return StorableCall(**{**values, **overrides})


def _check(name, *calls, preempted=("A",)):
    """`preempted`: requests vLLM counts as preempted (`Request.num_preemptions`), as the harness holds them."""
    from types import SimpleNamespace

    harness = SimpleNamespace(requests={r: SimpleNamespace(num_preemptions=1) for r in preempted})
    return check_all([name], StepContext(harness, StepEvents(), list(calls)))


def test_final_store_invariant():
    (violation,) = _check("final-store-covers-computed-chunks", _call())
    assert "A (group 0, FINISHED_LENGTH_CAPPED)" in violation.message and "chunk 1 will never" in violation.message
    assert _check("final-store-covers-computed-chunks", _call(returned=2)) == []
    assert _check("final-store-covers-computed-chunks", _call(computed_tokens=31)) == []  # chunk 1 not computed
    assert _check("final-store-covers-computed-chunks", _call(allocated_chunks=1)) == []  # its blocks are gone
    assert _check("final-store-covers-computed-chunks", _call(request_status="RUNNING")) == []


def test_readmitted_cursor_invariant():
    stale = _call(request_status="RUNNING", computed_tokens=16, next_stored_chunk=3, returned=3)
    (violation,) = _check("readmitted-chunks-offered-again", stale)
    assert "cursor is at chunk 3 but it runs from 16 computed tokens: chunks 1-2" in violation.message
    assert _check("readmitted-chunks-offered-again", _call(request_status="RUNNING", computed_tokens=16,
                                                           next_stored_chunk=1)) == []
    assert _check("readmitted-chunks-offered-again", _call(request_status="RUNNING", computed_tokens=20,
                                                           next_stored_chunk=2)) == []  # a partial chunk
    assert _check("readmitted-chunks-offered-again", _call(computed_tokens=0, next_stored_chunk=3)) == []
    # never preempted (a full-prompt hit recomputing its last token): not K11's path, nothing to report
    assert _check("readmitted-chunks-offered-again", stale, preempted=()) == []
