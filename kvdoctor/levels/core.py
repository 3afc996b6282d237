"""`--engine core`: the scenario's own run (observation, invariants, verdict) on vLLM's `EngineCore`,
which calls the scheduler, instead of kvdoctor's scheduler harness; kvdoctor only hosts the executor.

Steps (and setups) the level cannot express make the recipe `not_applicable` and `unplayable`, naming
them, before vLLM builds anything (`table.unexpressible`), as at the scheduler level (`ScenarioRun`)."""

from __future__ import annotations

from kvdoctor.engine.compat import VllmApi
from kvdoctor.engine.core.harness import CoreHarness
from kvdoctor.engine.kv_layout import resolve_layout
from kvdoctor.engine.setup import Setup
from kvdoctor.levels.in_process import InProcessLevel
from kvdoctor.levels.table import unexpressible
from kvdoctor.recipes.model import Recipe
from kvdoctor.results import RunResult
from kvdoctor.scenario import ScenarioRun

NAME = "core"


class CoreScenarioRun(ScenarioRun):
    harness_class = CoreHarness

    def _run_on(self, harness: CoreHarness) -> RunResult:  # type: ignore[override]  # each level runs its own harness
        self.result.worker = (f"{self.result.worker}; hosted by kvdoctor's executor under vLLM's EngineCore "
                              f"(EngineCore.{harness.step_fn_name} calls the scheduler)")
        return super()._run_on(harness)


def run_core_scenario(api: VllmApi, recipe: Recipe, setup: Setup, logic: str,
                      record_timeline: bool = False) -> RunResult:
    """As the scheduler level runs it (`ScenarioRun`): the steps and setup this level cannot play are its
    `unplayable` reasons, judged there beside the release's probes (a probe's reason first)."""
    reasons = unexpressible(recipe.steps, NAME, setup.async_scheduling) + _setup_unexpressible(setup)
    return CoreScenarioRun(api, recipe, setup, logic, record_timeline, unplayable=tuple(reasons)).run()


def _setup_unexpressible(setup: Setup) -> list[str]:
    """Geometry the engine cannot build as the scheduler level does."""
    layout = resolve_layout(setup.model, setup.layout, setup.sliding_window)
    if any(layer.draft for layer in layout.layers):
        return [f"{layout.source} has EAGLE drafter layers: vLLM's EngineCore flags a drafter's KV cache "
                f"group (is_eagle_group) only under a speculative config, which loads a draft model; kvdoctor's "
                f"scheduler level flags the group itself (measured: without the flag the engine takes the "
                f"non-EAGLE path and the bug's trigger is never built)"]
    return []


class CoreLevel(InProcessLevel):
    name = NAME

    def run(self, api: VllmApi, recipe: Recipe, setup: Setup, logic: str, record_timeline: bool = False) -> RunResult:
        return run_core_scenario(api, recipe, setup, logic, record_timeline=record_timeline)


CORE = CoreLevel()
