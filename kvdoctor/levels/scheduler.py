"""`--engine scheduler` (the default): kvdoctor calls vLLM's `Scheduler.schedule()` /
`update_from_output()` itself, in this process, on its own harness (`engine.harness.Harness`).

A step whose needs this level does not meet (the engine's own pause) makes the recipe
`not_applicable`, naming the step (`table.unexpressible`). `[setup] p2p = true` plays the recipe on the
P2P pair's harness (engine/p2p.py), where the installed vLLM's probe finds the P2P tier; elsewhere the
recipe is untested with the probe's reason (exit 6: the pair was not tested, at any level)."""

from __future__ import annotations

import dataclasses
from typing import Any

from kvdoctor.engine.compat import VllmApi
from kvdoctor.engine.setup import Setup
from kvdoctor.errors import UsageError
from kvdoctor.levels.in_process import InProcessLevel
from kvdoctor.levels.table import unexpressible
from kvdoctor.recipes.model import Recipe
from kvdoctor.results import RunResult
from kvdoctor.scenario import ScenarioRun
from kvdoctor.steps import Need, kinds_needing

NAME = "scheduler"


def run_scenario(api: VllmApi, recipe: Recipe, setup: Setup, logic: str, record_timeline: bool = False,
                 extra_invariants: tuple[str, ...] = (), timeline_at: frozenset[int] = frozenset(),
                 build_cache: Any = None) -> RunResult:
    """One recipe under one logic variant on kvdoctor's scheduler harness. `timeline_at`: step counters
    (1-based, schedule repeats counted) whose entry is recorded even when `record_timeline` is off.
    `build_cache`: a `harness.BuildCache` (explore's)."""
    setup = p2p_checked(recipe, setup)
    unplayable = tuple(unexpressible(recipe.steps, NAME, setup.async_scheduling))
    run = ScenarioRun(api, recipe, setup, logic, record_timeline, extra_invariants, timeline_at, build_cache,
                      unplayable=unplayable)
    if setup.p2p:
        from kvdoctor.engine.p2p import P2PHarness

        run.harness_class = P2PHarness
    return run.run()


def p2p_checked(recipe: Recipe, setup: Setup) -> Setup:
    """The setup a level plays a P2P recipe with. A `p2p_*` step without the pair is a usage error (one line
    naming it). Where the installed vLLM's probe finds no P2P tier kvdoctor can stand the transports in for, the
    run is untested with the probe's reason: no level of kvdoctor's plays the pair there, so no other level is
    suggested (an `unplayable` reason would name one)."""
    pair_kinds = kinds_needing(Need.P2P_PAIR)
    if not setup.p2p:
        step = next((s for s in recipe.steps if s.action in pair_kinds), None)
        if step is not None:
            raise UsageError(f"{recipe.source or recipe.name}:{step.line}: `{step.action}` drives the P2P pair: "
                             f"it needs [setup] p2p = true")
        return setup
    from kvdoctor.engine.compat.p2p_transport import p2p_probe

    why = p2p_probe()
    return dataclasses.replace(setup, untested=f"[setup] p2p: {why}") if why and not setup.untested else setup


class SchedulerLevel(InProcessLevel):
    name = NAME

    def run(self, api: VllmApi, recipe: Recipe, setup: Setup, logic: str, record_timeline: bool = False) -> RunResult:
        return run_scenario(api, recipe, setup, logic, record_timeline=record_timeline)


SCHEDULER = SchedulerLevel()
