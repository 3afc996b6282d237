"""Invariants of vLLM's tiering manager, read through kvdoctor's scripted secondary tier.

Each is a promise vLLM's TieringOffloadingManager makes to its secondary tiers (tiering/base.py's docstrings)
or to its backpressure detector (tiering/backpressure.py). The scripted tier (engine/compat/scripted_tier.py)
records what the manager asked of it (`journal`), and these checks hold that against the manager's own
state after every step. A run without a scripted tier has nothing to check (every check returns []).

- no chunk promoted twice: no promotion job for a key, or into a primary chunk, that another promotion
  still has in flight;
- no hit for a failed promotion: a key whose promotion the tier reported failed is not ready in the CPU
  (primary) tier afterwards (vLLM fails it, or defers its release), until it is stored again;
- no promotion into a released chunk: a primary chunk a failed promotion may still write (its
  `deferred_release` not yet set) is neither in the free pool nor given to another job;
- every request's tier state released once: `on_request_finished` at most once per request the tier saw,
  and exactly once by the time the manager drops the request's state;
- backpressure accounted: a dropped cascade submits and pins nothing, an allowed one submits one store of
  its blocks (so stores resume when the pattern allows), and the policy's drop counters (what vLLM's
  `pop_stores_dropped` reports) equal the skipped cascades.

With vLLM's own detector (Setup.backpressure_pattern = "vllm[:...]": its EMABackpressureDetector and policy on
kvdoctor's step clock, engine/compat/vllm_backpressure.py), besides:
- backpressure resumes: a store decision taken with no pressure left (none held, or vLLM's EMA decayed below the
  low water mark by the step clock's idle time, `_apply_idle_decay`) and outside the cooldown after pressure
  cleared is allowed, and a decayed EMA clears the pressure (backpressure.py: "the EMA decays toward zero so the
  detector can eventually recover", "stores are throttled ... for this many seconds" after it clears);
- drop counters reported once: what vLLM popped from the policy (`pop_stores_dropped`, "return and reset", each
  step's metrics) plus what it holds unpopped equals every skip it was told of; the EMA (the latency gauge) is a
  finite number >= 0.
"""

from __future__ import annotations

from typing import Any

from kvdoctor.observe.tier_check_table import TierCheckTable, registrar

TIER_CHECKS: TierCheckTable = {}  # observe/invariants.py registers them with the others
invariant = registrar(TIER_CHECKS)


def _scripted(ctx: Any) -> tuple[Any, list[Any]]:
    """(the tiering manager, its scripted tiers); (None, []) without them."""
    harness = ctx.harness
    if getattr(harness, "connector_scheduler", None) is None:
        return None, []
    manager = harness.api.tiering_manager_of(harness.connector_scheduler)
    return manager, harness.api.scripted_tiers(manager) if manager is not None else []


def _reported(tiers: list[Any], prefix: str) -> list[str]:
    """The violations the tiers recorded when vLLM asked (each reported once)."""
    messages = []
    for tier in tiers:
        mine = [v for v in tier.journal.violations if v.startswith(prefix)]
        tier.journal.violations = [v for v in tier.journal.violations if not v.startswith(prefix)]
        messages.extend(mine)
    return messages


@invariant("tier-no-double-promotion",
           "the tiering manager never promotes a key, or into a primary chunk, that another promotion still has "
           "in flight")
def _no_double_promotion(ctx: Any) -> list[str]:
    _, tiers = _scripted(ctx)
    return _reported(tiers, "no-chunk-promoted-twice")


@invariant("tier-no-hit-after-failed-promotion",
           "a key whose promotion a secondary tier reported failed is not ready in the CPU tier afterwards "
           "(until stored again)")
def _no_hit_after_failure(ctx: Any) -> list[str]:
    manager, tiers = _scripted(ctx)
    api = ctx.harness.api
    messages = []
    for tier in tiers:
        failed = tier.journal.failed_promotions
        for key in list(failed):
            chunk = api.primary_chunk(manager, key)
            if chunk is None or not chunk[1]:  # gone (failed or deferred) or written again: nothing to serve
                failed.discard(key)
                continue
            messages.append(f"key {key.hex()[:12] if isinstance(key, bytes) else key!r} is ready in the CPU tier "
                            f"(chunk {chunk[0]}) after its promotion from the {tier.tier_type} tier failed")
            failed.discard(key)  # reported once
    return messages


@invariant("tier-no-promotion-into-released-chunk",
           "a primary chunk a failed promotion may still write (deferred release pending) is neither free nor "
           "given to another job")
def _no_promotion_into_released(ctx: Any) -> list[str]:
    manager, tiers = _scripted(ctx)
    messages = _reported(tiers, "no-promotion-into-released-chunk")
    if not tiers:
        return messages
    free = ctx.harness.api.primary_free_chunks(manager)
    for tier in tiers:
        freed = sorted(tier.journal.deferred_chunks & free)
        if freed:
            messages.append(f"primary chunk(s) {freed} are in the free pool while the {tier.tier_type} tier's "
                            f"failed promotion may still write them (deferred release not yet set)")
    return messages


@invariant("tier-request-released-once",
           "every request a secondary tier saw is released (on_request_finished) once, by the time the tiering "
           "manager drops its state")
