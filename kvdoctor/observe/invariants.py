"""Named invariants checked after every step, for bugs that corrupt state silently.

A violated invariant named by a recipe's signature is a reproduction with the
invariant's name as its signature; any other violated invariant that a run was
asked to check is an `other_failure`. Each check reads what the step did
(events, the `storable_chunks` calls vLLM made) and the state after it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvdoctor.logic.patch import StorableCall
from kvdoctor.observe import connector_metrics, kv_events
from kvdoctor.observe.example_tier_invariants import EXAMPLE_TIER_CHECKS
from kvdoctor.observe.objstore_invariants import OBJSTORE_CHECKS
from kvdoctor.observe.p2p_invariants import P2P_CHECKS
from kvdoctor.observe.tier_invariants import TIER_CHECKS


@dataclass
class StepContext:
    harness: Any
    events: Any  # StepEvents
    calls: list[StorableCall]


@dataclass
class Violation:
    invariant: str
    message: str


Check = Callable[[StepContext], list[str]]
INVARIANTS: dict[str, tuple[str, Check]] = {}


def invariant(name: str, summary: str) -> Callable[[Check], Check]:
    def register(check: Check) -> Check:
        INVARIANTS[name] = (summary, check)
        return check
    return register


@invariant("store-covers-computed-slots",
           "a store job covers only KV slots that were computed (K4: the final sampled token's slot never is; "
           "under speculative decoding a draft's slot is not, until the draft is accepted)")
def _store_covers_computed(ctx: StepContext) -> list[str]:
    if not ctx.events.new_store_jobs:  # most steps build no store (checked after every step)
        return []
    messages = []
    stored_requests = set(ctx.events.new_store_jobs.values())
    for req_id in sorted(stored_requests):
        calls = [c for c in ctx.calls if c.req_id == req_id]
        for call in calls:
            # The status when vLLM built the store: a request finished by this very
            # step's output was still running then, and its scheduled tokens count.
            finished = call.request_status.startswith("FINISHED")
            # Draft tokens verified in this step are not known tokens yet: vLLM clamps a store to
            # `Request.num_tokens`, which counts no draft (a rejected draft's slot holds wrong KV).
            drafts = getattr(ctx.events, "spec_tokens", {}).get(req_id, 0)
            scheduled = ctx.events.scheduled_tokens.get(req_id, 0) - drafts
            limit = call.computed_tokens + (0 if finished else scheduled)
            end = call.returned * call.tokens_per_chunk
            if end > limit:
                messages.append(f"{req_id}: store covers tokens up to {end} but only {limit} have KV written "
                                f"(group {call.group_idx}, status {call.request_status})")
                break
    return messages


@invariant("reused-blocks-are-flushed",
           "a GPU block handed out again while a pending store still reads it is fenced by a flush (K9)")
def _reused_blocks_flushed(ctx: StepContext) -> list[str]:
    if not ctx.events.reused_while_storing:
        return []
    flushed = set(ctx.events.jobs_to_flush)
    in_flight = getattr(getattr(ctx.harness, "worker", None), "in_flight", {}) if ctx.harness is not None else {}

    def whose(jid: int) -> str:
        job = in_flight.get(jid)
        return f" (request {job.req_id})" if job is not None else ""
    return [f"store job #{jid}{whose(jid)} still reads block(s) {blocks}, which this step allocated again, and "
            f"was not flushed (expected in this step's jobs_to_flush): the worker may store the new owner's KV"
            for jid, blocks in sorted(ctx.events.reused_while_storing.items()) if jid not in flushed]


@invariant("final-store-covers-computed-chunks",
           "a finished request's final store offers every chunk whose KV it computed and may offload "
           "(K5: an EAGLE/MTP group's trailing chunk is never stored)")
def _final_store_covers_computed(ctx: StepContext) -> list[str]:
    best: dict[tuple[str, int], StorableCall] = {}
    for call in ctx.calls:
        if not call.request_status.startswith("FINISHED"):
            continue
        key = (call.req_id, call.group_idx)
        if key not in best or call.returned > best[key].returned:
            best[key] = call
    messages = []
    for (req_id, group), call in sorted(best.items()):
        # Chunks whose every slot was computed and is offloadable, that the request still holds
        # blocks and offload keys for: a correct final store offers all of them.
        computed = min(_committed_tokens(call), call.num_offloadable_tokens) // call.tokens_per_chunk
        expected = min(computed, call.allocated_chunks, call.keyed_chunks)
        if call.returned < expected and expected > call.next_stored_chunk:
            missing = range(max(call.returned, call.next_stored_chunk), expected)
            chunks = (f"chunk {missing[0]}" if len(missing) == 1 else f"chunks {missing[0]}-{missing[-1]}")
            messages.append(f"{req_id} (group {group}, {call.request_status}): its final store counts "
                            f"{call.returned} storable chunk(s) but its {call.computed_tokens} computed tokens fill "
                            f"{expected}: {chunks} will never be stored")
    return messages


def _committed_tokens(call: StorableCall) -> int:
    """The tokens whose KV a finished request has committed. The final sampled token's slot never is
    (vLLM 0.34's `_build_store_jobs` clamps a finished request to max(num_prompt_tokens, num_tokens - 1):
    "under spec decode it holds a rejected draft's KV"); and under async scheduling a finished request's
    `num_computed_tokens` still counts the in-flight step's slots, drafts included (vLLM rolls back no
    rejected draft of a finished request), so it may exceed its known tokens."""
    if call.num_tokens is None or call.num_prompt_tokens is None or call.request_status == "FINISHED_ABORTED":
        return call.computed_tokens
    return min(call.computed_tokens, max(call.num_prompt_tokens, call.num_tokens - 1))


@invariant("readmitted-chunks-offered-again",
           "a request re-admitted after a preemption offers for storing every chunk it recomputes: its "
           "store cursor is not past its computed tokens (K11)")
def _readmitted_chunks_offered(ctx: StepContext) -> list[str]:
    """K11's mechanism only: a preempted request restarts from fewer computed tokens (vLLM resets
    `num_computed_tokens` on preemption and re-admits it from its prefix hits); where the connector
    then finds no external hit, `update_state_after_alloc` returns early and the store cursor keeps
    its pre-preemption chunk, so chunks below it are recomputed into new blocks and never offered.

    A request never preempted is not checked: a full-prompt hit makes vLLM recompute the last token
    (the hit is capped at `num_tokens - 1`, rounded down to a block), so `num_computed_tokens` sits a
    chunk below the cursor that `update_state_after_alloc` set from the hit, yet that chunk was just
    loaded from the CPU tier (or is in it): nothing is lost. Whether a request was preempted is
    vLLM's own count (`Request.num_preemptions`)."""
    messages = []
    seen: set[tuple[str, int]] = set()
    requests = getattr(ctx.harness, "requests", {}) if ctx.harness is not None else {}
    for call in ctx.calls:
        key = (call.req_id, call.group_idx)
        if call.request_status != "RUNNING" or key in seen:
            continue
        seen.add(key)
        if not getattr(requests.get(call.req_id), "num_preemptions", 0):
            continue  # never preempted: not re-admitted, so not K11's path
        # Chunks below the cursor are taken as stored; a request restarted from fewer computed
        # tokens recomputes them into new blocks, and they are never offered again.
        computed_chunks = -(-call.computed_tokens // call.tokens_per_chunk)
        if call.next_stored_chunk > computed_chunks:
            first, last = computed_chunks, call.next_stored_chunk - 1
            chunks = f"chunk {first}" if first == last else f"chunks {first}-{last}"
            messages.append(f"{call.req_id} (group {call.group_idx}), re-admitted after a preemption: its store "
                            f"cursor is at chunk {call.next_stored_chunk} but it runs from {call.computed_tokens} "
                            f"computed tokens: {chunks}, computed again into new GPU blocks, will never be offered "
                            f"for storing (expected the cursor at or below chunk {computed_chunks})")
    return messages


@invariant("no-orphan-transfer-jobs",
           "every in-flight transfer job belongs to a request the connector still tracks")
def _no_orphan_jobs(ctx: StepContext) -> list[str]:
    api = ctx.harness.api
    cs = ctx.harness.connector_scheduler
    if cs is None:  # no connector, no jobs
        return []
    jobs = api.jobs(cs)
    if not jobs:
        return []
    states = api.request_states(cs)
    owners = {jid for state in states.values() for jid in api.transfer_job_ids(state)}
    orphans = sorted(set(jobs) - owners)
    return [f"job #{jid} has no owning request state" for jid in orphans]


# -- KV events (Setup.kv_events: what vLLM publishes to a subscriber; no-ops where events are off) ----------

for _name, _summary, _events_check in kv_events.CHECKS:
    invariant(_name, _summary)(_events_check)


# -- the connector's metrics (vLLM's reduce() and Prometheus observe, each step) -----------------


@invariant("connector-metrics-in-range",
           "the connector's stats pass through vLLM's reduce() and Prometheus observe each step, and every "
           "gauge is in range (usage fractions in [0, 1], counts non-negative), no counter decreases")
def _metrics_in_range(ctx: StepContext) -> list[str]:
    return connector_metrics.check_step(ctx.harness)


@invariant("idle-connector-gauges-zero",
           "once the engine is idle (no request, no transfer in flight) the connector's in-flight gauges "
           "(cache usage, active jobs, deferred releases) read zero: nothing is left pinned")
def _idle_gauges_zero(ctx: StepContext) -> list[str]:
    return connector_metrics.check_step(ctx.harness, idle_only=True)


# -- KV content (the vLLM worker's toy model judges bytes; the simulated worker moves none) ------

CONTENT_INVARIANTS = ("store-copies-computed-kv", "reads-see-their-tokens", "load-returns-stored-bytes",
                      "canonical-page-is-tp1-page")


def _content(name: str) -> Check:
    def check(ctx: StepContext) -> list[str]:
        return [f.message for f in getattr(ctx.events, "content_findings", ()) if f.invariant == name]
    return check


invariant("store-copies-computed-kv",
          "a store job copies only KV slots whose bytes are what their tokens say (judged on the bytes "
          "vLLM's worker copies, when it copies them: a store flushed before the step's forward by the "
          "bytes it read then, not by what a new owner of its blocks wrote since)")(
    _content("store-copies-computed-kv"))
invariant("reads-see-their-tokens",
          "every KV slot a forward reads holds the KV its tokens say (a stale or wrong load shows here)")(
    _content("reads-see-their-tokens"))
invariant("load-returns-stored-bytes",
          "a load writes into GPU blocks exactly the bytes stored into the CPU slot it reads")(
    _content("load-returns-stored-bytes"))
invariant("canonical-page-is-tp1-page",
          "vLLM's canonical page mapping (0.27+), asked for every rank of TP 2, 4 and 8 over the run's attention spec "
          "in each of its four layouts, assembles the TP=1 worker's page byte for byte (a chunk stored under one TP "
          "size is loadable under another; engine/compat/canonical_mapping.py)")(
    _content("canonical-page-is-tp1-page"))

# A content invariant is the data-level form of a bookkeeping one: a recipe whose signature names
# the bookkeeping invariant reproduces when its content form is violated.
CONTENT_FORM_OF = {"store-covers-computed-slots": "store-copies-computed-kv"}


def unknown(names: list[str]) -> list[str]:
    return [n for n in names if n not in INVARIANTS]


def check_all(names: list[str], ctx: StepContext) -> list[Violation]:
    violations: list[Violation] = []
    for name in names:
        messages = INVARIANTS[name][1](ctx)
        if messages:
            violations.extend(Violation(name, message) for message in messages)
    return violations


# The tiering manager's invariants, read through kvdoctor's scripted secondary tier (a module of their own)
INVARIANTS.update(TIER_CHECKS)
INVARIANTS.update(OBJSTORE_CHECKS)  # vLLM's object-store tier, read through kvdoctor's recording tier
INVARIANTS.update(EXAMPLE_TIER_CHECKS)  # vLLM's example tier, read through kvdoctor's recording tier
# vLLM's P2P tier's promises, read on a `[setup] p2p = true` pair (observe/p2p_invariants.py)
INVARIANTS.update(P2P_CHECKS)
