"""`--engine scheduler` (the default): kvdoctor calls vLLM's `Scheduler.schedule()` /
`update_from_output()` itself, in this process, on its own harness (`engine.harness.Harness`).

A step whose needs this level does not meet (the engine's own pause) makes the recipe
`not_applicable`, naming the step (`table.unexpressible`)."""

from __future__ import annotations

from typing import Any

from kvdoctor.engine.compat import VllmApi
from kvdoctor.engine.setup import Setup
from kvdoctor.levels.in_process import InProcessLevel
from kvdoctor.levels.table import unexpressible
from kvdoctor.recipes.model import Recipe
from kvdoctor.results import RunResult
from kvdoctor.scenario import ScenarioRun

NAME = "scheduler"


def run_scenario(api: VllmApi, recipe: Recipe, setup: Setup, logic: str, record_timeline: bool = False,
                 extra_invariants: tuple[str, ...] = (), timeline_at: frozenset[int] = frozenset(),
                 build_cache: Any = None) -> RunResult:
    """One recipe under one logic variant on kvdoctor's scheduler harness. `timeline_at`: step counters
    (1-based, schedule repeats counted) whose entry is recorded even when `record_timeline` is off.
    `build_cache`: a `harness.BuildCache` (explore's)."""
    unplayable = tuple(unexpressible(recipe.steps, NAME, setup.async_scheduling))
    return ScenarioRun(api, recipe, setup, logic, record_timeline, extra_invariants, timeline_at, build_cache,
                       unplayable=unplayable).run()


class SchedulerLevel(InProcessLevel):
    name = NAME

    def run(self, api: VllmApi, recipe: Recipe, setup: Setup, logic: str, record_timeline: bool = False) -> RunResult:
        return run_scenario(api, recipe, setup, logic, record_timeline=record_timeline)


SCHEDULER = SchedulerLevel()
