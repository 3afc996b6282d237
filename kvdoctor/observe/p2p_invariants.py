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

A recipe plays them through `P2P_CHECKS` (observe/invariants.py registers them with the others), after every
step of a `[setup] p2p = true` run, on what its harness reports (`PairState`); elsewhere they return nothing.
A recipe decides when the pair comes to rest, so the at-rest checks run at every step where it is *settled*:
neither side has an unfinished request, the consumer has no open load and nothing is in flight on the fabric,
after `SETTLE_STEPS` steps in a row (the connector finalizes a finished request on the next step, and the
tiers report their last jobs). A round that never ends keeps its request waiting, so the pair never settles:
`p2p-fetch-round-ends` also fires on a load still open `ROUND_BOUND_S` seconds of vLLM's P2P clock after the
tier was given it (vLLM's own bound: its 30 s load timeout, then 10 s for the AbortAck, 0.33-0.34's
`session/client.py`; a recipe reaches it with a `p2p_clock` step).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

ROUND_ENDS = "p2p-fetch-round-ends"
NOTHING_PINNED = "p2p-nothing-pinned"
BYTES_EQUAL = "p2p-consumer-bytes-equal"
DEFERRED_SET = "p2p-deferred-release-set"
P2P_INVARIANTS = (ROUND_ENDS, NOTHING_PINNED, BYTES_EQUAL, DEFERRED_SET)
SETTLE_STEPS = 3  # steps in a row with nothing in flight before a pair at rest is judged settled
ROUND_BOUND_S = 45.0  # vLLM's load timeout (30 s) + AbortAck timeout (10 s) + a margin, on vLLM's P2P clock


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


def open_loads(journal: Any) -> list[int]:
    """The load jobs the tier was given that have no result yet."""
    reported = {job for job, _ok, _event in journal.results}
    return sorted(set(journal.loads) - reported)


@dataclass(frozen=True)
class PairState:
    """What a P2P pair's harness reports after a step (engine/p2p.py `P2PHarness.pair_state`)."""

    journals: tuple[Any, ...]  # every tier's journal on the fabric
    consumer: Any  # the consumer tier's journal
    open_for_s: dict[int, float]  # each open load: seconds of vLLM's P2P clock since the tier was given it
    requests_done: bool  # neither live side has an unfinished request
    rest_steps: int  # steps in a row after which the fabric was quiet, requests done and no load open
    sides: Callable[[], list[SideAtRest]]  # what each live side's tiering manager still holds
    consumer_alive: bool = True  # False once the consumer's P2P endpoint died: its deferred releases die with it

    @property
    def settled(self) -> bool:
        return self.rest_steps >= SETTLE_STEPS


def _state(ctx: Any) -> PairState | None:
    report = getattr(ctx.harness, "pair_state", None)
    return report() if report is not None else None


def _round_ends(ctx: Any) -> list[str]:
    state = _state(ctx)
    if state is None:
        return []
    found = [v for journal in state.journals for v in double_results(journal)]
    stuck = sorted(job for job, age in state.open_for_s.items() if age >= ROUND_BOUND_S)
    if stuck:
        found.append(f"{ROUND_ENDS}: {state.consumer.local_id}'s load job(s) {stuck} have no result "
                     f"{max(state.open_for_s[j] for j in stuck):.0f} s (vLLM's P2P clock) after the tier was given "
                     f"them, past vLLM's load and AbortAck timeouts")
    return found


def _bytes_equal(ctx: Any) -> list[str]:
    state = _state(ctx)
    return [v for journal in state.journals for v in bytes_equal(journal)] if state is not None else []


def _nothing_pinned(ctx: Any) -> list[str]:
    state = _state(ctx)
    return nothing_pinned(state.sides()) if state is not None and state.settled else []


def _deferred_released(ctx: Any) -> list[str]:
    state = _state(ctx)
    return deferred_released(state.consumer) if state is not None and state.settled and state.consumer_alive else []


def _strip(check: Callable[[Any], list[str]], name: str) -> Callable[[Any], list[str]]:
    """A check whose messages drop their own invariant's name (a Violation carries it)."""
    return lambda ctx: [m.removeprefix(f"{name}: ") for m in check(ctx)]


# name -> (summary, check(StepContext) -> messages)
P2P_CHECKS: dict[str, tuple[str, Callable[[Any], list[str]]]] = {
    ROUND_ENDS: ("every load the P2P consumer's tier is given ends with exactly one result",
                 _strip(_round_ends, ROUND_ENDS)),
    NOTHING_PINNED: ("once the P2P pair has settled, neither tiering manager holds a P2P job, request state or "
                     "P2P work in flight", _strip(_nothing_pinned, NOTHING_PINNED)),
    BYTES_EQUAL: ("a P2P load reported successful left the producer's bytes for its keys in the consumer's chunks",
                  _strip(_bytes_equal, BYTES_EQUAL)),
    DEFERRED_SET: ("every deferred release the P2P tier handed out is set once its round ended",
                   _strip(_deferred_released, DEFERRED_SET)),
}
