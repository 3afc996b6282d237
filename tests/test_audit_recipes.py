"""The built-in recipes for K2, K4 and K8, run on the installed vLLM.

Each recipe runs once per scheduling mode in this module (one vLLM import,
eighteen runs: three recipes, two modes, three logic variants). The expected
outcomes per release are kvdoctor's measurements in
kvdoctor/data/release_outcomes.toml; a release or dimension not measured there
skips. None of these paths goes through `storable_chunks`' allocated-chunk
cap, so the three logic variants agree.
"""

from __future__ import annotations

import contextlib
import glob
import os

import pytest

from kvdoctor import app
from kvdoctor.engine.overrides import Overrides
from kvdoctor.observe.verdict import Outcome
from kvdoctor.recipes.builtins import load_builtin

from .recipe_runs import (
    LOGICS,
    assert_outcome,
    index_of,
    load_described_builtins,
    reproduced_runs,
    result,
    snap,
)

pytestmark = pytest.mark.vllm

K8 = "preempt-reload-same-step"
K2 = "finished-after-finalize"
K4 = "final-token-slot-stored"
RECIPES = (K8, K2, K4)
MODES = (False, True)

R = Outcome.REPRODUCED
N = Outcome.NOT_REPRODUCED
# What the data file holds for these recipes (measured 2026-12-02..04): K8, the preempt flush meets the
# reload's load job (async: after draining the engine), fixed by PR #57810 (0.33.0); K2, request_finished
# finalizes the request in the tiering manager before its final store, fixed by PR #49671 (0.27.0); K4,
# sync and async: the final store counts the never-computed last token of a request ending at max_tokens,
# fixed by PR #54288 (0.30.0).


SHM_PATTERN = "/dev/shm/vllm_offload_*.mmap"


def _own_offload_regions() -> set[str]:
    """/dev/shm regions this process holds open (the tiering spec's scheduler-side mmap)."""
    held = set()
    for fd in glob.glob("/proc/self/fd/*"):
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("/dev/shm/vllm_offload_") and target.endswith(".mmap"):
            held.add(target)
    return held


@pytest.fixture(scope="module")
def reports(api):
    """Each recipe under each scheduling mode, all logic variants, timelines recorded."""
    before = set(glob.glob(SHM_PATTERN)) | _own_offload_regions()
    try:
        yield {
            (name, mode): app.repro(name, Overrides(async_scheduling=mode), "all", record_timeline=True)
            for name in RECIPES
            for mode in MODES
        }
    finally:
        # kvdoctor's harness never shuts the scheduler down, so each TieringOffloadingSpec
        # leaves its /dev/shm region behind: remove the ones this process created.
        for path in _own_offload_regions() - before:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def last_expect(run):
    return max(i for i, entry in enumerate(run.timeline) if entry.action == "expect")


# -- the recipes themselves --------------------------------------------------

def test_recipes_are_builtins():
    load_described_builtins(RECIPES)
    k8, k2, k4 = (load_builtin(name) for name in RECIPES)
    assert k8.bug == "K8" and any("57810" in ref for ref in k8.refs)
    assert (k8.signature.exception, k8.signature.function) == ("AssertionError", "build_connector_meta")
    assert k2.bug == "K2" and any("49635" in ref for ref in k2.refs)
    assert k2.requires[0] == "spec:TieringOffloadingSpec"
    assert k2.setup["spec_name"] == "TieringOffloadingSpec"
    assert k2.setup["extra_connector_config"]["secondary_tiers"] == []
    assert (k2.signature.exception, k2.signature.function) == ("KeyError", "prepare_store")
    assert k4.bug == "K4" and any("54288" in ref for ref in k4.refs)
    assert k4.signature.invariant == "store-covers-computed-slots"
    assert k4.setup["offload_prompt_only"] is False


# -- the outcome matrix ------------------------------------------------------

@pytest.mark.parametrize("logic", LOGICS)
@pytest.mark.parametrize("mode", MODES, ids=["sync", "async"])
@pytest.mark.parametrize("name", RECIPES)
def test_outcome(api, reports, name, mode, logic):
    assert_outcome(api, reports, name, mode, logic)


# -- K8: preempted by a cache reset and reloaded in the same step ------------

@pytest.mark.parametrize("mode", MODES, ids=["sync", "async"])
def test_k8_fires_in_the_step_after_the_reset(reports, mode):
    for run in reproduced_runs(reports, K8, mode):
        assert run.failure.function == "build_connector_meta"
        assert run.failure.code == "assert self._jobs[any_jid].is_store"
        last = run.timeline[-1]
        assert last.failed and last.action == "schedule"
        reset = index_of(run, "reset_prefix_cache")
        assert index_of(run, "schedule", reset) == len(run.timeline) - 1
        before = run.timeline[-2]
        assert before.action == "expect" and snap(before, "A").status == "PREEMPTED"
        # what the assertion tripped on: A's only job is the load of its stored chunk
        a = snap(last, "A")
        assert a.status == "WAITING_FOR_REMOTE_KVS" and a.in_flight_jobs and \
            all(job.startswith("load#") for job in a.in_flight_jobs), a


