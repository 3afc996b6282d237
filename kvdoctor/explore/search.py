"""The search: `hypothesis.find` once per new failure signature, in one or more processes.

Each round calls `hypothesis.find(examples(...), condition)`. The condition
runs the example's recipe on the real scheduler, under its drawn scheduling
mode and then the other one (sync and async: one hypothesis draw, two runs),
and is true for a failure whose signature no earlier round found. The first such failure *locks* the
round on its signature: while hypothesis shrinks, only that signature counts,
so the shrunk example fails the same way (it cannot slide to another bug).
`find` returns the minimal example; the next round starts afresh with that
signature excluded (an invariant already found is no longer checked, so runs go
on past it to whatever else breaks). Rounds stop when the example budget (`max_examples`
generated examples, shrinking not counted) or the time budget is spent; a
round still shrinking when time runs out gets `shrink_grace` more seconds
(never past `stop_at`, the whole run's end) and is then cut short, keeping the
smallest failing example seen so far.

`--workers N` runs N such searches in spawned processes (one vLLM import
each) with distinct seeds; the parent merges their findings by signature.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvdoctor.engine import compat
from kvdoctor.engine.compat.speculative import EAGLE_BLOCK_DROP, LOOKAHEAD_BLOCK_HASHES
from kvdoctor.engine.harness import BuildCache, Harness
from kvdoctor.engine.setup import Setup
from kvdoctor.errors import InternalError, UsageError
from kvdoctor.explore import DEFAULT_MAX_EVENTS, DEFAULT_MAX_EXAMPLES, DEFAULT_SEED, DEFAULT_TIME_BUDGET
from kvdoctor.explore.aim import DEFAULT_LAYOUT_NAME, forced_layouts
from kvdoctor.explore.findings import (
    Finding,
    finding_key,
    finding_recipe,
    merge,
    path_of,
    step_actions,
    summary_text,
)
from kvdoctor.explore.generate import (
    ARC,
    EVENTS_DRAW,
    EXTENSION_GATE,
    GEOMETRY_RANGES,
    LOAD_CAPS,
    NO_LOOKAHEAD_HASHES,
    PD_DRAW,
    PREFIX_MATCH_UNIT,
    PRIORITY,
    RECOMPUTE,
    RETENTION,
    SECOND_GATE,
    SELF_DESCRIBING_DRAW,
    SLEEP_DRAW,
    SLEEP_KEEPS_CONNECTOR,
    SPECS,
    SPECULATIVE_DRAW,
    SYNC_LOADS,
    TIER_DRAW,
    WITHHELD_DRAW,
    WORKERS_DRAW,
    Example,
    examples,
    mode_variants,
    to_recipe,
)
from kvdoctor.explore.runner import InvalidExample, Observation, observe, setup_of
from kvdoctor.explore.tier_draw import (
    EXAMPLE_TIER_DRAW,
    OBJSTORE_DRAW,
    P2P_EVERY,
    P2P_SETUP,
    P2P_TIER_DRAW,
    SCRIPTED_TIER_DRAW,
    VLLM_BACKPRESSURE_DRAW,
)
from kvdoctor.observe.invariants import INVARIANTS
from kvdoctor.observe.line_coverage import Executed, LineCoverage, merge_executed

SHRINK_GRACE_S = 30.0
PROGRESS_EVERY_S = 0.2


@dataclass
class ExploreConfig:
    seed: int = DEFAULT_SEED
    logic: str = "installed"
    max_examples: int | None = DEFAULT_MAX_EXAMPLES  # per worker; None: until the time budget is spent
    time_budget: float = DEFAULT_TIME_BUDGET  # seconds; the whole run's when stop_at is set (explore.app does)
    max_events: int = DEFAULT_MAX_EVENTS
    workers: int = 1
    shrink_grace: float = SHRINK_GRACE_S
    invariants: tuple[str, ...] | None = None  # None: every registered invariant
    both_modes: bool = True  # run every sequence under sync and async scheduling (drawn mode first)
    triage: bool = True  # rerun each finding without the connector and check what the harness did
    worker: str = "simulated"  # "vllm": vLLM's worker-role connector on real KV tensors, content checked
    # wall-clock time (time.time(), shared by spawned workers) when the whole run must end, vLLM's
    # import and triage included: no search or shrinking runs past it (None: only time_budget counts)
    stop_at: float | None = None
    # Draw speculative decoding (`generate.decode_speculative`): None where the release has 0.34's
    # speculative machinery in the offloading path (probed), True / False to force it either way.
    speculative: bool | None = None
    # `--ray ADDRESS`: the workers run as Ray tasks (`ray_pool.RayPool`: "local", "auto" or an address);
    # None: local processes. Under Ray, workers = 0 means one per slot of the cluster.
    ray: str | None = None
    # The hunt's aim (`--target EXC:FUNCTION`): only failures of that exception in that function count; others
    # are run past. None: every failure counts.
    target: tuple[str, str] | None = None
    # Draws forced on whatever the release's probes say (`--force`, names of FORCEABLE).
    force: frozenset[str] = frozenset()
    # Known bugs whose trigger a finding must not go through (`--exclude-trigger K1,K6`): such a run is that
    # bug's route to the site, not a new one, and is run past.
    exclude_triggers: frozenset[str] = frozenset()
    # `--coverage`: measure the connector's line coverage (`kvdoctor.observe.line_coverage`) in every worker and
    # steer the search towards examples that reach more of it (hypothesis' `target`, its target phase on).
    # Off, nothing is measured and the examples a seed generates are the same as without the option.
    coverage: bool = False


# `--force NAME` -> the draw it turns on (generate's feature names); explore.aim.FORCE_NAMES lists the same names.
FORCEABLE = {"speculative": SPECULATIVE_DRAW, "fs-tier": TIER_DRAW, "workers": WORKERS_DRAW,
             "withheld-hashes": WITHHELD_DRAW, "pd-decode": PD_DRAW, "sleep-wake": SLEEP_DRAW}


def sleep_refusal(api: Any) -> str | None:
    """Why `--force sleep-wake` cannot be played here (None: it can): the installed EngineCore has no sleep mode
    (a probe: sleep / wake_up / is_sleeping)."""
    if api.engine_sleep_mode() is not None:
        return None
    return ("--force sleep-wake: this vLLM's EngineCore has no sleep mode (sleep / wake_up / is_sleeping), so "
            "explore cannot play sleep/wake")


def wanted(config: ExploreConfig, obs: Observation) -> bool:
    """Whether a run's failure is one the search aims at (`target`)."""
    if config.target is None:
        return True
    exception, function = config.target
    return obs.exception == exception and (not function or obs.function == function)


