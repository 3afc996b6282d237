"""Reading `app.repro` reports in recipe tests: one run per logic, timeline positions, snapshots.

Shared by the per-recipe test modules so each asserts on the same reading of a report.
"""

from __future__ import annotations

import pytest

from kvdoctor.observe.verdict import Outcome

LOGICS = ("installed", "fixed", "unpatched")


def result(reports, name, mode, logic):
    return next(r for r in reports[(name, mode)].results if r.logic == logic)


def reproduced_runs(reports, name, mode):
    """The runs of `name` that reproduced, under any logic; skip when none did (nothing to assert)."""
    runs = [result(reports, name, mode, logic) for logic in LOGICS]
    chosen = [run for run in runs if run.outcome is Outcome.REPRODUCED]
    if not chosen:
        pytest.skip(f"{name} does not reproduce in this mode on this release")
    return chosen


def index_of(run, action, after=0):
    """Timeline position of the first `action` step at or after position `after`."""
    for i, entry in enumerate(run.timeline[after:], start=after):
        if entry.action == action:
            return i
    raise AssertionError(f"no {action} step after position {after}")


def snap(entry, request):
    return next(s for s in entry.requests if s.request == request)


def assert_outcome(reports, expected, name, mode, logic):
    """The run of `name` under `logic` ended as this release's measured table says."""
    run = result(reports, name, mode, logic)
    want = expected[name][mode][logic]
    assert run.outcome is want, (
        f"{name} async={mode} {logic}: {run.outcome.value} ({run.detail}; "
        f"{run.failure and run.failure.message}), expected {want.value}")


def load_described_builtins(names):
    """Each name is a built-in recipe with a title, summary, refs and at least one `expect` step."""
    from kvdoctor.recipes.builtins import builtin_names, load_builtin

    known = builtin_names()
    recipes = []
    for name in names:
        assert name in known
        recipe = load_builtin(name)
        assert recipe.name == name and recipe.title and recipe.summary and recipe.refs
        assert any(step.action == "expect" for step in recipe.steps), name
        recipes.append(recipe)
    return recipes
