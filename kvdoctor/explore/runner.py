"""Run one generated recipe on the real scheduler and say what, if anything, broke.

A run is `kvdoctor.levels.scheduler.run_scenario` with every named invariant of
`kvdoctor.observe.invariants` checked after every step, plus the end-of-run
check below; a recipe with sleep / wake_up steps (`explore --force sleep-wake`) is
`kvdoctor.levels.core.run_core_scenario`'s instead (vLLM's EngineCore, the same
observation and invariants). Its failure signature is:

- `<Exception> in <innermost vLLM function>` for an exception raised in vLLM;
- `kvdoctor <Exception> in <function>` for one raised in kvdoctor itself (a
  harness bug: reported, never hidden);
- `invariant <name>` for a violated invariant;
- `check finished-requests-released` when, after the settle tail released every
  transfer and ran SETTLE_STEPS more steps, a request that had finished before
  the settle tail still holds connector state (its `_req_status` entry leaked).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from kvdoctor.engine.setup import Setup
from kvdoctor.errors import UsageError
from kvdoctor.levels.core import NAME as CORE
from kvdoctor.levels.core import run_core_scenario
from kvdoctor.levels.scheduler import run_scenario
from kvdoctor.observe.invariants import INVARIANTS
from kvdoctor.observe.verdict import Outcome
from kvdoctor.recipes.compile import expand_counts
from kvdoctor.recipes.model import Recipe, Step
from kvdoctor.resolution import resolve_setup
from kvdoctor.results import RunResult
from kvdoctor.steps import Need, kinds_needing

RELEASE_CHECK = "finished-requests-released"


@dataclass
class Observation:
    """What one run showed: `signature` is None when nothing broke."""

    signature: str | None = None
    kind: str = ""  # "exception" | "harness" | "invariant" | "check"
    detail: str = ""
    exception: str | None = None
    function: str | None = None
    code: str | None = None
    message: str | None = None  # the exception's message (a bare assert's: its source line)
    invariant: str | None = None
    failure_index: int | None = None  # the run's step counter where it fired (schedule repeats counted)
    scheduler_steps: int = 0  # engine steps (schedule() + update_from_output()) the run executed
    leaked: list[str] = field(default_factory=list)  # requests whose connector state was not released
    engine: str = "scheduler"  # the level the run played at (`engine_of`: core for sleep/wake examples)


def expanded_actions(steps: tuple[Step, ...] | list[Step]) -> list[tuple[int, str]]:
    """(step index, action) per run-time step: a `schedule` with `count = n` counts n times (the recipe
    compiler's expansion; generated recipes repeat by `count` only, so no geometry is needed)."""
    return expand_counts(steps)


def setup_of(recipe: Recipe) -> Setup:
    """The `Setup` exactly as `kvdoctor repro` resolves it from the recipe's [setup]."""
    try:
        return resolve_setup(recipe)
    except UsageError as exc:  # a geometry the generator should not have drawn
        raise InvalidExample(str(exc)) from exc


def _scheduler_steps(actions: list[tuple[int, str]], upto: int | None) -> int:
    chosen = actions if upto is None else actions[:upto]
    return sum(1 for _, action in chosen if action == "schedule")


def engine_of(recipe: Recipe) -> str:
    """The level a recipe plays at: `core` where a step needs the engine's own pause (explore's sleep/wake
    examples: `sleep` / `wake_up`), else kvdoctor's scheduler harness."""
    pause = kinds_needing(Need.ENGINE_PAUSE)
    return CORE if any(step.action in pause for step in recipe.steps) else "scheduler"


def play(api: Any, recipe: Recipe, setup: Setup, logic: str, **options: Any) -> RunResult:
    """One run at the recipe's level (`engine_of`): kvdoctor's scheduler harness, or vLLM's EngineCore (the core
    level's own run: the same observation, invariants and verdict; the engine's setup says so)."""
    if engine_of(recipe) == CORE:
        options.pop("build_cache", None)  # each EngineCore builds its own pieces
        return run_core_scenario(api, recipe, core_setup(setup), logic, **options)
    return run_scenario(api, recipe, setup, logic, **options)


def core_setup(setup: Setup) -> Setup:
    """The setup as `repro --engine core` takes it (validated there: a field that level refuses is a usage error,
    so never played as a finding `repro` could not replay)."""
    return setup if setup.engine == CORE else dataclasses.replace(setup, engine=CORE).validate()


def observe(api: Any, recipe: Recipe, logic: str, invariants: tuple[str, ...] | None = None,
            setup: Setup | None = None, build_cache: Any = None) -> Observation:
    """Run `recipe` (which must end with the settle tail) and classify the outcome. `build_cache`: a
    `harness.BuildCache` the caller keeps across its runs (a search: its examples, their other
    scheduling mode and hypothesis' shrinking repeat setups, and a setup's VllmConfig and KV cache
    plan are most of a build: 0.15 of 0.19 s over 154 explored setups on 0.26.0). A recipe with sleep/wake steps
    plays at --engine core (`play`); one that level cannot play is not an example (`InvalidExample`)."""
    names = tuple(INVARIANTS) if invariants is None else invariants
    setup = setup or setup_of(recipe)
    actions = expanded_actions(recipe.steps)
    settle = _settle_counter(recipe)
    try:  # one snapshot (the settle tail's start) instead of one per step
        result = play(api, recipe, setup, logic, extra_invariants=names,
                      timeline_at=frozenset(() if settle is None else (settle,)), build_cache=build_cache)
    except UsageError as exc:  # vLLM refused the geometry: the generator's fault, never a finding
        raise InvalidExample(str(exc)) from exc
    if result.outcome is Outcome.NOT_APPLICABLE:  # a step or setup the level cannot play: the generator's fault
        raise InvalidExample(result.detail)
    # Anything else propagates: an incompatible adapter (exit 3) or kvdoctor's own failure (exit 5)
    # is never "nothing found".
    obs = Observation(engine=engine_of(recipe))
    if result.failure is not None:
        failure = result.failure
        obs.failure_index = result.failure_step
        obs.scheduler_steps = _scheduler_steps(actions, result.failure_step)
        obs.exception, obs.function, obs.code = failure.exception, failure.function, failure.code
        obs.message = failure.message
        where = f"{failure.exception} in {failure.function}"
        obs.kind = "exception" if failure.in_vllm else "harness"
        obs.signature = where if failure.in_vllm else f"kvdoctor {where}"
        obs.detail = f"{failure.file}:{failure.line}: {failure.exception}: {failure.message or failure.code}"
        return obs
    if result.violations:
        first = result.violations[0]
        obs.failure_index = result.failure_step
        obs.scheduler_steps = _scheduler_steps(actions, result.failure_step)
        obs.kind, obs.invariant = "invariant", first.invariant
        obs.signature = f"invariant {first.invariant}"
        obs.detail = first.message
        return obs
    if result.outcome is Outcome.SETUP_ERROR:
        raise InvalidExample(result.detail)
    obs.scheduler_steps = _scheduler_steps(actions, None)
    leaked = _leaked_requests(settle, result)
    if leaked:
        obs.kind, obs.invariant = "check", RELEASE_CHECK
        obs.signature = f"check {RELEASE_CHECK}"
        obs.leaked = [snap.request for snap in leaked]
        obs.detail = "; ".join(f"{s.request} ({s.status}) still has connector state after every transfer "
                               f"drained ({len(s.in_flight_jobs)} jobs in flight)" for s in leaked)
    return obs


def _settle_counter(recipe: Recipe) -> int | None:
    """The run-time counter of the settle tail's `complete_transfers` step (None: no settle tail)."""
    settle_index = len(recipe.steps) - 2
    if settle_index < 0 or recipe.steps[settle_index].action != "complete_transfers":
        return None
    return _counter_of(recipe, settle_index)


def _leaked_requests(settle: int | None, result: Any) -> list[Any]:
    """Requests finished when the settle tail began whose connector state survived it."""
    if settle is None:
        return []
    entry = next((e for e in result.timeline if e.action == "complete_transfers" and e.index == settle), None)
    if entry is None:
        return []
    finished = {snap.request for snap in entry.requests if snap.status.startswith("FINISHED")}
    return [snap for snap in result.requests if snap.request in finished and snap.connector_state]


def _counter_of(recipe: Recipe, index: int) -> int:
    """The 1-based run-time counter of step `index` (its last repeat)."""
    return max(counter for counter, (at, _) in enumerate(expanded_actions(recipe.steps), 1) if at == index)


class InvalidExample(Exception):
    """The generated recipe could not be run as a scenario (not a finding)."""