@dataclass
class Stats:
    """Counters of one worker (or, summed, of the whole run)."""

    examples: int = 0  # generated examples run
    shrink_examples: int = 0  # examples run while shrinking
    runs: int = 0  # scenario runs (an example runs once per scheduling mode)
    invalid: int = 0  # examples vLLM refused (should stay 0)
    scheduler_steps: int = 0
    shrink_steps: int = 0  # of which while shrinking
    run_seconds: float = 0.0  # time inside the scheduler runs (the rest is hypothesis)
    shrink_seconds: float = 0.0  # wall time spent shrinking
    elapsed: float = 0.0
    failures: int = 0
    excluded: int = 0  # failing runs through an excluded bug's trigger (`--exclude-trigger`), run past
    sleep_examples: int = 0  # `--force sleep-wake`: generated examples with sleep / wake_up steps (played at core)
    connector_lines: int = 0  # --coverage: connector lines this worker's examples reached (new to it)
    phase: str = "starting"
    done: bool = False

    @property
    def steps_per_second(self) -> float:
        return self.scheduler_steps / self.elapsed if self.elapsed > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class ExploreResult:
    vllm_version: str
    config: ExploreConfig
    findings: list[Finding] = field(default_factory=list)
    stats: Stats = field(default_factory=Stats)
    worker_stats: list[Stats] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    error_codes: list[int | None] = field(default_factory=list)  # a KvdoctorError's exit code, else None
    lost: list[str] = field(default_factory=list)  # shares not searched: a worker lost or stopped, and why
    workers: list[WorkerIdentity] = field(default_factory=list)  # who reported ready, where (pool runs)
    coverage: Executed | None = None  # --coverage: the connector lines every worker executed, merged
    api: Any = None  # the in-process vLLM adapter (one worker), for the triage reruns


class _StopExploring(BaseException):
    """Raised from inside `find` when the budget is spent (BaseException: hypothesis lets it through)."""


