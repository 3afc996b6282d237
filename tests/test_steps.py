"""The step registry: every kind a recipe may name is played by exactly one handler, which uses only
what the kind declares it needs; an unregistered kind is kvdoctor's bug, never a silent no-op; and
`docs/steps.md` is the registry's own table."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvdoctor.errors import InternalError
from kvdoctor.recipes.compile import ConcreteStep, NewRequest
from kvdoctor.recipes.model import ACTIONS, STEP_FIELDS, Step
from kvdoctor.steps import REGISTRY, ExpectationFailed, Need, StepTarget, markdown_table, play

DOC = Path(__file__).resolve().parent.parent / "docs" / "steps.md"


def test_every_kind_the_loader_accepts_has_a_handler():
    missing = [kind for kind in ACTIONS if kind not in REGISTRY]
    assert not missing, f"step kinds the recipe loader accepts but kvdoctor.steps cannot play: {missing}"


def test_every_handler_plays_a_kind_the_loader_accepts():
    unreachable = [kind for kind in REGISTRY if kind not in ACTIONS]
    assert not unreachable, f"handlers for kinds no recipe can name: {unreachable}"


def test_every_kind_declares_needs_and_every_need_is_used_and_explained():
    for kind in REGISTRY.values():
        assert kind.needs and all(isinstance(need, Need) for need in kind.needs), kind.name
        assert kind.summary.strip(), kind.name
    used = {need for kind in REGISTRY.values() for need in kind.needs}
    assert used == set(Need), f"needs no kind declares: {set(Need) - used}"
    assert all(need.meaning.strip() for need in Need)


def test_scheduler_only_interventions_are_declared_as_such():
    """The engine levels (issue 25) refuse a recipe by these declarations: the late block hashes exist
    only inside the scheduler, the transfer steps only where kvdoctor hosts the worker."""
    assert REGISTRY["delay_block_hashes"].needs == (Need.SCHEDULER_CONTROL,)
    assert REGISTRY["release_block_hashes"].needs == (Need.SCHEDULER_CONTROL,)
    for kind in ("hold_transfers", "complete_transfers", "fail_transfers"):
        assert REGISTRY[kind].needs == (Need.TRANSFER_CONTROL,)
    assert REGISTRY["add"].needs == REGISTRY["abort"].needs == (Need.ENGINE_INPUT,)
    assert REGISTRY["reset_prefix_cache"].needs == (Need.ENGINE_UTILITY,)


# -- each handler uses what its kind declares, and nothing else ------------------------------------------

class _Stop(Exception):
    """Raised by the recording observer: the expectation's arithmetic is not what is measured here."""


class _Recorder:
    """Stands where kvdoctor's own Harness / Observer / worker stand (not vLLM) and notes, per call, the
    need the call belongs to."""

    NEEDS = {
        "add": Need.ENGINE_INPUT, "abort": Need.ENGINE_INPUT,
        "step": Need.ENGINE_STEP, "drain": Need.IN_FLIGHT_OUTPUT,
        "finish_by_eos": Need.MODEL_OUTPUT,
        "hold": Need.TRANSFER_CONTROL, "complete": Need.TRANSFER_CONTROL, "fail": Need.TRANSFER_CONTROL,
        "delay_block_hashes": Need.SCHEDULER_CONTROL, "release_block_hashes": Need.SCHEDULER_CONTROL,
        "reset_prefix_cache": Need.ENGINE_UTILITY, "pause": Need.ENGINE_PAUSE, "resume": Need.ENGINE_PAUSE,
        "snapshot": Need.SCHEDULER_STATE,
    }

    def __init__(self, used: list[Need]) -> None:
        self._used = used

    def __getattr__(self, name: str):
        if name == "worker":
            return self
        if name not in self.NEEDS:
            raise AssertionError(f"a handler used {name!r}, which no need covers")

        def call(*_args, **_kwargs):
            self._used.append(self.NEEDS[name])
            if name == "snapshot":
                raise _Stop
        return call


def _sample_step(kind: str) -> ConcreteStep:
    args = {key: ("A" if types[0] is str else 1) for key, (types, required) in STEP_FIELDS[kind].items()
            if required}
    requests = (NewRequest("A", (1, 2, 3), 8),) if kind == "add" else ()
    return ConcreteStep(1, 0, Step(kind, args, 7), requests)


@pytest.mark.parametrize("kind", ACTIONS)
def test_a_handler_uses_exactly_what_its_kind_needs(kind):
    used: list[Need] = []
    recorder = _Recorder(used)
    try:
        play(_sample_step(kind), StepTarget(recorder, recorder))
    except _Stop:
        pass
    assert used, f"{kind}'s handler did nothing"
    assert set(used) == set(REGISTRY[kind].needs), f"{kind} declares {REGISTRY[kind].needs}, uses {set(used)}"


def test_an_unregistered_kind_is_kvdoctors_error_not_a_silent_step():
    with pytest.raises(InternalError, match="'teleport' .*line 3.* has no handler"):
        play(ConcreteStep(1, 0, Step("teleport", {}, 3)), StepTarget(None))


def test_expect_without_an_observer_is_kvdoctors_error():
    with pytest.raises(InternalError, match="without an observer"):
        play(_sample_step("expect"), StepTarget(None))


def test_a_failed_expectation_names_what_was_observed():
    from kvdoctor.observe.snapshot import RequestSnapshot

    class Observer:
        def snapshot(self):
            return [RequestSnapshot("A", "WAITING", 4, 0, 4, True, False, 0)]

    step = ConcreteStep(1, 0, Step("expect", {"request": "A", "status": "RUNNING"}, 5))
    with pytest.raises(ExpectationFailed, match="expected expect request=A, status=RUNNING; observed A: "
                                                "status=WAITING"):
        play(step, StepTarget(None, Observer()))
    play(ConcreteStep(1, 0, Step("expect", {"request": "A", "status": "WAITING"}, 5)), StepTarget(None, Observer()))


def test_a_kind_without_its_handler_fails_the_run_loudly(api, monkeypatch):
    """On the real scheduler: with `abort`'s handler gone, queued-abort cannot quietly end
    not_reproduced (the abort never happening); the run raises kvdoctor's internal error."""
    from kvdoctor.app import resolve_setup
    from kvdoctor.recipes.builtins import load_builtin
    from kvdoctor.levels.scheduler import run_scenario

    recipe = load_builtin("queued-abort")
    monkeypatch.setattr("kvdoctor.steps.REGISTRY", {k: v for k, v in REGISTRY.items() if k != "abort"})
    with pytest.raises(InternalError, match="'abort'.*has no handler"):
        run_scenario(api, recipe, resolve_setup(recipe, {}), "installed")


def test_docs_steps_table_is_generated_from_the_registry():
    table = markdown_table()
    for kind in ACTIONS:
        assert f"| `{kind}` |" in table
    if os.environ.get("KVDOCTOR_UPDATE_DOCS") == "1":
        DOC.write_text(table)
    assert DOC.exists() and DOC.read_text() == table, (
        "docs/steps.md drifted from kvdoctor/steps.py: KVDOCTOR_UPDATE_DOCS=1 pytest tests/test_steps.py")
