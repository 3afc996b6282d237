"""Named invariants: unit checks on synthetic steps, and one on the real scheduler."""

from __future__ import annotations

from kvdoctor import app
from kvdoctor.engine.harness import StepEvents
from kvdoctor.engine.overrides import Overrides
from kvdoctor.logic.patch import StorableCall
from kvdoctor.observe.invariants import INVARIANTS, StepContext, check_all
from kvdoctor.observe.verdict import Outcome

from .conftest import ROOT


def _ctx(**events) -> StepContext:
    return StepContext(harness=None, events=StepEvents(**events), calls=[])


def test_reused_block_without_flush_is_a_violation():
    (violation,) = check_all(["reused-blocks-are-flushed"], _ctx(reused_while_storing={3: [5, 6]}))
    assert violation.invariant == "reused-blocks-are-flushed" and "#3" in violation.message
    assert check_all(["reused-blocks-are-flushed"], _ctx(reused_while_storing={3: [5]}, jobs_to_flush=[3])) == []


def _call(**overrides) -> StorableCall:
    values = dict(req_id="A", group_idx=0, num_offloadable_tokens=16, token_chunks=1, allocated_chunks=1,
                  keyed_chunks=1, installed=1, fixed=1, unpatched=1, returned=1, request_status="RUNNING",
                  tokens_per_chunk=16, next_stored_chunk=0, computed_tokens=0, full_token_chunks=1)
    return StorableCall(**{**values, **overrides})


def test_store_past_the_computed_slots_is_a_violation():
    finished = _call(request_status="FINISHED_STOPPED", computed_tokens=15)
    ctx = StepContext(None, StepEvents(new_store_jobs={4: "A"}), [finished])
    (violation,) = check_all(["store-covers-computed-slots"], ctx)
    assert "up to 16 but only 15" in violation.message
    # Running when vLLM built the store: this step's 16 scheduled tokens are computed by its forward pass.
    running = _call(computed_tokens=0)
    ctx = StepContext(None, StepEvents(new_store_jobs={4: "A"}, scheduled_tokens={"A": 16}), [running])
    assert check_all(["store-covers-computed-slots"], ctx) == []


def test_every_invariant_has_a_summary():
    assert all(summary for summary, _ in INVARIANTS.values())


def test_a_finished_requests_reused_blocks_are_fenced(api):
    """A finishes with its store held; B gets A's blocks next step: the store must be flushed then."""
    report = app.repro(str(ROOT / "tests" / "data" / "reused-block-fenced.toml"), Overrides(), "installed",
                       record_timeline=True)
    (result,) = report.results
    assert result.outcome is Outcome.NOT_REPRODUCED, result.detail
    reuse = [e for e in result.timeline if e.events and e.events.reused_while_storing]
    assert reuse, "the recipe must really hand a pending store's block to B"
    for entry in reuse:
        assert set(entry.events.reused_while_storing) <= set(entry.events.jobs_to_flush)