@contextmanager
def draws_named_by_seed() -> Iterator[None]:
    """Draw without the constants Hypothesis mines from the "local" modules loaded in the process.

    Hypothesis (6.1xx) mixes such constants into its draws, so one seed gave different examples
    depending on which of kvdoctor's modules happened to be imported: `explore --seed 1` found K2 alone,
    but not inside the test suite (measured on 0.26.0: only K1), and a wheel install has no local
    modules at all. The seed must name the examples, so the search runs with an empty local pool
    (a scoped swap of Hypothesis' private `_get_local_constants`, restored after; where this Hypothesis
    has no such function there is nothing to swap)."""
    try:
        from hypothesis.internal.conjecture import providers
    except ImportError:  # pragma: no cover - a Hypothesis without the provider module
        yield
        return
    original = getattr(providers, "_get_local_constants", None)
    cache = getattr(getattr(providers, "CONSTANTS_CACHE", None), "cache", None)
    if original is None or not hasattr(providers, "Constants"):
        yield
        return
    empty = providers.Constants()
    providers._get_local_constants = lambda: empty
    if cache is not None:
        cache.clear()
    try:
        yield
    finally:
        providers._get_local_constants = original
        if cache is not None:
            cache.clear()


def example_seed(seed: int, worker: int, round_: int) -> int:
    return random.Random(f"kvdoctor-explore:{seed}:{worker}:{round_}").getrandbits(63)


