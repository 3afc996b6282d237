"""Two in-process engines sharing KV through vLLM's P2P tier: a producer (prefill) and a consumer (decode).

Each side is a whole kvdoctor harness (vLLM's real Scheduler, OffloadingConnector, TieringOffloadingSpec and
its P2P tier, compat/p2p_tier.py) with an identity of its own (`host:port`, its own VllmConfig and engine id).
The PD roles travel as a client's would, in `kv_transfer_params`: the producer's request names its decoder
(`remote_decoder.kv_request_id`), the consumer's its prefiller (`remote_prefiller`: the id, host and port).
kvdoctor stands in only for the two transports (compat/p2p_transport.py) and, as everywhere, for the model and
the copy engine; the tier runs with no poll thread (`tier_poll_interval_s = 0`), so the pair steps the two
schedulers in turn and every run replays. Faults (a plan's drops, delays, failed transfers, the producer's
death, the consumer's abort) are injected in the fabric or by the plan's steps, never inside vLLM.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Any

from kvdoctor.engine.compat import VllmApi
from kvdoctor.engine.compat.p2p_transport import FABRICS, Fabric, Faults
from kvdoctor.engine.harness import Harness
from kvdoctor.engine.setup import Setup
from kvdoctor.observe import p2p_invariants as inv

P2P_HOST = "kvdoctor-p2p"  # the peers' host name on the in-memory fabric (no socket is opened)
PRODUCER_PORT, CONSUMER_PORT = 1, 2
KV_REQUEST_ID = "kvdoctor-pd-0"
# once the pair is at rest, steps are played until the fabric has been quiet (nothing in flight) for SETTLE_STEPS
# steps in a row (at most SETTLE_LIMIT more), before "nothing pinned" is checked
SETTLE_STEPS, SETTLE_LIMIT = 3, 30
SYMMETRIC_LAG = 4  # steps between the symmetric consumer's warm-up request and its request
_fabric_names = itertools.count()


@dataclass(frozen=True)
class P2PPlan:
    """One PD exchange: the producer prefills `prompt_tokens`; the consumer's request (the prompt plus one
    token) arrives at step `consumer_at` (symmetric: `SYMMETRIC_LAG` steps later) and decodes `decode_tokens`.
    Faults: `drop` (control message types dropped), `delay_polls`, `fail_transfers`; `kill_producer_at` (the
    producer dies at that step); `abort_consumer_at` (the consumer's request is aborted at that step)."""

    prompt_tokens: int = 32
    decode_tokens: int = 3
    consumer_at: int = 2
    drop: tuple[str, ...] = ()
    delay_polls: int = 0
    fail_transfers: bool = False
    kill_producer_at: int | None = None
    abort_consumer_at: int | None = None
    max_steps: int = 40
    # symmetric P2P (`remote_kv_source`): the producer's request is an ordinary one (its chunks stay in its CPU
    # tier); the consumer probes the producer (LookupMsg) and fetches what hits. A warm-up request opens the
    # session first (a lookup before the handshake is answered MISS: vLLM prefills locally then).
    symmetric: bool = False


@dataclass
class P2PRun:
    """What a pair run did and which P2P promises it broke."""

    steps: int
    at_rest: bool
    consumer_finished: bool
    violations: list[str] = field(default_factory=list)
    loads: int = 0  # load jobs the consumer's tier was given
    loads_ok: int = 0
    loads_checked: int = 0  # successful loads whose bytes were compared
    writes: int = 0  # data-plane transfers the producer completed or failed
    messages: int = 0  # control messages delivered
    dropped: int = 0


def p2p_setup(base: Setup, fabric: str, port: int) -> Setup:
    """`base` with vLLM's tiering spec and the recorded P2P tier as its only secondary tier."""
    from kvdoctor.engine.compat.p2p_tier import TIER_CLASS, TIER_MODULE

    extra = dict(base.extra_connector_config)
    extra["tier_poll_interval_s"] = 0
    extra["secondary_tiers"] = [{"type": TIER_CLASS, "module_path": TIER_MODULE, "fabric": fabric,
                                 "host": P2P_HOST, "port": port}]
    return dataclasses.replace(base, spec_name="TieringOffloadingSpec", secondary_tier=None,
                               extra_connector_config=extra)


class P2PPair:
    """A producer and a consumer harness on one fabric; `run()` plays a plan and checks the invariants."""

    def __init__(self, api: VllmApi, plan: P2PPlan, base: Setup | None = None) -> None:
        self.api = api
        self.plan = plan
        self.fabric_name = f"kvdoctor-p2p-{next(_fabric_names)}"
        self.fabric = FABRICS[self.fabric_name] = Fabric(Faults(frozenset(plan.drop), plan.delay_polls,
                                                                plan.fail_transfers))
        base = base or Setup(block_size=4, gpu_blocks=32, max_model_len=128)
        self.producer = Harness(api, p2p_setup(base, self.fabric_name, PRODUCER_PORT))
        self.consumer = Harness(api, p2p_setup(base, self.fabric_name, CONSUMER_PORT))
        self.producer_id = f"{P2P_HOST}:{PRODUCER_PORT}"
        self.consumer_id = f"{P2P_HOST}:{CONSUMER_PORT}"
        self.producer_dead = False
        self.consumer_request_at = plan.consumer_at + (SYMMETRIC_LAG if plan.symmetric else 0)

    def tier(self, harness: Harness) -> Any:
        return self.api.tiering_manager_of(harness.connector_scheduler).secondary_tiers[0]

    def _journal(self, peer_id: str) -> Any:
        return self.fabric.journals[peer_id]

    def _step_checks(self) -> list[str]:
        found: list[str] = []
        for journal in self.fabric.journals.values():
            found += inv.double_results(journal) + inv.bytes_equal(journal)
        return found

    def _at_rest(self) -> bool:
        """The pair's requests have finished and every load the consumer's tier was given has a result."""
        sides = [self.consumer] + ([] if self.producer_dead else [self.producer])
        if any(harness.scheduler.get_num_unfinished_requests() for harness in sides):
            return False
        return not inv.rounds_ended(self._journal(self.consumer_id))

    def _sides_at_rest(self) -> list[inv.SideAtRest]:
        sides = [("consumer", self.consumer)] + ([] if self.producer_dead else [("producer", self.producer)])
        out = []
        for name, harness in sides:
            manager = self.api.tiering_manager_of(harness.connector_scheduler)
            out.append(inv.SideAtRest(name, self.api.tier_jobs_of(manager, self.tier(harness)),
                                      frozenset(self.api.tier_tracked_requests(manager)),
                                      bool(self.tier(harness).has_pending_work())))
        return out

    def step(self, index: int) -> None:
        plan = self.plan
        if index == plan.kill_producer_at:
            self.fabric.kill(self.producer_id)
            self.producer_dead = True
        role = "remote_kv_source" if plan.symmetric else "remote_prefiller"
        source = {"remote_host": P2P_HOST, "remote_port": PRODUCER_PORT}
        if plan.symmetric and index == plan.consumer_at:  # opens the session; its own prefix is not the producer's
            self.consumer.add("W", [1000 + t for t in range(8)], 1, {role: {"kv_request_id": "warm-up", **source}})
        if index == self.consumer_request_at:
            prompt = [*range(1, plan.prompt_tokens + 1), plan.prompt_tokens + 1]
            self.consumer.add("D", prompt, plan.decode_tokens, {role: {"kv_request_id": KV_REQUEST_ID, **source}})
        if index == plan.abort_consumer_at and "D" in self.consumer.scheduler.requests:
            self.consumer.abort("D")
        if not self.producer_dead:
            self.producer.step()
        self.consumer.step()

    def run(self) -> P2PRun:
        """Play the plan, then step until the pair is at rest (bounded by `max_steps`); check every step
        and at rest."""
        plan = self.plan
        self.producer.add("P", list(range(1, plan.prompt_tokens + 1)), 1,
                          None if plan.symmetric else {"remote_decoder": {"kv_request_id": KV_REQUEST_ID}})
        violations: list[str] = []
        index = 0
        last_event = max(x for x in (self.consumer_request_at, plan.kill_producer_at, plan.abort_consumer_at)
                         if x is not None)
        rest = False
        for index in range(plan.max_steps):
            self.step(index)
            violations += [v for v in self._step_checks() if v not in violations]
            if index >= last_event and self._at_rest():
                rest = True
                break
        if rest:  # the connector finalizes a finished request on the next step; the tiers report their last jobs
            quiet = 0
            while quiet < SETTLE_STEPS and index < plan.max_steps + SETTLE_LIMIT:
                index += 1
                self.step(index)
                violations += [v for v in self._step_checks() if v not in violations]
                quiet = quiet + 1 if self.fabric.quiet() else 0
        consumer = self._journal(self.consumer_id)
        if rest:
            violations += inv.rounds_ended(consumer) + inv.deferred_released(consumer)
            violations += inv.nothing_pinned(self._sides_at_rest())
        else:
            violations += inv.rounds_ended(consumer) or [
                f"{inv.ROUND_ENDS}: the pair's requests did not finish in {plan.max_steps} steps"]
        finished = "D" not in self.consumer.scheduler.requests
        return P2PRun(steps=index + 1, at_rest=rest, consumer_finished=finished, violations=violations,
                      loads=len(consumer.loads),
                      loads_ok=sum(1 for j, ok, _e in consumer.results if ok and j in consumer.loads),
                      loads_checked=consumer.loads_checked, writes=len(self.fabric.writes),
                      messages=len(self.fabric.sent), dropped=len(self.fabric.dropped))

    def shutdown(self) -> None:
        for harness in (self.consumer, self.producer):
            harness.shutdown()
        FABRICS.pop(self.fabric_name, None)


def run_pair(api: VllmApi, plan: P2PPlan, base: Setup | None = None) -> P2PRun:
    """Build a pair, play `plan`, shut both engines down."""
    pair = P2PPair(api, plan, base)
    try:
        return pair.run()
    finally:
        pair.shutdown()
