"""Reading `app.repro` reports in recipe tests: one run per logic, timeline positions, snapshots;
and what kvdoctor measured on each release (kvdoctor/data/release_outcomes.toml), the one place a
test takes a per-release expectation from.

Shared by the per-recipe test modules so each asserts on the same reading of a report.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import pytest

from kvdoctor.observe.verdict import Outcome

LOGICS = ("installed", "fixed", "unpatched")


@functools.lru_cache(maxsize=1)
def _rows() -> dict[tuple[str, str], object]:
    from kvdoctor.matrix import data

    return {(row.release, row.recipe): row for row in data.load()}


SECRET = "kvdoctor-test-secret-0f9a"  # in the audit's environment: a report must never show it


@dataclasses.dataclass(frozen=True)
class AuditRun:
    proc: object  # the command's CompletedProcess (tests/cli_runner.invoke)
    doc: dict  # its --json document
    markdown: str  # its --report file
    home: Path  # $HOME during the run (an empty temporary folder): a report must never show its path
    report: object  # the AuditReport kvdoctor.app.audit returned to the command


@functools.cache
def cli_audit_run() -> AuditRun:
    """`kvdoctor audit --json --report ~/audit.md` without setup flags, in this process (tests/cli_runner.invoke)
    once per test session: a whole audit is the suite's costliest run, and the modules that need one share
    it (the CLI's own path: test_audit_and_reports; the README's examples; the release-outcomes check; under
    xdist, once per worker that runs one of them). The AuditReport is taken as kvdoctor.app.audit returns it to the
    command (the real function runs; a pass-through records its result and arguments)."""
    import atexit
    import shutil
    import tempfile

    from kvdoctor import app
    from kvdoctor.cli.options import DEFAULT_WORKER, worker_overrides

    from .cli_runner import invoke

    home = Path(tempfile.mkdtemp(prefix="kvdoctor-operator-home-"))
    atexit.register(shutil.rmtree, home, ignore_errors=True)
    report_file = home / "audit.md"
    real, calls = app.audit, []

    def recorded(*args, **kwargs):
        calls.append((args, kwargs))
        result = real(*args, **kwargs)
        calls[-1] = (args, kwargs, result)
        return result

    app.audit = recorded
    try:
        proc = invoke("audit", "--json", "--report", str(report_file),
                      env={"HOME": str(home), "KVDOCTOR_SECRET_TOKEN": SECRET})
    finally:
        app.audit = real
    ((args, kwargs, report),) = calls
    # the run every user of it expects: `kvdoctor audit` at the CLI's defaults (no flag given: None)
    given = kwargs["overrides"].given()
    assert not args and given == worker_overrides(None, None, None).given(), kwargs
    assert kwargs["default_worker"] == DEFAULT_WORKER, kwargs
    return AuditRun(proc, json.loads(proc.stdout), report_file.read_text(), home, report)


def cli_audit():
    """The AuditReport of `kvdoctor audit` without setup flags: the session's one audit (cli_audit_run)."""
    return cli_audit_run().report


def measured_row(api, recipe: str):
    """The data file's row of `recipe` on the installed release; skip where it has none."""
    row = _rows().get((api.version_text, recipe))
    if row is None:
        pytest.skip(f"kvdoctor/data/release_outcomes.toml has no measurement of {recipe} on vLLM "
                    f"{api.version_text}: re-measure with kvdoctor matrix --audit --write-data")
    return row


def measured(api, recipe: str, logic: str = "installed", async_scheduling: bool = False) -> Outcome:
    """The outcome kvdoctor measured for a built-in recipe at its default setup on the installed release
    (`kvdoctor matrix --audit --write-data`: the audit's installed and fixed runs, sync and under
    --async-scheduling); skip where that dimension was not measured.

    `unpatched` (the installed method with the PR #49146 cap lifted) is compared with the installed
    measurement: for every built-in recipe the cap is never the only guard that holds (no cap on 0.26;
    from 0.30 PR #49285 and the later fixes hold without it), measured by these modules on 0.26.0,
    0.30.0, 0.33.0 and 0.34.0. A release where that stops being true fails here, on purpose."""
    row = measured_row(api, recipe)
    value = row.outcome_for("installed" if logic == "unpatched" else logic, async_scheduling)
    if value is None:
        mode = "--async-scheduling" if async_scheduling else "sync scheduling"
        pytest.skip(f"kvdoctor/data/release_outcomes.toml has no {logic}-logic outcome of {recipe} under {mode} "
                    f"on vLLM {api.version_text}: re-measure with kvdoctor matrix --audit --write-data")
    return Outcome(value)


def measured_if_any(api, recipe: str) -> Outcome | None:
    """`measured(api, recipe)` where the data file has it, else None: for a test that checks every
    measured recipe in one loop (it skips itself when nothing was measured, rather than per recipe)."""
    row = _rows().get((api.version_text, recipe))
    value = row.outcome_for("installed") if row is not None else None
    return None if value is None else Outcome(value)


def bug_present(api, recipe: str) -> bool:
    """Whether the installed release has the recipe's bug, as measured: the installed logic reproduces it
    at the recipe's default setup (sync scheduling)."""
    return measured(api, recipe) is Outcome.REPRODUCED


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


def assert_outcome(api, reports, name, mode, logic):
    """The run of `name` under `logic` ended as kvdoctor measured it on this release (the data file). A run
    played past a measured reason the flags break (`played_outcome`) is compared as it played: the table
    records what runs showed; how the report words it from there is `matrix.reasons`' (test_measured_reasons)."""
    run = result(reports, name, mode, logic)
    want = measured(api, name, logic, mode)
    played = run.played_outcome or run.outcome
    assert played is want, (
        f"{name} async={mode} {logic}: {played.value} ({run.detail}; "
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