def worker_search(api: Any, config: ExploreConfig, worker: int = 0,
                  on_progress: Callable[[Stats], None] | None = None,
                  on_finding: Callable[[Finding], None] | None = None,
                  trace: list[tuple[Any, Observation, bool]] | None = None,
                  lines: LineCoverage | None = None) -> tuple[list[Finding], Stats]:
    """One worker's rounds of `find`; `trace` (if given) collects every run as
    (recipe, observation, whether it ran while shrinking). `lines` (with `config.coverage`): the
    connector's line coverage, measuring; each generated example's reach is hypothesis' `target`."""
    from hypothesis import HealthCheck, Phase, Verbosity, find, settings, target
    from hypothesis.errors import HypothesisException, NoSuchExample

    stats = Stats(phase="searching")
    found: dict[str, Finding] = {}
    specs = available_specs(api)
    features = available_features(api)
    if config.speculative is not None:
        features = features | {SPECULATIVE_DRAW} if config.speculative else features - {SPECULATIVE_DRAW}
    features = features | {FORCEABLE[name] for name in config.force if name in FORCEABLE}
    sleep_draw = SLEEP_DRAW in features
    if sleep_draw and (why := sleep_refusal(api)):
        raise UsageError(why)
    layouts = drawn_layouts(api, config.force)
    strategy = examples(config.max_events, extended=EXTENSION_GATE in features, second=SECOND_GATE in features,
                        speculative=SPECULATIVE_DRAW in features, workers=WORKERS_DRAW in features,
                        tier=TIER_DRAW in features, events=EVENTS_DRAW in features)
    setups: dict[Any, Any] = {}  # geometry -> Setup, resolved once as `repro` resolves a recipe's [setup]
    meter = lines if config.coverage else None  # measuring this search's examples (steering it)
    steering = meter is not None
    if meter is not None:
        meter.mark_seen()  # vLLM's import and the warm-up are not what the search reached
    builds = BuildCache()  # this search's: each run still builds a fresh scheduler, connector and worker
    start = time.monotonic()
    deadline = start + config.time_budget
    hard_stop = deadline + config.shrink_grace
    if config.stop_at is not None:  # the run's end, on this process' clock
        end = start + (config.stop_at - time.time())
        deadline, hard_stop = min(deadline, end), min(hard_stop, end)
    last_report = 0.0

    def report(force: bool = False) -> None:
        nonlocal last_report
        now = time.monotonic()
        stats.elapsed = now - start
        if on_progress is not None and (force or now - last_report >= PROGRESS_EVERY_S):
            last_report = now
            on_progress(stats)

    limit = config.max_examples if config.max_examples is not None else 10**9
    # its own branch: where the feature is absent (or a hunt aims elsewhere) nothing of it runs or draws
    pair = (P2PBranch(api, config, worker, start)
            if P2P_TIER_DRAW in features and config.target is None and SLEEP_DRAW not in features else None)
    # the target phase only where something is targeted: without --coverage the phases, so the draws, are as before
    phases = (Phase.generate, Phase.target, Phase.shrink) if steering else (Phase.generate, Phase.shrink)
    round_ = 0
    while stats.examples < limit and time.monotonic() < deadline:
        round_ += 1
        seed_here = example_seed(config.seed, worker, round_)
        lock: dict[str, Any] = {"signature": None, "best": None}
        budget_left = limit - stats.examples
        # An invariant already found is not checked again: a run goes on past it, to what else breaks.
        invariants = tuple(name for name in (INVARIANTS if config.invariants is None else config.invariants)
                           if not any(f.signature == f"invariant {name}" for f in found.values()))

        # this round's lock and invariants, bound now (hypothesis calls it only within the round)
        def condition(raw: Any, lock: dict[str, Any] = lock, invariants: tuple[str, ...] = invariants) -> bool:
            now = time.monotonic()
            shrinking = lock["signature"] is not None
            if (not shrinking and now >= deadline) or now >= hard_stop:
                raise _StopExploring()
            if not shrinking and stats.examples >= limit:
                raise _StopExploring()
            runs: list[tuple[Any, Observation]] = []
            if meter is not None:
                meter.begin_example()
            decoded = Example.decode(raw, specs, config.worker, features, layouts)
            for example in mode_variants(decoded, config.both_modes):
                recipe = to_recipe(example)
                t0 = time.perf_counter()
                try:
                    if example.geometry not in setups:
                        setups[example.geometry] = setup_of(recipe)
                    obs = observe(api, recipe, config.logic, invariants, setups[example.geometry], builds)
                except InvalidExample:
                    stats.invalid += 1
                    continue
                finally:
                    stats.run_seconds += time.perf_counter() - t0
                runs.append((recipe, obs))
                stats.runs += 1
                stats.scheduler_steps += obs.scheduler_steps
                if shrinking:
                    stats.shrink_steps += obs.scheduler_steps
                if trace is not None:
                    trace.append((recipe, obs, shrinking))
            if meter is not None:
                reached, new = meter.end_example()
                stats.connector_lines += new
                if not shrinking:  # hypothesis favours (mutates) the examples that reach the most connector lines
                    target(float(reached), label="connector lines reached")
            if shrinking:
                stats.shrink_examples += 1
            else:
                stats.examples += 1
                if sleep_draw and any(obs.engine == "core" for _, obs in runs):
                    stats.sleep_examples += 1
                if pair is not None and stats.examples % P2P_EVERY == 0:
                    p2p_finding = pair.play_next(stats)
                    if p2p_finding is not None and p2p_finding.key not in found:
                        found[p2p_finding.key] = p2p_finding
                        stats.failures = len(found)
                        if on_finding is not None:
                            on_finding(p2p_finding)
            report()
            locked = lock["signature"]
            for recipe, obs in runs:  # the drawn scheduling mode first
                if obs.signature is None or not wanted(config, obs):
                    continue
                path = path_of(obs, recipe)
                if path and path in config.exclude_triggers:
                    stats.excluded += 1
                    continue
                key = finding_key(obs.signature, path, obs.engine)
                if key in found or (locked and key != locked):
                    continue
                if locked is None:
                    lock["signature"] = key
                    lock["since"] = time.monotonic()
                    stats.phase = f"shrinking {key}"
                    report(force=True)
                lock["best"] = (recipe, obs, path)  # each success while shrinking is hypothesis' new smallest
                return True
            return False

        outcome: tuple[Any, Observation, str] | None = None
        exhausted = False
        flaky = False
        try:
            with draws_named_by_seed():
                find(strategy, condition, random=random.Random(seed_here), settings=settings(
                    max_examples=max(1, budget_left), database=None, deadline=None, verbosity=Verbosity.quiet,
                    phases=phases, suppress_health_check=list(HealthCheck)))
            # find() ends by running the minimal example once more: the last success is its run.
            outcome = lock["best"]
        except NoSuchExample:
            exhausted = True
        except _StopExploring:
            outcome = lock["best"]
            exhausted = True
        except HypothesisException as exc:  # Flaky: keep the smallest failure seen, marked; Unsatisfiable: stop
            outcome = lock["best"]
            exhausted = outcome is None
            flaky = type(exc).__name__.startswith("Flaky")
        if lock.get("since") is not None:
            stats.shrink_seconds += time.monotonic() - lock["since"]
        if outcome is not None:
            recipe, obs, path = outcome
            assert obs.signature is not None
            summary = summary_text(obs, config.seed, seed_here, worker, round_, config.logic, api.version_text,
                                   step_actions(recipe.steps), recipe.setup)
            finding = Finding(signature=obs.signature, kind=obs.kind, detail=obs.detail,
                              recipe=finding_recipe(recipe, obs, summary), seed=config.seed,
                              example_seed=seed_here, worker=worker, round=round_, logic=config.logic,
                              vllm_version=api.version_text, examples_before=stats.examples,
                              elapsed_s=time.monotonic() - start, flaky=flaky, path=path, engine=obs.engine)
            found[finding.key] = finding
            stats.failures = len(found)
            if on_finding is not None:
                on_finding(finding)
        stats.phase = "searching"
        if exhausted:
            break
    stats.phase = "done"
    stats.done = True
    report(force=True)
    return list(found.values()), stats


