"""The P2P tier's promises, checked on a producer/consumer pair (engine/p2p.py), issue 36.

Each is a promise vLLM's P2P tier makes in its own words (0.34, `vllm/v1/kv_offload/tiering/`):
- p2p-fetch-round-ends: every load the consumer's tier is given ends with exactly one result, success or
  failure (`SecondaryTierManager.get_finished_jobs`; the session's load timeout, AbortAck and close exist so
  that no round waits forever).
- p2p-nothing-pinned: once the pair's requests have finished and its rounds ended, neither tiering manager
  holds a P2P job (each pins its primary chunks), per-request tier state, or P2P work in flight
  (`has_pending_work`: stores parked for a consumer, live rounds).
- p2p-consumer-bytes-equal: a load reported successful left, in each of the consumer's primary chunks, the
  bytes the producer held for the same offload key (the data plane's promise; the producer's bytes are a stamp
  of the key, see compat/p2p_tier.py).
- p2p-deferred-release-set: every `JobResult.deferred_release` the tier handed out is set by the time its round
  ended: by the peer's AbortAck or, when the session died, by the session's close ("the end of the session is
  the release point for every load already reported failed", ClientRole.close; `drain_jobs`' contract).
The checks read plain records (the tier's journal, counts the pair read through compat), never vLLM objects.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

ROUND_ENDS = "p2p-fetch-round-ends"
NOTHING_PINNED = "p2p-nothing-pinned"
BYTES_EQUAL = "p2p-consumer-bytes-equal"
DEFERRED_SET = "p2p-deferred-release-set"
P2P_INVARIANTS = (ROUND_ENDS, NOTHING_PINNED, BYTES_EQUAL, DEFERRED_SET)


@dataclass(frozen=True)
class SideAtRest:
    """One engine's P2P side once the pair is at rest: what its tiering manager still holds."""

    name: str  # "producer" / "consumer"
    p2p_jobs: int  # the tiering manager's jobs for the P2P tier
    tracked_requests: frozenset[str]  # request ids the tiering manager keeps state for
    pending_work: bool  # the P2P tier's has_pending_work()


def double_results(journal: Any) -> list[str]:
    """Checked every step: no job reported twice (a round ends once)."""
    counts = Counter(job for job, _ok, _event in journal.results)
    return [f"{ROUND_ENDS}: {journal.local_id} reported job #{job} {n} times" for job, n in counts.items() if n > 1]


def rounds_ended(journal: Any) -> list[str]:
    """At rest: every load the tier was given has a result."""
    reported = {job for job, _ok, _event in journal.results}
    open_loads = sorted(set(journal.loads) - reported)
    return [f"{ROUND_ENDS}: {journal.local_id}'s load job(s) {open_loads} never ended (no result after the pair "
            f"came to rest)"] if open_loads else []


def bytes_equal(journal: Any) -> list[str]:
    """Checked every step: no successful load left other bytes than the producer's for its key."""
    if not journal.byte_mismatches:
        return []
    job, _key, chunk = journal.byte_mismatches[0]
    return [f"{BYTES_EQUAL}: {journal.local_id}'s load job #{job} reported success but primary chunk {chunk} does "
            f"not hold the producer's bytes for its key ({len(journal.byte_mismatches)} chunk(s) in all)"]


def deferred_released(journal: Any) -> list[str]:
    """At rest: every deferred release this tier reported is set."""
    unset = [job for job, _ok, event in journal.results if event is not None and not event.is_set()]
    return [f"{DEFERRED_SET}: {journal.local_id}'s failed load job(s) {unset} still defer their release after the "
            f"round ended"] if unset else []


def nothing_pinned(sides: Iterable[SideAtRest]) -> list[str]:
    """At rest: neither side holds P2P jobs, request state or P2P work."""
    found: list[str] = []
    for side in sides:
        held = []
        if side.p2p_jobs:
            held.append(f"{side.p2p_jobs} P2P job(s) pinning primary chunks")
        if side.tracked_requests:
            held.append(f"tier state of request(s) {sorted(side.tracked_requests)}")
        if side.pending_work:
            held.append("P2P work in flight (has_pending_work)")
        if held:
            found.append(f"{NOTHING_PINNED}: the {side.name} still holds " + ", ".join(held)
                         + " after its requests finished and the rounds ended")
    return found
