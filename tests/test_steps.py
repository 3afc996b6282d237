"""The step registry: every kind a recipe may name is declared once and played by exactly one handler,
which uses only what the kind declares it needs; an unregistered kind is kvdoctor's bug, never a silent
no-op; every declared kind is played, exported or refused (in one line naming the step) at every level;
and `docs/steps.md` is the registry's own table."""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import ClassVar

import pytest

from kvdoctor.errors import InternalError
from kvdoctor.recipes.compile import ConcreteStep, NewRequest
from kvdoctor.recipes.model import Step
from kvdoctor.steps import REGISTRY, ExpectationFailed, Need, StepTarget, markdown_table, play

DOC = Path(__file__).resolve().parent.parent / "docs" / "steps.md"


def test_the_loader_accepts_exactly_the_declared_kinds():
    """The loader's vocabulary is the registry: a declared kind gets past the action check (to its own fields'
    checks), an undeclared one is refused naming every declared kind."""
    from kvdoctor.errors import RecipeError
    from kvdoctor.recipes.loader import load_recipe_text

    head = '[recipe]\nname = "x"\nsummary = "y"\n[signature]\nexception = "E"\nfunction = "f"\n'
    add = '[[step]]\naction = "add"\nrequest = "A"\nprompt_tokens = 4\n'
    for kind in REGISTRY:
        try:
            load_recipe_text(head + add + f'[[step]]\naction = "{kind}"\n', "t.toml")
        except RecipeError as exc:
            assert "unknown action" not in str(exc), str(exc)
    with pytest.raises(RecipeError, match="unknown action 'teleport' \\(expected one of " + ", ".join(REGISTRY)):
        load_recipe_text(head + '[[step]]\naction = "teleport"\n', "t.toml")


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

    NEEDS: ClassVar[dict[str, Need]] = {
        "add": Need.ENGINE_INPUT, "abort": Need.ENGINE_INPUT,
        "step": Need.ENGINE_STEP, "drain": Need.IN_FLIGHT_OUTPUT,
        "finish_by_eos": Need.MODEL_OUTPUT,
        "hold": Need.TRANSFER_CONTROL, "complete": Need.TRANSFER_CONTROL, "fail": Need.TRANSFER_CONTROL,
        "delay_block_hashes": Need.SCHEDULER_CONTROL, "release_block_hashes": Need.SCHEDULER_CONTROL,
        "reset_prefix_cache": Need.ENGINE_UTILITY, "pause": Need.ENGINE_PAUSE, "resume": Need.ENGINE_PAUSE,
        "sleep": Need.ENGINE_PAUSE, "wake_up": Need.ENGINE_PAUSE,
        "snapshot": Need.SCHEDULER_STATE, "p2p": Need.P2P_PAIR, "pd_fail": Need.PD_DECODE,
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
    args = {key: ("A" if spec.types[0] is str else 1) for key, spec in REGISTRY[kind].fields.items() if spec.required}
    requests = (NewRequest("A", (1, 2, 3), 8),) if REGISTRY[kind].admits else ()
    return ConcreteStep(1, 0, Step(kind, args, 7), requests)


@pytest.mark.parametrize("kind", list(REGISTRY))
def test_a_handler_uses_exactly_what_its_kind_needs(kind):
    used: list[Need] = []
    recorder = _Recorder(used)
    with contextlib.suppress(_Stop):
        play(_sample_step(kind), StepTarget(recorder, recorder))
    assert used, f"{kind}'s handler did nothing"
    assert set(used) == set(REGISTRY[kind].needs), f"{kind} declares {REGISTRY[kind].needs}, uses {set(used)}"


def test_an_unregistered_kind_is_kvdoctors_error_not_a_silent_step():
    with pytest.raises(InternalError, match=r"'teleport' .*line 3.* has no handler"):
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
    from kvdoctor.levels.scheduler import run_scenario
    from kvdoctor.recipes.builtins import load_builtin
    from kvdoctor.resolution import resolve_setup

    recipe = load_builtin("queued-abort")
    monkeypatch.setattr("kvdoctor.steps.REGISTRY", {k: v for k, v in REGISTRY.items() if k != "abort"})
    with pytest.raises(InternalError, match=r"'abort'.*has no handler"):
        run_scenario(api, recipe, resolve_setup(recipe), "installed")


def test_docs_steps_table_is_generated_from_the_registry():
    table = markdown_table()
    for kind in REGISTRY:
        assert f"| `{kind}` |" in table
    if os.environ.get("KVDOCTOR_UPDATE_DOCS") == "1":
        DOC.write_text(table)
    assert DOC.exists() and DOC.read_text() == table, (
        "docs/steps.md drifted from kvdoctor/steps.py: KVDOCTOR_UPDATE_DOCS=1 pytest tests/test_steps.py")


# -- every kind has an answer at every level: played, exported, or refused in one line naming the step ---------

LEVELS = ("scheduler", "core", "serve", "exported scheduler script", "exported serve script")


def _one_of_each(kind: str):
    """A queued-abort-shaped recipe around one step of `kind` (step 3, line 3; its required fields name A): the
    serve level and its exported script take exactly such recipes."""
    from kvdoctor.recipes.model import Recipe, Signature

    args = {key: ("A" if spec.types[0] is str else 1) for key, spec in REGISTRY[kind].fields.items() if spec.required}
    if REGISTRY[kind].admits:
        args = {**args, "request": "C", "prompt_tokens": 4}
    steps = (Step("add", {"request": "A", "prompt_tokens": 4}, 1), Step("add", {"request": "B", "prompt_tokens": 4}, 2),
             Step(kind, args, 3), Step("schedule", {}, 4), Step("abort", {"request": "B"}, 5))
    return Recipe(f"one-{kind}", "one step of a kind", Signature(exception="AssertionError", function="f"), steps)


def _calls(kind: str) -> set[str]:
    """The harness (and worker) calls `kind`'s handler makes."""
    names: list[str] = []

    class Record:
        def __getattr__(self, name: str):
            if name == "worker":
                return self
            if name == "num_workers":
                return 2

            def call(*_args, **_kwargs):
                names.append(name)
                if name == "snapshot":
                    raise _Stop
            return call

    with contextlib.suppress(_Stop):
        play(_sample_step(kind), StepTarget(Record(), Record()))
    return set(names) - {"snapshot"}


def _unbound_names(tree, function: str) -> set[str]:
    """The names `function` (nested in the script's `main`) reads that neither it, `main`, the module nor the
    builtins bind: a step kind's lines using something the script does not have."""
    import ast
    import builtins

    def bound(body) -> set[str]:
        names: set[str] = set()
        for node in ast.walk(ast.Module(body=body, type_ignores=[])):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.FunctionDef):
                names.add(node.name)
                names.update(a.arg for a in node.args.args)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
        return names

    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    play_fn = next(n for n in ast.walk(main) if isinstance(n, ast.FunctionDef) and n.name == function)
    module = [n for n in tree.body if not isinstance(n, ast.FunctionDef)]
    known = bound(module) | {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    known |= bound(main.body) | set(dir(builtins))
    read = {n.id for n in ast.walk(play_fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return read - known


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("kind", list(REGISTRY))
def test_every_kind_is_played_exported_or_refused_at_every_level(kind: str, level: str) -> None:
    """Parametrised over the registry: a new kind without an answer somewhere fails here. Refusals are one line
    naming step 3 and the kind; what is played is checked to be played (never a silent skip)."""
    import ast
    import inspect

    from kvdoctor.engine.setup import Setup
    from kvdoctor.errors import UsageError
    from kvdoctor.export.script import export_script, serve_recipe_data
    from kvdoctor.levels import serve
    from kvdoctor.levels.table import unexpressible, why_not
    from kvdoctor.steps import Unsupported

    recipe, setup, declared = _one_of_each(kind), Setup(worker="simulated"), REGISTRY[kind]
    named = f"step 3 (line 3) `{kind}`"
    if level in ("scheduler", "core"):
        reasons = unexpressible(list(recipe.steps), level, async_scheduling=False)
        if why_not(kind, level) is not None:
            assert len(reasons) == 1 and reasons[0].startswith(named), reasons
            return
        assert reasons == []
        from kvdoctor.engine.core.harness import CoreHarness
        from kvdoctor.engine.harness import Harness
        from kvdoctor.engine.workers.simulated import SimulatedTransfers

        harness = Harness if level == "scheduler" else CoreHarness
        for call in _calls(kind):  # each call the handler makes is the level's own, not a refusal
            owner = harness if hasattr(harness, call) else SimulatedTransfers
            assert hasattr(owner, call), f"{level} harness lacks {call!r}"
            assert "raise UsageError" not in inspect.getsource(getattr(owner, call)), f"{level} refuses {call!r}"
    elif level == "serve":
        reasons = serve.unplayable(recipe, setup, "the client")
        if declared.serve is None:
            assert len(reasons) == 1 and reasons[0].startswith(named), reasons
            return
        assert reasons == []
        planned = serve.plan_traffic(recipe, setup)
        events = [e.kind for e in planned]
        assert events[:2] == ["add", "add"] and events[-2:] == ["step", "abort"]
        sent = declared.serve(_sample_step(kind)) if not declared.admits else [{"kind": "add"}]
        folded = [e for e in sent if e["kind"] == "finish"]  # travels with its request's add (vllm_xargs)
        assert len(events) == 4 + len(sent) - len(folded)
        if folded:
            from kvdoctor.engine.core.names import EOS_AFTER_ARG

            assert planned[0].extra["vllm_xargs"] == {EOS_AFTER_ARG: 0}
    elif level == "exported scheduler script":
        if isinstance(declared.script, Unsupported):
            with pytest.raises(UsageError, match=re.escape(f"--export-script cannot reproduce {named}: ")):
                export_script(recipe, setup)
            return
        script = export_script(recipe, setup)
        assert not _unbound_names(ast.parse(script), f"play_{kind}"), _unbound_names(ast.parse(script), f"play_{kind}")
        assert f"    def play_{kind}(args: dict[str, Any]) -> None:" in script
        assert f'"{kind}": play_{kind}' in script
    else:
        if declared.serve is None:
            with pytest.raises(UsageError, match=re.escape(f"cannot export {recipe.name}: {named} cannot be played")):
                serve_recipe_data(recipe, setup)
            return
        data = serve_recipe_data(recipe, setup)
        planned = serve.plan_traffic(recipe, serve.serve_setup(setup))
        assert [e["kind"] for e in data["events"]] == [e.kind for e in planned]


def test_a_kind_the_serve_level_meets_but_sends_nothing_for_is_kvdoctors_bug(monkeypatch) -> None:
    """A declared kind without serve events is never left out of the traffic: refused by its needs, or an
    internal error where the level would play it."""
    import dataclasses

    from kvdoctor.engine.setup import Setup
    from kvdoctor.levels import serve

    monkeypatch.setitem(REGISTRY, "abort", dataclasses.replace(REGISTRY["abort"], serve=None))
    with pytest.raises(InternalError, match=r"'abort' .*no serve events"):
        serve.plan_traffic(_one_of_each("schedule"), Setup(worker="simulated"))


def test_the_harnesses_offer_the_protocol() -> None:
    """Both levels' harnesses offer every call of the `Harness` protocol; the scheduler harness refuses an
    engine pause in one line (its level refuses `pause` by its need first)."""
    from kvdoctor.engine.core.harness import CoreHarness
    from kvdoctor.engine.harness import Harness as SchedulerHarness
    from kvdoctor.errors import UsageError
    from kvdoctor.steps import Harness

    calls = {name for name in vars(Harness) if not name.startswith("_")} | set(Harness.__annotations__)
    for harness in (SchedulerHarness, CoreHarness):
        missing = {name for name in calls if not hasattr(harness, name) and name not in ("requests", "worker")}
        assert not missing, (harness.__name__, missing)
    with pytest.raises(UsageError, match="--engine core"):
        SchedulerHarness.pause(object.__new__(SchedulerHarness), "keep", False)


def test_the_exported_script_embeds_the_one_simulated_worker_and_step_loop() -> None:
    """No second definition: the exported script carries engine/worker.py's and engine/step_loop.py's code."""
    import inspect

    from kvdoctor.engine import step_loop, worker
    from kvdoctor.engine.setup import Setup
    from kvdoctor.export.script import export_script

    script = export_script(_one_of_each("finish"), Setup(worker="simulated"))
    for module in (worker, step_loop):
        body = inspect.getsource(module).split('"""\n', 2)[2].strip()  # after the module docstring
        assert body in script, module.__name__
    assert "class Worker:" not in script  # the old hand-written copy


def test_one_expectation_rule_for_kvdoctor_and_the_exported_scripts() -> None:
    """`kvdoctor.expectation.unmet`: what `check_expectation` and an exported script's `expect` both call."""
    from kvdoctor.expectation import unmet

    seen = {"status": "WAITING", "allocated_blocks": 3, "in_flight_jobs": 1, "connector_state": "present"}
    assert unmet({"request": "A", "status": ["WAITING", "RUNNING"], "min_allocated_blocks": 3}, seen) == []
    assert unmet({"request": "A", "status": "RUNNING", "allocated_blocks": 4, "min_in_flight_jobs": 2,
                  "connector_state": "released"}, seen) == [
        "status WAITING, expected ['RUNNING']", "allocated_blocks 3, expected 4",
        "in_flight_jobs 1, expected at least 2", "connector state present, expected released"]
    assert unmet({"request": "A", "store_jobs_built": 2}, seen) == []  # not observed by this caller: not compared