class P2PBranch:
    """The P2P pair's plans (explore/tier_draw.py), one played after every `P2P_EVERY` generated examples (not
    counted as examples, and drawing nothing from hypothesis: the search's examples stay as they were), each as
    a `[setup] p2p = true` recipe with every invariant checked; a violation or a vLLM exception is a finding whose
    recipe `repro` replays. Plans are small and fixed in shape, so none is shrunk."""

    def __init__(self, api: Any, config: ExploreConfig, worker: int, start: float) -> None:
        from kvdoctor.explore.tier_draw import p2p_plan_bytes

        self.api, self.config, self.worker, self.start = api, config, worker, start
        self.plans = iter(p2p_plan_bytes(config.seed, worker))
        self.keys: set[str] = set()

    def play_next(self, stats: Stats) -> Finding | None:
        """The next plan (None when it found nothing new, or every plan was played)."""
        from kvdoctor.explore.generate import PLACEHOLDER_SIGNATURE
        from kvdoctor.explore.tier_draw import p2p_steps
        from kvdoctor.recipes.model import Recipe, Step

        byte = next(self.plans, None)
        if byte is None:
            return None
        config, api = self.config, self.api
        steps = tuple(Step(action, args, line) for line, (action, args) in enumerate(p2p_steps(byte), 1))
        recipe = Recipe(name="explore", summary=f"generated by kvdoctor explore (P2P plan {byte})",
                        signature=PLACEHOLDER_SIGNATURE, steps=steps, setup=dict(P2P_SETUP))
        invariants = tuple(INVARIANTS if config.invariants is None else config.invariants)
        t0 = time.perf_counter()
        try:
            obs = observe(api, recipe, config.logic, invariants, setup_of(recipe))
        except InvalidExample:
            stats.invalid += 1
            return None
        finally:
            stats.run_seconds += time.perf_counter() - t0
        stats.runs += 1
        stats.scheduler_steps += obs.scheduler_steps
        if obs.signature is None or not wanted(config, obs):
            return None
        path = path_of(obs, recipe)
        key = finding_key(obs.signature, path)
        if key in self.keys or (path and path in config.exclude_triggers):
            return None
        self.keys.add(key)
        summary = summary_text(obs, config.seed, byte, self.worker, 0, config.logic, api.version_text,
                               step_actions(recipe.steps), recipe.setup)
        return Finding(signature=obs.signature, kind=obs.kind, detail=obs.detail,
                       recipe=finding_recipe(recipe, obs, summary), seed=config.seed, example_seed=byte,
                       worker=self.worker, round=0, logic=config.logic, vllm_version=api.version_text,
                       examples_before=stats.examples, elapsed_s=time.monotonic() - self.start, path=path)


def available_specs(api: Any) -> frozenset[str]:
    """The drawable offloading specs this vLLM registers (others are drawn as the default spec)."""
    return frozenset(name for name in SPECS if name is not None and api.has_offloading_spec(name))


_layout_probes: dict[tuple[int, str | None], str | None] = {}


def layout_refusal(api: Any, layout: str | None) -> str | None:
    """Why the installed vLLM cannot run `layout` (None: it builds). A probe, not a version check: an empty
    example of that layout (explore's simplest geometry) is built as every example is (vLLM's planner, its
    specs, the scheduler and connector); its refusal is the answer. Once per process and layout."""
    key = (id(api), layout)
    if key not in _layout_probes:
        fields = [0] * len(GEOMETRY_RANGES)
        fields[2] = GEOMETRY_RANGES[2] - 1  # the largest pool: every group of a three-group layout fits a request
        example = Example.from_fields(tuple(fields), [], layouts=(layout,))
        try:
            Harness(api, setup_of(to_recipe(example))).shutdown()
            _layout_probes[key] = None
        except Exception as exc:  # any refusal at build time is the probe's answer
            _layout_probes[key] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
    return _layout_probes[key]


def drawn_layouts(api: Any, force: frozenset[str]) -> tuple[str | None, ...]:
    """The forced layouts (`--force layout=NAME`) the installed vLLM builds (`layout_refusal`); () where none is
    forced (the random draw). Forced layouts that all fail the probe are a usage error (one line)."""
    forced = forced_layouts(force)
    if not forced:
        return ()
    usable = tuple(layout for layout in forced if layout_refusal(api, layout) is None)
    if not usable:
        name = forced[0] or DEFAULT_LAYOUT_NAME
        raise UsageError(f"--force layout={name}: this vLLM cannot build it ({layout_refusal(api, forced[0])})")
    return usable


