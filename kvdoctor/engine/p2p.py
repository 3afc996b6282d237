"""Two in-process engines sharing KV through vLLM's P2P tier: a producer (prefill) and a consumer (decode).

Each side is a whole kvdoctor harness (vLLM's real Scheduler, OffloadingConnector, TieringOffloadingSpec and
its P2P tier, compat/p2p_tier.py) with an identity of its own (`host:port`, its own VllmConfig and engine id).
`P2PHarness` is the consumer's harness holding the producer beside it: a recipe with `[setup] p2p = true` plays
on it (its `schedule` steps both engines, its `p2p_*` steps drive the pair, kvdoctor/steps.py), and
`P2PPair` plays a `P2PPlan` (the tests' and explore's shape of one exchange) on the same harness. The pair's code
is written once over its sides' harness class (`side_class`): `P2PHarness` pairs two scheduler harnesses
(`--engine scheduler`), `CoreP2PHarness` two of vLLM's EngineCores (`CoreHarness`, `--engine core`), each with its
own VllmConfig, engine id and port on the same fabric and clock, stepped in turn.
The PD roles travel as a client's would, in `kv_transfer_params`: the producer's request names its decoder
(`remote_decoder.kv_request_id`), the consumer's its prefiller (`remote_prefiller`: the id, host and port).
kvdoctor stands in only for the two transports (compat/p2p_transport.py) and, as everywhere, for the model and
the copy engine; the tier runs with no poll thread (`tier_poll_interval_s = 0`), so the pair steps the two
schedulers in turn and every run replays. Faults (drops, delays, failed transfers, the producer's death, an
abort, vLLM's clock moved ahead) are injected in the fabric, the clock or by steps, never inside vLLM.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Any

from kvdoctor.engine.compat import VllmApi
from kvdoctor.engine.compat.p2p_clock import P2PClock, p2p_clock
from kvdoctor.engine.compat.p2p_transport import FABRICS, Fabric, Faults
from kvdoctor.engine.core.harness import CoreHarness
from kvdoctor.engine.harness import BuildCache, Harness
from kvdoctor.engine.setup import Setup
from kvdoctor.errors import InternalError
from kvdoctor.observe import p2p_invariants as inv

P2P_HOST = "kvdoctor-p2p"  # the peers' host name on the in-memory fabric (no socket is opened)
PRODUCER_PORT, CONSUMER_PORT = 1, 2
KV_REQUEST_ID = "kvdoctor-pd-0"
# a plan's run, once at rest, plays at most SETTLE_LIMIT more steps for the pair to settle
SETTLE_LIMIT = 30
SYMMETRIC_LAG = 4  # steps between the symmetric consumer's warm-up request and its request
_fabric_names = itertools.count()


def p2p_setup(base: Setup, fabric: str, port: int) -> Setup:
    """One side's setup: `base` with vLLM's tiering spec and the recorded P2P tier as its only secondary tier."""
    from kvdoctor.engine.compat.p2p_tier import TIER_CLASS, TIER_MODULE

    extra = dict(base.extra_connector_config)
    extra["tier_poll_interval_s"] = 0
    extra["secondary_tiers"] = [{"type": TIER_CLASS, "module_path": TIER_MODULE, "fabric": fabric,
                                 "host": P2P_HOST, "port": port}]
    return dataclasses.replace(base, spec_name="TieringOffloadingSpec", secondary_tier=None, p2p=False,
                               extra_connector_config=extra)


def transfer_params(side: str, role: str, kv_request_id: str) -> dict[str, Any] | None:
    """A request's `kv_transfer_params` as its client sends them: PD (the producer names its decoder, the
    consumer its prefiller), symmetric (the consumer names its source; the producer's request is plain), none."""
    source = {"kv_request_id": kv_request_id, "remote_host": P2P_HOST, "remote_port": PRODUCER_PORT}
    if role == "pd":
        return {"remote_decoder": {"kv_request_id": kv_request_id}} if side == "producer" else {
            "remote_prefiller": source}
    if role == "symmetric" and side == "consumer":
        return {"remote_kv_source": source}
    return None


class P2PHarness(Harness):
    """The consumer's harness, with the producer's beside it on one fabric and one P2P clock (see the module's
    docstring). What the recipe's own steps do (add, abort, checks, observation) is the consumer's. The producer
    is a `side_class` and the consumer's own engine is the next class in the MRO (`super()`): a subclass that
    also derives from another harness (`CoreP2PHarness`) pairs that harness's engines with this same code."""

    side_class: type[Harness] = Harness

    def __init__(self, api: VllmApi, setup: Setup, build_cache: BuildCache | None = None,
                 faults: Faults | None = None) -> None:
        self.fabric_name = f"kvdoctor-p2p-{next(_fabric_names)}"
        self.fabric = FABRICS[self.fabric_name] = Fabric(faults or Faults())
        self.clock = P2PClock()
        self._scope = contextlib.ExitStack()
        self.producer: Harness | None = None
        try:  # the sides' setups name their fabric: explore's build cache (per setup) is not used
            self._scope.enter_context(p2p_clock(self.clock))
            self.producer = self.side_class(api, p2p_setup(setup, self.fabric_name, PRODUCER_PORT))
            super().__init__(api, p2p_setup(setup, self.fabric_name, CONSUMER_PORT))
        except BaseException:
            self._release()
            raise
        self.producer_id = f"{P2P_HOST}:{PRODUCER_PORT}"
        self.consumer_id = f"{P2P_HOST}:{CONSUMER_PORT}"
        self.producer_dead = False
        self.consumer_dead = False  # its P2P endpoint killed (`p2p_kill` side = "consumer"): no longer judged at rest
        self.quiet_steps = 0  # steps in a row after which nothing was in flight on the fabric
        self.rest_steps = 0  # steps in a row after which, besides, no request was unfinished and no load open
        self.load_seen: dict[int, float] = {}  # load job -> vLLM's P2P clock when a step first saw it

    def _producer(self) -> Harness:
        if self.producer is None:
            raise InternalError("the P2P pair has no producer (its build failed)")
        return self.producer

    def side(self, name: str) -> Harness:
        return self._producer() if name == "producer" else self

    def tier(self, harness: Harness) -> Any:
        return self.api.tiering_manager_of(harness.connector_scheduler).secondary_tiers[0]

    def step(self) -> Any:
        """Both engines' steps, the producer's first (a dead producer no longer steps); the consumer's events."""
        if not self.producer_dead:
            self._producer().step()
        events = super().step()
        self.quiet_steps = self.quiet_steps + 1 if self.fabric.quiet() else 0
        for job in inv.open_loads(self._journal()):
            self.load_seen.setdefault(job, self.clock.now())
        # a producer's store parked for a fetch still to come is vLLM's bounded wait (its unbound-store timeout
        # reaps it), not rest: the at-rest checks wait for it (a dropped fetch with the consumer's request aborted
        # came to rest with it parked, and p2p-nothing-pinned fired before vLLM's timeout: kvdoctor's own error)
        parked = not self.producer_dead and self.api.p2p_parked_stores(self.tier(self._producer()))
        at_rest = (self.quiet_steps and self.requests_done() and not inv.open_loads(self._journal())
                   and not parked)
        self.rest_steps = self.rest_steps + 1 if at_rest else 0
        return events

    def _journal(self) -> Any:
        return self.fabric.journals[self.consumer_id]

    def p2p(self, action: str, args: dict[str, Any]) -> None:
        """One `p2p_*` step (kvdoctor/steps.py); an add's `prompt` is the compiler's. Each starts what the pair
        must come to rest from again (a producer's request parks its store for a consumer still to come)."""
        self.rest_steps = 0
        if action == "add":
            side = args["side"]
            params = transfer_params(side, args.get("role", "pd"), args.get("kv_request_id", KV_REQUEST_ID))
            self.side(side).add(args["request"], list(args["prompt"]), args.get("max_tokens", 1), params)
        elif action == "abort":
            harness = self.side(args["side"])
            if args["request"] in harness.scheduler.requests:  # a finished request is gone: nothing to abort
                harness.abort(args["request"])
        elif action == "kill" and args.get("side") == "consumer":
            # the consumer's P2P endpoint dies: the producer sees the consumer die (its connections read dead at
            # the next poll, nothing arrives from it, its data agent is gone); the recipe's own engine keeps
            # stepping with its P2P tier cut off (kvdoctor does not stop the engine the recipe observes), and what
            # its cut-off tier still holds is not judged: a dead consumer's state dies with it
            self.fabric.kill(self.consumer_id)
            self.consumer_dead = True
        elif action == "kill":
            self.fabric.kill(self.producer_id)
            self.producer_dead = True
        elif action == "fabric":
            self.fabric.faults = Faults(frozenset(args.get("drop", ())), args.get("delay_polls", 0),
                                        bool(args.get("fail_transfers", False)))
        elif action == "clock":
            self.clock.advance(float(args["advance_s"]))
        else:
            raise InternalError(f"p2p_{action}: no such P2P step")

    def requests_done(self) -> bool:
        sides = [self] + ([] if self.producer_dead else [self._producer()])
        return not any(harness.scheduler.get_num_unfinished_requests() for harness in sides)

    def sides_at_rest(self) -> list[inv.SideAtRest]:
        sides = (([] if self.consumer_dead else [("consumer", self)])
                 + ([] if self.producer_dead else [("producer", self._producer())]))
        out = []
        for name, harness in sides:
            manager = self.api.tiering_manager_of(harness.connector_scheduler)
            out.append(inv.SideAtRest(name, self.api.tier_jobs_of(manager, self.tier(harness)),
                                      frozenset(self.api.tier_tracked_requests(manager)),
                                      bool(self.tier(harness).has_pending_work())))
        return out

    def pair_state(self) -> inv.PairState:
        """What the P2P invariants read after a step (observe/p2p_invariants.py)."""
        now = self.clock.now()
        ages = {job: now - self.load_seen.get(job, now) for job in inv.open_loads(self._journal())}
        return inv.PairState(tuple(self.fabric.journals.values()), self._journal(), ages, self.requests_done(),
                             self.rest_steps, self.sides_at_rest, not self.consumer_dead)

    def _release(self) -> None:
        with contextlib.suppress(Exception):
            if self.producer is not None:
                self.producer.shutdown()
        FABRICS.pop(self.fabric_name, None)
        self._scope.close()

    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            self._release()


class CoreP2PHarness(P2PHarness, CoreHarness):
    """The pair at `--engine core`: two of vLLM's EngineCores in-process (each `CoreHarness`'s), the producer's
    and the consumer's, stepped in turn by `P2PHarness`' own code (each `step` is that engine's step_fn)."""

    side_class = CoreHarness


@dataclass(frozen=True)
class P2PPlan:
    """One PD exchange: the producer prefills `prompt_tokens`; the consumer's request (the prompt plus one
    token) arrives at step `consumer_at` (symmetric: `SYMMETRIC_LAG` steps later) and decodes `decode_tokens`.
    Faults: `drop` (control message types dropped), `delay_polls`, `fail_transfers`; `kill_producer_at` (the
    producer dies at that step); `kill_consumer_at` (the consumer's P2P endpoint dies at that step: see
    `P2PHarness.p2p`); `abort_consumer_at` (the consumer's request is aborted at that step)."""

    prompt_tokens: int = 32
    decode_tokens: int = 3
    consumer_at: int = 2
    drop: tuple[str, ...] = ()
    delay_polls: int = 0
    fail_transfers: bool = False
    kill_producer_at: int | None = None
    kill_consumer_at: int | None = None
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


DEFAULT_BASE = Setup(block_size=4, gpu_blocks=32, max_model_len=128)


class P2PPair:
    """A `P2PPlan` played on a `P2PHarness` (`CoreP2PHarness`: on two EngineCores); `run()` checks the invariants
    every step and once settled."""

    def __init__(self, api: VllmApi, plan: P2PPlan, base: Setup | None = None,
                 harness_class: type[P2PHarness] = P2PHarness) -> None:
        self.api = api
        self.plan = plan
        self.harness = harness_class(api, base or DEFAULT_BASE,
                                     faults=Faults(frozenset(plan.drop), plan.delay_polls, plan.fail_transfers))
        self.fabric = self.harness.fabric
        self.producer_id, self.consumer_id = self.harness.producer_id, self.harness.consumer_id
        self.consumer_request_at = plan.consumer_at + (SYMMETRIC_LAG if plan.symmetric else 0)

    def step(self, index: int) -> None:
        plan, harness = self.plan, self.harness
        role = "symmetric" if plan.symmetric else "pd"
        if index == plan.kill_producer_at:
            harness.p2p("kill", {"side": "producer"})
        if index == plan.kill_consumer_at:
            harness.p2p("kill", {"side": "consumer"})
        if plan.symmetric and index == plan.consumer_at:  # opens the session; its own prefix is not the producer's
            harness.p2p("add", {"side": "consumer", "request": "W", "prompt": [1000 + t for t in range(8)],
                                "role": role, "kv_request_id": "warm-up"})
        if index == self.consumer_request_at:
            harness.p2p("add", {"side": "consumer", "request": "D", "prompt": list(range(1, plan.prompt_tokens + 2)),
                                "max_tokens": plan.decode_tokens, "role": role})
        if index == plan.abort_consumer_at:
            harness.p2p("abort", {"side": "consumer", "request": "D"})
        harness.step()

    def _step_checks(self) -> list[str]:
        journals = self.harness.pair_state().journals
        return [v for journal in journals for v in inv.double_results(journal) + inv.bytes_equal(journal)]

    def run(self) -> P2PRun:
        """Play the plan, then step until the pair is at rest (bounded by `max_steps`) and settled; check every
        step and once settled."""
        plan, harness = self.plan, self.harness
        harness.p2p("add", {"side": "producer", "request": "P", "prompt": list(range(1, plan.prompt_tokens + 1)),
                            "role": "none" if plan.symmetric else "pd"})
        violations: list[str] = []
        index = 0
        last_event = max(x for x in (self.consumer_request_at, plan.kill_producer_at, plan.kill_consumer_at,
                                             plan.abort_consumer_at)
                         if x is not None)
        rest = False
        for index in range(plan.max_steps):
            self.step(index)
            violations += [v for v in self._step_checks() if v not in violations]
            state = harness.pair_state()
            if index >= last_event and state.requests_done and not inv.open_loads(state.consumer):
                rest = True
                break
        if rest:  # the connector finalizes a finished request on the next step; the tiers report their last jobs
            settle_from = index
            while not harness.pair_state().settled and index < settle_from + SETTLE_LIMIT:
                index += 1
                self.step(index)
                violations += [v for v in self._step_checks() if v not in violations]
        state = harness.pair_state()
        if rest:
            violations += inv.rounds_ended(state.consumer) + (
                inv.deferred_released(state.consumer) if state.consumer_alive else [])
            violations += inv.nothing_pinned(state.sides())
        else:
            violations += inv.rounds_ended(state.consumer) or [
                f"{inv.ROUND_ENDS}: the pair's requests did not finish in {plan.max_steps} steps"]
        consumer = state.consumer
        return P2PRun(steps=index + 1, at_rest=rest, consumer_finished="D" not in harness.scheduler.requests,
                      violations=violations, loads=len(consumer.loads),
                      loads_ok=sum(1 for j, ok, _e in consumer.results if ok and j in consumer.loads),
                      loads_checked=consumer.loads_checked, writes=len(self.fabric.writes),
                      messages=len(self.fabric.sent), dropped=len(self.fabric.dropped))

    def shutdown(self) -> None:
        self.harness.shutdown()


def run_pair(api: VllmApi, plan: P2PPlan, base: Setup | None = None,
             harness_class: type[P2PHarness] = P2PHarness) -> P2PRun:
    """Build a pair, play `plan`, shut both engines down."""
    pair = P2PPair(api, plan, base, harness_class)
    try:
        return pair.run()
    finally:
        pair.shutdown()