def _released_once(ctx: Any) -> list[str]:
    manager, tiers = _scripted(ctx)
    if not tiers:
        return []
    tracked = ctx.harness.api.tier_tracked_requests(manager)
    messages = []
    for tier in tiers:
        journal = tier.journal
        for req_id, times in journal.finished_requests.items():
            if times > 1:
                messages.append(f"request {req_id!r} released {times} times by the {tier.tier_type} tier")
            if req_id not in journal.new_requests:
                messages.append(f"request {req_id!r} released by the {tier.tier_type} tier it was never shown to")
        for req_id in journal.new_requests:
            if req_id not in tracked and not journal.finished_requests.get(req_id):
                messages.append(f"the tiering manager dropped request {req_id!r}'s state without releasing it "
                                f"in the {tier.tier_type} tier")
                journal.finished_requests[req_id] = 0  # reported once
        for req_id in [r for r, n in journal.finished_requests.items() if n > 1]:
            journal.finished_requests[req_id] = 1  # reported once
    return messages


@invariant("tier-backpressure-accounted",
           "under backpressure a dropped cascade submits and pins nothing, an allowed one submits its blocks, and "
           "the drop counters equal the skipped cascades")
def _backpressure_accounted(ctx: Any) -> list[str]:
    manager, tiers = _scripted(ctx)
    api = ctx.harness.api
    messages = []
    for tier in tiers:
        detector = tier.bp_detector
        journal = tier.journal
        if detector is None or not hasattr(detector, "decisions"):
            continue
        allowed = [n for ok, n in detector.decisions if ok]
        dropped = [n for ok, n in detector.decisions if not ok]
        if allowed != journal.store_sizes:
            messages.append(f"the {tier.tier_type} tier received stores of {journal.store_sizes} block(s) where "
                            f"backpressure allowed {allowed} (dropped {dropped})")
        if detector.policy.skipped_total != (len(dropped), sum(dropped)):
            messages.append(f"drop counters {detector.policy.skipped_total} (stores, blocks) != the skipped "
                            f"cascades ({len(dropped)}, {sum(dropped)})")
        pinned = api.tier_jobs_of(manager, tier)
        submitted = len(journal.stores_in_flight) + len(journal.loads_in_flight)
        if pinned != submitted:
            messages.append(f"the tiering manager holds {pinned} job(s) (pinned chunks) for the {tier.tier_type} "
                            f"tier, which has {submitted} in flight")
        if messages:  # reported once: the record starts again from here
            detector.decisions.clear()
            journal.store_sizes.clear()
            detector.policy.skipped_total = (0, 0)
    return messages


def _recorded(ctx: Any) -> list[tuple[Any, Any]]:
    """(tier, vLLM's recorded EMA detector) for each scripted tier that runs vLLM's own detector."""
    _, tiers = _scripted(ctx)
    return [(tier, tier.bp_detector) for tier in tiers
            if getattr(tier.bp_detector, "kvdoctor_recorded", False)]


def _should_resume(record: Any) -> tuple[bool, bool]:
    """(pressure clears at this decision, the store must be allowed): vLLM's EMA decayed by the step-clock time
    since its last update, `ema * 0.5 ** (dt / half_life)`, against the low water mark; then its cooldown."""
    clears = False
    if record.under_pressure and record.armed:
        dt = record.now - record.last_update
        ema = record.ema * 0.5 ** (dt / record.half_life_s) if dt > 0 and record.half_life_s > 0 else record.ema
        clears = ema < record.low
    pressured = record.under_pressure and not clears
    cleared_at = record.now if clears else record.cleared_at
    cooling = cleared_at > 0 and record.now - cleared_at < record.cooldown_s
    return clears, not pressured and not cooling


@invariant("tier-backpressure-resumes",
           "with vLLM's detector: a store decided with no pressure left (none, or its EMA decayed below the low "
           "water mark) outside the cooldown is allowed, and a decayed EMA clears the pressure")
def _backpressure_resumes(ctx: Any) -> list[str]:
    messages = []
    for tier, detector in _recorded(ctx):
        for record in detector.records:
            clears, must_allow = _should_resume(record)
            if clears and record.pressured_after:
                messages.append(f"the {tier.tier_type} tier's detector stays under pressure at t={record.now:g} s "
                                f"though its EMA {record.ema:.4g} decayed below the low water mark {record.low:g} "
                                f"since t={record.last_update:g} s")
            elif must_allow and not record.allowed:
                messages.append(f"a cascade of {record.blocks} block(s) to the {tier.tier_type} tier was dropped at "
                                f"t={record.now:g} s with no pressure left and no cooldown (stores did not resume)")
        detector.records.clear()
    return messages


@invariant("tier-backpressure-counters-reported",
           "with vLLM's detector: the drop counters vLLM popped plus those it holds equal every skip its policy "
           "was told of, and the latency EMA is finite and >= 0")
def _backpressure_counters(ctx: Any) -> list[str]:
    messages = []
    for tier, detector in _recorded(ctx):
        policy = detector.policy
        popped, held, skipped = policy.popped_total, policy.unpopped(), policy.skipped_total
        counted = (popped[0] + held[0], popped[1] + held[1])
        if counted != skipped:
            messages.append(f"the {tier.tier_type} tier's drop counters: popped {popped} + held {held} (stores, "
                            f"blocks) != the {skipped} skipped")
            policy.popped_total = (skipped[0] - held[0], skipped[1] - held[1])  # reported once
        ema = detector.ema
        if not ema >= 0 or ema == float("inf"):
            messages.append(f"the {tier.tier_type} tier's store latency EMA (its gauge) is {ema!r}")
    return messages


TIER_INVARIANTS = tuple(TIER_CHECKS)