def available_features(api: Any) -> frozenset[str]:
    """The extension bytes' features this vLLM has, as the adapter probes them (never version numbers):
    sync loads where the offloading scheduler's config reads `sync_load_budget_bytes`, the recompute
    policy where KVTransferConfig has `kv_load_failure_policy`, `prefix_match_unit` and
    `prefix_cache_retention_interval` where CacheConfig has them, per-request caps where the offloading
    scheduler's request state reads `max_load_tokens`, the priority policy where SchedulerConfig takes it,
    speculative decoding where the offloading path has lookahead block hashes or the EAGLE block drop."""
    probes = {SYNC_LOADS: api.offload_config_reads(SYNC_LOADS),
              RECOMPUTE: api.kv_transfer_config_has_field(RECOMPUTE),
              PREFIX_MATCH_UNIT: api.cache_config_has_field(PREFIX_MATCH_UNIT),
              RETENTION: api.cache_config_has_field(RETENTION),
              LOAD_CAPS: api.offload_request_reads(LOAD_CAPS),
              PRIORITY: PRIORITY in api.scheduler_policies()}
    # Speculative decoding is drawn where the offloading path has 0.34's machinery for it (lookahead
    # block hashes, the EAGLE block drop): where the bugs would be new.
    speculative = api.speculative_features()
    probes[SPECULATIVE_DRAW] = bool(speculative & {LOOKAHEAD_BLOCK_HASHES, EAGLE_BLOCK_DROP})
    # and with the lookahead hashes, the option that turns them off
    probes[NO_LOOKAHEAD_HASHES] = LOOKAHEAD_BLOCK_HASHES in speculative
    # Several workers where the scheduler counts each job's reports to world_size (the aggregator exists)
    probes[WORKERS_DRAW] = api.counts_worker_reports
    # A secondary (fs) tier where the tiering manager has 0.34's deferred write release: where the
    # promotion / cascade bugs would be new (older releases' fs tier is left undrawn: their seeds stay).
    probes[TIER_DRAW] = api.has_secondary_tier("fs") and api.tiering_defers_write_release()
    # KV events (one more byte, the last) where the connector describes a store from its request's context
    # (0.34's events tracker): where the event bugs would be new; self-describing payloads where configurable.
    events = api.kv_events_features()
    probes[EVENTS_DRAW] = {EVENTS_DRAW, "request_described_stores"} <= events
    probes[SELF_DESCRIBING_DRAW] = SELF_DESCRIBING_DRAW in events
    # and kvdoctor's scripted tier beside it, where vLLM loads it by module_path with backpressure_cls
    probes[SCRIPTED_TIER_DRAW] = probes[TIER_DRAW] and api.has_scripted_tier() and api.has_tier_backpressure()
    # and vLLM's own backpressure detector on the step clock in its backpressure bit (tier_draw.VLLM_BACKPRESSURE)
    probes[VLLM_BACKPRESSURE_DRAW] = probes[SCRIPTED_TIER_DRAW] and api.has_vllm_backpressure(failure_threshold=True)
    # and vLLM's object-store tier on kvdoctor's fake NIXL agent, where vLLM builds its agent by the names stood in for
    probes[OBJSTORE_DRAW] = probes[TIER_DRAW] and api.has_scripted_tier() and api.objstore_unavailable() is None
    # and vLLM's own in-memory example tier, loaded through module_path (bits the object store leaves spare)
    probes[EXAMPLE_TIER_DRAW] = probes[OBJSTORE_DRAW] and api.has_example_tier()
    # The CPU tier's ARC eviction policy (drawn in the second extension byte, with the per-request caps)
    probes[ARC] = ARC in api.eviction_policies()
    # EngineCore.sleep's reset_connector (a forced sleep keeps the connector's cache where the release takes it)
    probes[SLEEP_KEEPS_CONNECTOR] = api.engine_sleep_takes_reset_connector()
    # The P2P pair (its own branch, `p2p_branch`) where kvdoctor can stand in for the P2P tier's transports
    from kvdoctor.engine.compat.p2p_transport import p2p_probe

    probes[P2P_TIER_DRAW] = p2p_probe() is None
    return frozenset(name for name, present in probes.items() if present)


# -- several processes ---------------------------------------------------------------------------

_warmed: set[int] = set()


