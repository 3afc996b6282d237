"""`kvdoctor matrix`'s application function: releases x recipes -> cells, and bisections.

Free of Typer and formatting (`kvdoctor.report.matrix` renders the report). Inputs are
checked before any environment is built; the report is written by the CLI only after
every cell is in, so a failure leaves nothing half-written.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvdoctor import __version__
from kvdoctor.errors import ExitStatus, UsageError
from kvdoctor.matrix.bisect import Bisection, bisect_releases
from kvdoctor.matrix.data import OutcomeRow
from kvdoctor.matrix.envs import EnvStore, ReleaseEnv
from kvdoctor.matrix.releases import parse_spec
from kvdoctor.matrix.runner import ENV_FAILURE, KVDOCTOR_FAILURE, UNPLAYABLE, Cell, Runner
from kvdoctor.outcome_codes import exit_code_for_many

if TYPE_CHECKING:
    from kvdoctor.matrix.ray_runner import RayRunner

AUDIT = "(audit)"


@dataclass
class MatrixReport:
    releases: list[str]  # asked for, oldest first
    recipes: list[str]  # recipe names, in the order given (every built-in for --audit, or those named)
    audit: bool
    bisect: bool
    cells: dict[tuple[str, str], Cell] = field(default_factory=dict)  # (release, recipe) -> cell
    bisections: list[Bisection] = field(default_factory=list)
    environments: dict[str, str] = field(default_factory=dict)  # release -> "cached" | "built" | "lent"
    command: str = ""
    engine: str = "scheduler"  # the engine level every child ran at (--engine, passed to each child command)
    kvdoctor_version: str = __version__
    measured_on: str = field(default_factory=lambda: datetime.date.today().isoformat())

    def cell(self, release: str, recipe: str) -> Cell | None:
        return self.cells.get((release, recipe))

    @property
    def tested_releases(self) -> list[str]:
        seen = {release for release, _ in self.cells}
        return [r for r in self.releases if r in seen]

    @property
    def exit_status(self) -> ExitStatus:
        """Audit's rule over every cell (`outcome_codes.exit_code_for_many`): a cell whose environment
        or kvdoctor child broke counts as a failure (4), one its engine level could not play (`unplayable`)
        as untested (6)."""
        return exit_code_for_many(self.cells.values())  # a cell the level could not play: 6, as in audit


@dataclass
class Progress:
    """Callbacks for the CLI's progress display (all optional)."""

    building: Callable[[str, int, int], None] = lambda release, done, total: None
    built: Callable[[str, float], None] = lambda release, seconds: None
    running: Callable[[str, str], None] = lambda release, what: None
    ran: Callable[[Cell], None] = lambda cell: None


def resolve_recipes(refs: list[str], audit: bool) -> list[tuple[str, str]]:
    """(name, reference for the child) per recipe; files become absolute paths."""
    from kvdoctor.recipes.builtins import all_builtins, resolve

    if not audit and not refs:
        raise UsageError("give one or more RECIPEs (built-in names or .toml files), or --audit")
    if audit:
        names = [r.name for r in all_builtins()]
        unknown = [ref for ref in refs if ref not in names]
        if unknown:
            raise UsageError(f"--audit runs built-in recipes; not one: {unknown[0]} (see kvdoctor repro --list)")
        return [(name, name) for name in names if not refs or name in refs]
    out: list[tuple[str, str]] = []
    for ref in refs:
        recipe = resolve(ref)
        child_ref = ref if recipe.builtin else str(Path(ref).resolve())
        if recipe.name not in [name for name, _ in out]:
            out.append((recipe.name, child_ref))
    return out


