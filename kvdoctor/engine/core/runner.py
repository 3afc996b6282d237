"""A recipe at the engine level: the scenario's own run (observation, invariants, verdict) on
vLLM's EngineCore instead of kvdoctor's scheduler harness.

Steps the level cannot express make the recipe `not_applicable`, naming them, before vLLM builds
anything (`levels.unexpressible`)."""

from __future__ import annotations

from typing import Any

from kvdoctor.engine.core.levels import unexpressible
from kvdoctor.observe.verdict import Outcome
from kvdoctor.scenario import RunResult, ScenarioRun


class CoreScenarioRun(ScenarioRun):
    level = "core"

    @property
    def harness_class(self) -> Any:  # type: ignore[override]
        from kvdoctor.engine.core.harness import CoreHarness

        return CoreHarness

    def run(self) -> RunResult:
        reasons = (unexpressible(self.recipe.steps, "core", self.setup.async_scheduling)
                   + _setup_unexpressible(self.setup))
        if reasons:
            self.result.outcome = Outcome.NOT_APPLICABLE
            self.result.detail = "; ".join(reasons)
            self.result.unplayable = True
            return self.result
        return super().run()

    def _run_on(self, harness: Any) -> RunResult:
        self.result.worker = (f"{self.result.worker}; hosted by kvdoctor's executor under vLLM's EngineCore "
                              f"(EngineCore.{harness.step_fn_name} calls the scheduler)")
        return super()._run_on(harness)


def run_core_scenario(api: Any, recipe: Any, setup: Any, logic: str, record_timeline: bool = False) -> RunResult:
    return CoreScenarioRun(api, recipe, setup, logic, record_timeline).run()


def _setup_unexpressible(setup: Any) -> list[str]:
    """Geometry the engine cannot build as the scheduler level does."""
    from kvdoctor.engine.kv_layout import resolve_layout

    layout = resolve_layout(setup.model, setup.layout, setup.sliding_window)
    if any(layer.draft for layer in layout.layers):
        return [f"{layout.source} has EAGLE drafter layers: vLLM's EngineCore flags a drafter's KV cache "
                f"group (is_eagle_group) only under a speculative config, which loads a draft model; kvdoctor's "
                f"scheduler level flags the group itself (measured: without the flag the engine takes the "
                f"non-EAGLE path and the bug's trigger is never built)"]
    return []