def warm_up(api: Any) -> None:
    """Pay the one-off costs before the budget clock starts: the first scheduler build (vLLM
    inspects the model architecture once per process), hypothesis' strategies; then move
    everything imported so far out of the garbage collector's way (`gc.freeze()`, as vLLM's
    engine does after start-up), so collections scan only what exploring allocates."""
    import gc
    import logging

    if id(api) in _warmed:  # once a process (explore.app warms up before it starts the budget's clock)
        return
    _warmed.add(id(api))

    # Generated runs fail loads on purpose, and vLLM logs each at ERROR level, on stdout (which
    # would break --json); every failure explore reports comes from its own observation instead.
    logging.getLogger("vllm").setLevel(logging.CRITICAL)
    Harness(api, Setup())
    examples(ExploreConfig().max_events)
    gc.collect()
    gc.freeze()


def worker_main(config: ExploreConfig, worker: int, queue: Any) -> None:
    """The body of one search worker, wherever it runs (a spawned process, a Ray task): import vLLM,
    search, and send what happens as messages on `queue` (anything with `put`): ("ready", worker,
    `WorkerIdentity` as a dict), ("progress", worker, stats), ("finding", worker, Finding), ("done",
    worker, stats) or ("error", worker, (text, exit code or None)); with `config.coverage`, ("coverage", worker,
    the connector lines it executed) just before "done"."""
    lines = LineCoverage() if config.coverage else None
    try:
        from kvdoctor.engine import compat

        if lines is not None:  # before vLLM's import: the lines an import runs count, as under `coverage run`
            lines.start()
        api = compat.load()
        warm_up(api)
        queue.put(("ready", worker, WorkerIdentity.here(api.version_text).as_dict()))
        worker_config = dataclasses.replace(config, workers=1)
        _, stats = worker_search(
            api, worker_config, worker,
            on_progress=lambda s: queue.put(("progress", worker, s.as_dict())),
            on_finding=lambda f: queue.put(("finding", worker, f)), lines=lines)
        if lines is not None:
            lines.stop()
            queue.put(("coverage", worker, lines.executed()))  # before "done", a worker's last word
        queue.put(("done", worker, stats.as_dict()))
    except BaseException as exc:  # the parent reports it, one line
        from kvdoctor.errors import KvdoctorError

        code = exc.exit_code if isinstance(exc, KvdoctorError) else None
        text = str(exc) if isinstance(exc, KvdoctorError) else f"{type(exc).__name__}: {exc}"
        queue.put(("error", worker, (text, code)))
    finally:
        if lines is not None:
            lines.stop()


@dataclass(frozen=True)
class WorkerIdentity:
    """Who a worker is: the releases it runs (every worker must run the driver's) and where it runs."""

    vllm: str
    kvdoctor: str
    node: str
    pid: int

    @classmethod
    def here(cls, vllm_version: str) -> WorkerIdentity:
        import os
        import socket

        from kvdoctor import __version__

        return cls(vllm=vllm_version, kvdoctor=__version__, node=socket.gethostname(), pid=os.getpid())

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class WorkerPool(Protocol):
    """Where the workers of a parallel search run (`kvdoctor.explore.pools`): each runs `worker_main`
    and its messages reach the driver's loop (`explore`) through `get`, whatever carries them."""

    name: str  # how messages name the pool ("local processes", "Ray cluster at ...")

    def start(self, config: ExploreConfig) -> None:
        """Start `config.workers` workers; each runs `worker_main(config, i, queue)`."""

    def get(self, timeout: float) -> tuple[str, int, Any] | None:
        """The next message, or None when none came within `timeout` seconds."""

    def gone(self, workers: set[int]) -> dict[int, str]:
        """Of `workers` (those that have not said their last word), the ones no longer running, with
        why. Asked only once `get` found no message, so every message they sent has been read."""

    def cancel(self, worker: int) -> None:
        """Stop one worker now (its share is then not searched)."""

    def close(self) -> None:
        """Stop every worker still running and release what the pool started; safe to call twice."""