def matrix(recipe_refs: list[str], audit: bool, vllm_spec: str | None, bisect: bool,
           env_dir: Path | None = None, command: str = "", progress: Progress | None = None,
           audit_async: bool = False, engine: str = "scheduler", ray: str | None = None) -> MatrixReport:
    """`audit_async` (with `audit`): audit each release a second time under --async-scheduling and
    record each cell's outcomes there too (what `--write-data` keeps; it doubles the audit's time).
    With `audit`, `recipe_refs` (built-in names) limit each release's audit to those recipes.
    `ray`: run each release's kvdoctor as a Ray task (`matrix.ray_runner`; an address, or "local"),
    all releases at once without `bisect`."""
    progress = progress or Progress()
    recipes = resolve_recipes(recipe_refs, audit)
    releases = parse_spec(vllm_spec)
    if env_dir is not None and not env_dir.is_dir():
        raise UsageError(f"--env-dir {env_dir}: not a directory")
    store = EnvStore(env_dir=env_dir)
    report = MatrixReport(releases=releases, recipes=[name for name, _ in recipes], audit=audit, bisect=bisect,
                          command=command, engine=engine)
    envs: dict[str, ReleaseEnv] = {}
    only = tuple(name for name, _ in recipes) if audit and recipe_refs else ()  # audit --recipe, per name
    to_build = store.missing(releases) if not bisect else []  # bisect builds only what it tests

    def env_for(release: str) -> ReleaseEnv:
        if release not in envs:
            ready = store.ready(release)
            if ready is None:
                if release not in to_build:
                    to_build.append(release)
                progress.building(release, to_build.index(release), len(to_build))
                import time

                started = time.monotonic()
                ready = store.build(release)
                progress.built(release, time.monotonic() - started)
                report.environments[release] = "built"
            else:
                report.environments[release] = "lent" if ready.lent else "cached"
            envs[release] = ready
        return envs[release]

    if ray is not None:
        from kvdoctor.matrix.ray_runner import RayRunner

        runner_context: Runner | RayRunner = RayRunner(ray, engine=engine, only=only)
    else:
        runner_context = Runner(engine=engine, only=only)
    with runner_context as runner:
        def run(release: str, name: str, ref: str) -> Cell:
            if (release, name) not in report.cells:
                env = env_for(release)
                if audit:
                    progress.running(release, "audit")
                    for cell in runner.audit(env):
                        report.cells[(release, cell.recipe)] = cell
                        progress.ran(cell)
                    if (release, name) not in report.cells:  # the audit itself failed
                        failed = report.cells.pop((release, AUDIT), None) or Cell(release, name, "internal_error")
                        for recipe_name in report.recipes:
                            report.cells[(release, recipe_name)] = Cell(**{**failed.as_dict(), "recipe": recipe_name})
                    elif audit_async:
                        progress.running(release, "audit --async-scheduling")
                        _add_async(report, release, runner.audit(env, async_scheduling=True))
                        _add_reasons(report, release, lambda name, flags: runner.recipe(env, name, flags), progress)
                else:
                    progress.running(release, name)
                    cell = runner.recipe(env, ref)
                    cell.recipe = name
                    report.cells[(release, name)] = cell
                    progress.ran(cell)
            return report.cells[(release, name)]

        for release in to_build:  # build every missing environment first: one progress bar
            env_for(release)
        if bisect:
            for name, ref in recipes:
                def outcome_on(release: str, name: str = name, ref: str = ref) -> str:
                    cell = run(release, name, ref)
                    return UNPLAYABLE if cell.unplayable else cell.outcome  # no answer: the level did not test it

                report.bisections.append(bisect_releases(name, releases, outcome_on))
        else:
            runner.prefetch([call for release in releases for call in _calls(env_for(release), recipes, audit,
                                                                              audit_async)])
            for release in releases:
                for name, ref in recipes:
                    run(release, name, ref)
    return report


def _calls(env: ReleaseEnv, recipes: list[tuple[str, str]], audit: bool,
           audit_async: bool) -> list[tuple[str, ReleaseEnv, Any]]:
    """What `run` will ask of one release's environment, in the runner's call form."""
    if audit:
        return [("audit", env, False)] + ([("audit", env, True)] if audit_async else [])
    return [("recipe", env, (ref, ())) for _, ref in recipes]


def _add_async(report: MatrixReport, release: str, async_cells: list[Cell]) -> None:
    """The async audit's outcomes beside the sync ones; a broken async audit leaves them unmeasured."""
    for async_cell in async_cells:
        cell = report.cells.get((release, async_cell.recipe))
        if cell is None or async_cell.outcome in (ENV_FAILURE, KVDOCTOR_FAILURE):
            continue
        cell.async_outcome = async_cell.outcome
        cell.async_fixed_logic_outcome = async_cell.fixed_logic_outcome


def _add_reasons(report: MatrixReport, release: str, run: Callable[[str, tuple[str, ...]], Cell],
                 progress: Progress) -> None:
    """Each built-in recipe's measured reasons, each run at the value that breaks it (matrix/reasons.py);
    sync_scheduling's is the async audit's run. A run that broke measures nothing."""
    from kvdoctor.matrix.reasons import alternatives
    from kvdoctor.matrix.runner import ENV_FAILURE, KVDOCTOR_FAILURE
    from kvdoctor.recipes.builtins import all_builtins

    for recipe in all_builtins():
        cell = report.cells.get((release, recipe.name)) if recipe.name in report.recipes else None
        if cell is None:
            continue
        measured: dict[str, str] = {}
        for requirement, flags in alternatives(recipe).items():
            if requirement == "sync_scheduling":
                if cell.async_outcome is not None:
                    measured[requirement] = cell.async_outcome
                continue
            progress.running(release, f"{recipe.name} {' '.join(flags)}")
            outcome = run(recipe.name, tuple(flags)).outcome
            if outcome not in (ENV_FAILURE, KVDOCTOR_FAILURE):
                measured[requirement] = outcome
        cell.reason_outcomes = measured or None


def unmeasured_releases(report: MatrixReport) -> dict[str, str]:
    """Releases whose run broke (environment or kvdoctor failure): no measurement to keep."""
    return {c.release: f"{c.outcome}: {c.detail}" for c in report.cells.values()
            if c.outcome in (ENV_FAILURE, KVDOCTOR_FAILURE)}


def data_rows(report: MatrixReport) -> list:
    """The report's cells as release-outcomes rows, leaving out releases whose run broke."""
    broken = unmeasured_releases(report)
    return [OutcomeRow(release=c.release, recipe=c.recipe, bug=c.bug or "-", outcome=c.outcome,
                       failure_site=c.failure_site if c.outcome == "reproduced" else None, coverage=c.coverage,
                       fixed_logic_outcome=c.fixed_logic_outcome, async_outcome=c.async_outcome,
                       async_fixed_logic_outcome=c.async_fixed_logic_outcome, reason_outcomes=c.reason_outcomes,
                       measured_on=report.measured_on,
                       kvdoctor_version=report.kvdoctor_version)
            for c in report.cells.values() if c.release not in broken]