def test_k8_fixed_release_reloads_in_the_preempting_step(reports, release):
    run = result(reports, K8, False, "installed")
    if run.outcome is not N:
        pytest.skip(f"K8 reproduces on {release}")
    step = run.timeline[index_of(run, "schedule", index_of(run, "reset_prefix_cache"))]
    assert step.events.preempted == ["A"]
    assert list(step.events.new_load_jobs.values()) == ["A"]
    assert not step.events.jobs_to_flush  # the new load is not flushed (PR #57810)


def test_k4_async_is_played_as_is_and_reproduces_where_sync_does(reports):
    """K4's request ends at max_tokens: no step is scheduled past it under either scheduling mode, so its last
    slot is never computed and async reproduces exactly where sync does (measured on 0.26.0-0.34.0, agreeing with
    vLLM's own K4 test, benchmarks/oracle_k4_final_token.py). No reason is waived: the recipe claims no mode."""
    for logic in LOGICS:
        sync, run = result(reports, K4, False, logic), result(reports, K4, True, logic)
        assert run.played_outcome is None, (logic, run.detail)
        assert run.outcome is sync.outcome, (logic, run.outcome, sync.outcome, run.detail)
        if run.outcome is R:
            a = next(r for r in run.requests if r.request == "A")
            assert a.status == "FINISHED_LENGTH_CAPPED" and a.computed_tokens == 15, a


def test_k8_async_needs_the_drain(reports):
    """Under async scheduling the recipe drains first; the reset then succeeds."""
    for logic in LOGICS:
        run = result(reports, K8, True, logic)
        actions = [e.action for e in run.timeline]
        assert actions.index("drain") < actions.index("reset_prefix_cache")
        assert not any(e.failed and e.action == "reset_prefix_cache" for e in run.timeline)


# -- K2: final store prepared after the tiering manager finalized the request -

@pytest.mark.parametrize("mode", MODES, ids=["sync", "async"])
def test_k2_fires_on_the_final_store(reports, mode):
    for run in reproduced_runs(reports, K2, mode):
        assert run.failure.exception == "KeyError" and run.failure.message == "'A'"
        assert run.failure.code == "state = self._req_state[req_context.req_id]"
        assert [f.function for f in run.failure.vllm_frames[-2:]] == ["_build_store_jobs", "prepare_store"]
        # sync: the first schedule after the precondition; async: the second
        first = index_of(run, "schedule", last_expect(run))
        assert len(run.timeline) - 1 == first + (1 if mode else 0)
        a = snap(run.timeline[-1], "A")
        assert a.status == "FINISHED_STOPPED" and a.store_jobs_built == 0 and a.connector_state


@pytest.mark.parametrize("mode", MODES, ids=["sync", "async"])
def test_k2_prefill_store_was_refused_for_lack_of_cpu_space(reports, mode):
    for logic in LOGICS:
        run = result(reports, K2, mode, logic)
        prefill = run.timeline[last_expect(run) - 1]
        assert prefill.action == "schedule" and prefill.events.scheduled_tokens.get("A") == 16
        assert "A" not in prefill.events.new_store_jobs.values()


@pytest.mark.parametrize("mode", MODES, ids=["sync", "async"])
def test_k2_fixed_release_builds_the_final_store(reports, release, mode):
    run = result(reports, K2, mode, "installed")
    if run.outcome is not N:
        pytest.skip(f"K2 reproduces on {release}")
    final = [e for e in run.timeline if e.events is not None and "A" in e.events.new_store_jobs.values()]
    assert len(final) == 1 and snap(final[0], "A").status == "FINISHED_STOPPED"


# -- K4: the final sampled token's slot is stored (silent) ---------------------

@pytest.mark.parametrize("mode", MODES, ids=["sync", "async"])
def test_k4_violation_names_the_uncomputed_slot(reports, mode):
    for run in reproduced_runs(reports, K4, mode):
        assert run.failure is None
        assert [v.invariant for v in run.violations] == ["store-covers-computed-slots"]
        assert "A: store covers tokens up to 16 but only 15 have KV written" in run.violations[0].message
        last = run.timeline[-1]
        assert last.failed and last.action == "schedule"
        assert last.events.new_store_jobs and set(last.events.new_store_jobs.values()) == {"A"}
        # sync: the first schedule after the precondition; async (A's output applied a step later): the second
        assert index_of(run, "schedule", last_expect(run)) + (1 if mode else 0) == len(run.timeline) - 1


def test_k4_fixed_release_builds_no_store(reports, release):
    run = result(reports, K4, False, "installed")
    if run.outcome is not N:
        pytest.skip(f"K4 reproduces on {release}")
    assert snap(run.timeline[-1], "A").store_jobs_built == 0