def explore(config: ExploreConfig, on_progress: Callable[[ExploreResult], None] | None = None,
            on_finding: Callable[[Finding], None] | None = None, api: Any = None,
            pool: WorkerPool | None = None, lines: LineCoverage | None = None) -> ExploreResult:
    """Run the whole search: in-process for one worker without a `pool`, else in the pool's workers
    (spawned processes, or Ray tasks: `kvdoctor.explore.pools`). `lines`: one worker's line coverage, started
    by the caller (before vLLM's import); the pool's workers measure their own."""
    if pool is None and config.workers <= 1:
        if api is None:
            api = compat.load()
        warm_up(api)
        result = ExploreResult(vllm_version=api.version_text, config=config)

        def progress(stats: Stats) -> None:
            result.stats = stats
            result.worker_stats = [stats]
            if on_progress is not None:
                on_progress(result)

        findings, stats = worker_search(api, config, 0, progress, on_finding, lines=lines)
        result.stats, result.worker_stats = stats, [stats]
        result.api = api
        if lines is not None and config.coverage:
            result.coverage = lines.executed()
        result.findings = merge(findings)
        return result
    if pool is None:
        raise InternalError(f"a search with {config.workers} workers needs a pool to run them in "
                            f"(kvdoctor.explore.pools.ProcessPool or ray_pool.RayPool)")
    return _explore_in_pool(config, pool, on_progress, on_finding)


def _explore_in_pool(config: ExploreConfig, pool: WorkerPool, on_progress: Callable[[ExploreResult], None] | None,
                     on_finding: Callable[[Finding], None] | None) -> ExploreResult:
    """The driver's loop, the same for every pool: read the workers' messages, stream each new
    signature's finding out at once, and merge all findings by signature (the fewest steps kept).
    A worker that runs another vLLM or kvdoctor than the driver is stopped; it and a worker lost
    without its last word (a killed process, a lost node) are `lost` shares: not counted as searched."""
    from kvdoctor import __version__
    from kvdoctor.engine.compat import installed_vllm_version

    driver_vllm = installed_vllm_version() or "?"
    result = ExploreResult(vllm_version=driver_vllm, config=config)
    per_worker: dict[int, Stats] = {i: Stats(phase="importing vLLM") for i in range(config.workers)}
    findings: list[Finding] = []
    running = set(range(config.workers))
    seen: set[str] = set()
    lost: set[int] = set()
    covered: list[Executed] = []

    def lose(worker: int, why: str) -> None:
        lost.add(worker)
        running.discard(worker)
        result.lost.append(f"worker {worker} ({pool.name}): {why}; its share is not counted as searched")

    def publish() -> None:
        result.worker_stats = [per_worker[i] for i in sorted(per_worker)]
        total = Stats(phase=", ".join(sorted({s.phase for i, s in per_worker.items() if i not in lost}) or {"stopped"}))
        for i, s in sorted(per_worker.items()):
            if i in lost:
                continue
            total.examples += s.examples
            total.shrink_examples += s.shrink_examples
            total.runs += s.runs
            total.invalid += s.invalid
            total.excluded += s.excluded
            total.sleep_examples += s.sleep_examples
            total.scheduler_steps += s.scheduler_steps
            total.shrink_steps += s.shrink_steps
            total.run_seconds += s.run_seconds
            total.shrink_seconds += s.shrink_seconds
            total.connector_lines += s.connector_lines  # each worker's new lines (overlaps counted per worker)
            total.elapsed = max(total.elapsed, s.elapsed)
        total.failures = len(seen)
        total.done = not running
        result.stats = total
        if on_progress is not None:
            on_progress(result)

    try:
        pool.start(config)
        while running:
            message = pool.get(timeout=0.5)
            if message is None:
                for i, why in pool.gone(running).items():  # gone without a last word
                    lose(i, why)
                publish()
                continue
            kind, worker, payload = message
            if worker in lost:  # a stopped worker's last messages
                continue
            if kind == "ready":
                identity = WorkerIdentity(**payload)
                result.workers.append(identity)
                if (identity.vllm, identity.kvdoctor) != (driver_vllm, __version__):
                    pool.cancel(worker)
                    lose(worker, f"node {identity.node} runs vLLM {identity.vllm} and kvdoctor "
                                 f"{identity.kvdoctor}, the driver vLLM {driver_vllm} and kvdoctor {__version__}: "
                                 f"stopped")
                else:
                    per_worker[worker].phase = "searching"
            elif kind == "progress":
                per_worker[worker] = Stats(**payload)
            elif kind == "finding":
                findings.append(payload)
                if payload.key not in seen:
                    seen.add(payload.key)
                    if on_finding is not None:
                        on_finding(payload)
            elif kind == "coverage":
                covered.append(payload)
            elif kind == "done":
                per_worker[worker] = Stats(**payload)
                running.discard(worker)
            elif kind == "error":
                text, code = payload
                result.errors.append(f"worker {worker}: {text}")
                result.error_codes.append(code)
                running.discard(worker)
            publish()
    finally:
        pool.close()
    result.findings = merge(findings)
    if config.coverage:
        result.coverage = merge_executed(covered)
    publish()
    return result
