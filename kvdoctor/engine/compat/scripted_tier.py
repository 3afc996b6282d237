"""kvdoctor's scripted secondary tier and backpressure detector, loaded by vLLM itself.

vLLM's tiering spec loads an out-of-tree `SecondaryTierManager` from a tier spec's `module_path` (its
`type` is the class name) and a backpressure detector/policy from a tier's `backpressure` dict
(`backpressure_cls`, `policy_cls`). kvdoctor ships both here so its tiering runs reach the manager's
failure paths that the fs tier never takes on a healthy disk: failed, partial and deferred promotions
(`JobResult.successful_keys`, `deferred_release`), failed cascades, RETRY lookups while a store is in
flight, REQUEST_LEVEL stores, and stores dropped under backpressure. The chunks' bytes are kept in memory.

Every job's outcome comes from a script (`Setup.tier_script`), and every store decision from a pattern
(`Setup.backpressure_pattern`), both cycled, so a run replays exactly. Time is counted in scheduler steps
(`on_schedule_end`), never in seconds. The tier records what vLLM asked of it in `journal`, which
kvdoctor's tier invariants (observe/tier_invariants.py) read: the tier is a participant, not a mock of
anything vLLM ships. This module imports vLLM: only vLLM's loader and kvdoctor's tests import it.
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadKey,
    OffloadPolicy,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector, DropAccountingPolicy
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from kvdoctor.engine.compat import step_clock
from kvdoctor.engine.tier_script import parse_pattern, parse_script
from kvdoctor.errors import UsageError

# A "late" job reports done this many step ends after it was submitted: a whole step with it in flight,
# wherever in a step vLLM submitted it (promotions at the step's end, cascades in update_from_output).
LATE_STEPS = 2
DEFER_STEPS = 2  # a deferred release's event is set this many steps after the failure is reported


@dataclass
class TierJournal:
    """What vLLM asked of the scripted tier, for the tier invariants."""

    new_requests: Counter[str] = field(default_factory=Counter)
    finished_requests: Counter[str] = field(default_factory=Counter)
    # promotion jobs submitted and not yet reported: job id -> (keys, primary chunk ids)
    loads_in_flight: dict[int, tuple[tuple[Any, ...], tuple[int, ...]]] = field(default_factory=dict)
    # store (cascade) jobs submitted and not yet reported: job id -> number of keys
    stores_in_flight: dict[int, int] = field(default_factory=dict)
    store_sizes: list[int] = field(default_factory=list)  # every cascade's number of keys, in order
    # keys whose promotion this tier reported failed, not re-stored since: vLLM must not serve them
    failed_promotions: set[Any] = field(default_factory=set)
    # primary chunks a failed promotion may still write (deferred release, event not yet set)
    deferred_chunks: set[int] = field(default_factory=set)
    # what broke a promise at the moment vLLM asked (double promotion, a job into a deferred chunk)
    violations: list[str] = field(default_factory=list)
    lookups: Counter[str] = field(default_factory=Counter)  # HIT / MISS / RETRY answered


@dataclass
class _Pending:
    result: JobResult
    due: int  # the tier's step count (`ScriptedSecondaryTier.steps`) from which the job reports done


class ScriptedSecondaryTier(SecondaryTierManager):
    """A secondary tier whose job completions follow a script (see `parse_script`):

    - store: "ok" completes at the next poll, "late" after a whole step in flight (lookups answer RETRY meanwhile),
      "fail" reports failure (the keys are not kept);
    - load: "ok"/"late" as for stores, "fail" fails every key, "partial" loads the first half of the keys
      (`successful_keys`), "defer" fails every key with a `deferred_release` event set `DEFER_STEPS`
      steps later (the tier "may still write" those primary chunks until then).
    `request_level`: answer every new request with OffloadPolicy.REQUEST_LEVEL (vLLM then cascades a
    request's chunks when it finishes).
    `step_s` (the setup names vLLM's own detector): the tier's step clock (compat/step_clock.py), which vLLM's
    backpressure module reads from the tier's construction to its shutdown; each store job is stamped with it."""

    medium: ClassVar[Medium | None] = Medium.CPU
    kvdoctor_scripted: ClassVar[bool] = True  # compat.settle_secondary_tiers leaves its timing to the script

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str,
                 script: str | None = None, request_level: bool = False,
                 backpressure_detector: BackpressureDetector | None = None, step_s: float | None = None) -> None:
        super().__init__(offloading_spec=offloading_spec, primary_kv_view=primary_kv_view, tier_type=tier_type,
                         backpressure_detector=backpressure_detector)
        self.store_script, self.load_script = parse_script(script)
        self.request_level = request_level
        self.primary = np.asarray(primary_kv_view)  # (num_chunks, bytes per chunk), vLLM's shared region
        self.chunks: dict[OffloadKey, bytes] = {}
        self.storing: set[OffloadKey] = set()  # keys of store jobs in flight
        self.pending: list[_Pending] = []
        self.steps = 0  # scheduler steps ended (on_schedule_end): the tier's clock
        self.landing: dict[int, dict[OffloadKey, bytes]] = {}  # late store jobs' bytes, kept when they complete
        self.deferred: list[tuple[threading.Event, tuple[int, ...], int]] = []  # (event, chunks, steps left)
        self.store_jobs = 0
        self.load_jobs = 0
        self.journal = TierJournal()
        self.clock: step_clock.StepClock | None = None
        if step_s is not None:
            if backpressure_detector is None:  # the release's factory ignored the tier's `backpressure` dict
                raise UsageError("backpressure_pattern = \"vllm\": this vLLM's tier factory builds no detector "
                                 "from a tier's `backpressure` dict")
            self.clock = step_clock.StepClock(step_s)
            step_clock.attach(self.clock)
            weakref.finalize(self, step_clock.detach, self.clock)  # a build that failed after this: detached at gc

    # -- lookups and requests ------------------------------------------------------------------
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        result = (LookupResult.HIT if key in self.chunks
                  else LookupResult.RETRY if key in self.storing else LookupResult.MISS)
        self.journal.lookups[result.name] += 1
        return result

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self.journal.new_requests[req_context.req_id] += 1
        if self.request_level:
            return RequestOffloadingContext(policy=OffloadPolicy.REQUEST_LEVEL)
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self.journal.finished_requests[req_context.req_id] += 1

    # -- jobs ------------------------------------------------------------------------------------
    def _into_deferred(self, job_id: int, chunk_ids: Iterable[int]) -> None:
        into = sorted(set(int(c) for c in chunk_ids) & self.journal.deferred_chunks)
        if into:
            self.journal.violations.append(
                f"no-promotion-into-released-chunk: job #{job_id} uses primary chunk(s) {into}, which a failed "
                f"promotion may still write (its deferred release is pending)")

    def submit_store(self, job_metadata: TransferJob) -> None:
        keys = tuple(job_metadata.keys)
        if self.clock is not None:  # submitted now on the step clock the detector's `update` reads
            job_metadata.submit_time = self.clock.now()
        outcome = self.store_script[self.store_jobs % len(self.store_script)]
        self.store_jobs += 1
        self._into_deferred(job_metadata.job_id, job_metadata.chunk_ids)
        self.journal.stores_in_flight[job_metadata.job_id] = len(keys)
        self.journal.store_sizes.append(len(keys))
        self.journal.failed_promotions.difference_update(keys)
        success = outcome != "fail"
        if success:
            data = {k: self.primary[int(c)].tobytes() for k, c in zip(keys, job_metadata.chunk_ids, strict=True)}
            if outcome == "late":  # kept when the job completes: lookups answer RETRY until then
                self.landing[job_metadata.job_id] = data
                self.storing.update(k for k in keys if k not in self.chunks)
            else:
                for key, value in data.items():
                    self.chunks.setdefault(key, value)
        result = JobResult(job_id=job_metadata.job_id, success=success, transfer_time=0.0,
                           transfer_bytes=len(keys) * self.block_size_bytes)
        self.pending.append(_Pending(result, self.steps + (LATE_STEPS if outcome == "late" else 0)))

    def submit_load(self, job_metadata: TransferJob) -> None:
        keys = tuple(job_metadata.keys)
        chunk_ids = tuple(int(c) for c in job_metadata.chunk_ids)
        outcome = self.load_script[self.load_jobs % len(self.load_script)]
        self.load_jobs += 1
        journal = self.journal
        self._into_deferred(job_metadata.job_id, chunk_ids)
        flying = {k for ks, _ in journal.loads_in_flight.values() for k in ks}
        flying_chunks = {c for _, cs in journal.loads_in_flight.values() for c in cs}
        twice = [k for k in keys if k in flying]
        if twice or flying_chunks & set(chunk_ids):
            journal.violations.append(
                f"no-chunk-promoted-twice: promotion job #{job_metadata.job_id} promotes {len(twice)} key(s) / "
                f"chunk(s) {sorted(flying_chunks & set(chunk_ids))} another promotion still has in flight")
        journal.loads_in_flight[job_metadata.job_id] = (keys, chunk_ids)
        loaded: tuple[Any, ...] = keys
        if outcome in ("fail", "defer"):
            loaded = ()
        elif outcome == "partial":
            loaded = keys[: len(keys) // 2]
        loaded = tuple(k for k in loaded if k in self.chunks)  # a key this tier lost fails too
        for key, chunk in zip(keys, chunk_ids, strict=True):
            if key in loaded:
                self.primary[chunk] = np.frombuffer(self.chunks[key], dtype=self.primary.dtype)
        success = len(loaded) == len(keys)
        event = threading.Event() if outcome == "defer" and not success else None
        result = JobResult(job_id=job_metadata.job_id, success=success,
                           successful_keys=None if success else loaded, transfer_time=0.0,
                           transfer_bytes=len(loaded) * self.block_size_bytes, deferred_release=event)
        self.pending.append(_Pending(result, self.steps + (LATE_STEPS if outcome == "late" else 0)))

    def get_finished_jobs(self) -> Iterable[JobResult]:
        done = [p.result for p in self.pending if p.due <= self.steps]
        self.pending = [p for p in self.pending if p.due > self.steps]
        journal = self.journal
        for result in done:
            if result.job_id in journal.stores_in_flight:
                del journal.stores_in_flight[result.job_id]
                for key, value in self.landing.pop(result.job_id, {}).items():
                    self.chunks.setdefault(key, value)
                    self.storing.discard(key)
                continue
            keys, chunk_ids = journal.loads_in_flight.pop(result.job_id)
            if not result.success:
                ok = set(result.successful_keys or ())
                journal.failed_promotions.update(k for k in keys if k not in ok)
                for key in keys:  # a chunk whose read failed is lost to this tier (else vLLM retries it forever)
                    if key not in ok:
                        self.chunks.pop(key, None)
                if result.deferred_release is not None:
                    failed_chunks = tuple(c for k, c in zip(keys, chunk_ids, strict=True) if k not in ok)
                    journal.deferred_chunks.update(failed_chunks)
                    self.deferred.append((result.deferred_release, failed_chunks, DEFER_STEPS))
        return done

    def on_schedule_end(self, context: Any) -> None:
        """One scheduler step ends: late jobs come nearer, deferred releases count down."""
        self.steps += 1
        if self.clock is not None:
            self.clock.tick()
        still = []
        for event, chunks, steps in self.deferred:
            if steps <= 1:
                self._release(event, chunks)
            else:
                still.append((event, chunks, steps - 1))
        self.deferred = still

    def _release(self, event: threading.Event, chunks: tuple[int, ...]) -> None:
        self.journal.deferred_chunks.difference_update(chunks)
        event.set()

    def shutdown(self) -> None:
        """vLLM's manager shuts its tiers down with the scheduler: the step clock is detached here."""
        if self.clock is not None:
            step_clock.detach(self.clock)
        super().shutdown()

    def has_pending_work(self) -> bool:
        return bool(self.pending or self.deferred)

    def drain_jobs(self) -> None:
        """vLLM's reset waits here: every job comes due now and every deferred release is set."""
        for p in self.pending:
            p.due = self.steps
        for event, chunks, _ in self.deferred:
            self._release(event, chunks)
        self.deferred = []


class ScriptedDetector(BackpressureDetector):
    """A backpressure detector under pressure exactly where its pattern says 0 (cycled over the store
    decisions vLLM asks for), whatever the store latencies: a run replays. It records every decision
    (allowed, number of blocks) for the backpressure invariants."""

    def __init__(self, pattern: str = "1", policy: Any = None) -> None:
        super().__init__(policy=policy or ScriptedPolicy())
        self.pattern = parse_pattern(pattern)
        self.asked = 0
        self.decisions: list[tuple[bool, int]] = []
        self.completions = 0
        self.failures = 0

    def next_decision(self) -> bool:
        return self.pattern[self.asked % len(self.pattern)]

    def should_store(self, num_blocks: int) -> bool:
        allowed = super().should_store(num_blocks)  # vLLM's own: asks the policy, records a skip
        self.asked += 1
        self.decisions.append((allowed, num_blocks))
        return allowed

    def on_store_completed(self, elapsed_s: float, num_bytes: int) -> None:
        self.completions += 1

    def on_store_failed(self) -> None:
        self.failures += 1

    def is_under_pressure(self) -> bool:
        return not self.next_decision()

    def reset(self) -> None:
        self.policy.reset()


class ScriptedPolicy(DropAccountingPolicy):
    """Store exactly when the detector is not under pressure; keeps a running total of what vLLM's
    detector reported skipped (vLLM's metrics pop the counters each step)."""

    def __init__(self) -> None:
        super().__init__()
        self.skipped_total = (0, 0)

    def should_store(self, detector: Any) -> bool:
        return not detector.is_under_pressure()

    def on_store_skipped(self, num_blocks: int) -> None:
        super().on_store_skipped(num_blocks)
        self.skipped_total = (self.skipped_total[0] + 1, self.skipped_total[1] + num_blocks)
