"""Application functions: one per command, free of Typer and of formatting.

Each resolves its inputs, asks the engine level it names (`levels.runners`) to play the recipes, and
returns a result type (`kvdoctor.results`) for `kvdoctor.report` to render.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kvdoctor.engine import compat
from kvdoctor.engine.compat import VllmApi
from kvdoctor.engine.overrides import Overrides
from kvdoctor.engine.setup import Setup
from kvdoctor.errors import UntestedError, UsageError
from kvdoctor.export.script import export_script, export_serve_script
from kvdoctor.levels.in_process import check_spec_name
from kvdoctor.levels.runners import runner
from kvdoctor.levels.serve import groups_untested
from kvdoctor.logic.variants import expand_logic
from kvdoctor.matrix.known import FixedIn, fixed_in
from kvdoctor.observe.metrics import MeasurementIncomplete, measured_bugs, take_measurement
from kvdoctor.observe.verdict import Outcome
from kvdoctor.recipes import builtins as builtin_recipes  # the module: tests swap its catalogue
from kvdoctor.recipes.model import Recipe, bug_order
from kvdoctor.resolution import resolve_setup
from kvdoctor.results import AuditReport, AuditRow, MetricRow, ReproReport, RunResult

# The exported form of each level that has one (`--export-script`); the core level has none.
EXPORTERS: dict[str, Callable[[Recipe, Setup], str]] = {"scheduler": export_script, "serve": export_serve_script}


def load_vllm() -> VllmApi:
    return compat.load()


def repro(recipe_ref: str, overrides: Overrides, logic: str, record_timeline: bool = False,
          command: str = "", default_worker: str | None = None,
          on_progress: Callable[[int, int, str], None] | None = None) -> ReproReport:
    """`on_progress(done, total, what runs now)` is called before the import and each logic variant."""
    recipe = builtin_recipes.resolve(recipe_ref)
    variants = expand_logic(logic)
    # resolving plans the geometry: what vLLM would refuse (a prompt longer than max_model_len) is exit 2 here
    setup = resolve_setup(recipe, overrides, default_worker=default_worker)
    level = runner(setup.engine)
    level.check_logic(logic)
    return level.repro(recipe, setup, variants, overrides=overrides, command=command, fixed_in=_fixed_in(recipe),
                       record_timeline=record_timeline, progress=on_progress or (lambda done, total, what: None))


def export(recipe_ref: str, overrides: Overrides, path: Path, default_worker: str | None = None) -> None:
    """Write the recipe as a standalone script (no vLLM import here): the scheduler level's, or with
    `--engine serve` one that starts `vllm serve` with its two stand-ins and plays the recipe's clients."""
    recipe = builtin_recipes.resolve(recipe_ref)
    setup = resolve_setup(recipe, overrides, default_worker=default_worker)
    exporter = EXPORTERS.get(setup.engine)
    if exporter is None:
        raise UsageError(f"--export-script writes a scheduler-level script, or with --engine serve a `vllm serve` "
                         f"one; --engine {setup.engine} has no exported form")
    untested = groups_untested(setup)  # a --model over the recipe's own layout: measured by vLLM's planner
    if untested is not None:
        raise UntestedError(f"untested, no script written: {untested.detail}")
    text = exporter(recipe, setup)
    try:
        path.write_text(text)
    except OSError as exc:
        raise UsageError(f"--export-script {path}: {exc.strerror}") from None


def audit(command: str = "", overrides: Overrides | None = None,
          default_worker: str | None = None,
          on_progress: Callable[[int, int, str], None] | None = None, only: tuple[str, ...] = ()) -> AuditReport:
    """Every built-in recipe against the installed vLLM: one vLLM import, one process.
    `on_progress(done, total, what runs now)` is called before each piece of work.

    Each recipe is played by the engine level `--engine` names (`levels.runners`): at `--engine core`
    through vLLM's EngineCore, at `--engine serve` through a `vllm serve` child (installed logic only; a
    recipe with a step the serve client cannot play is not_applicable there, naming it, without starting a
    server). The measured bugs (kvdoctor/data/measured_bugs.toml: K10) count scheduler steps and are taken
    by kvdoctor's harness at every level. `only`: the built-in recipes to run (`audit --recipe`; the
    measured bugs are then left out); empty: every one."""
    overrides = overrides or Overrides()
    engine = overrides.engine or "scheduler"
    level = runner(engine)
    level.check_ready()
    recipes = builtin_recipes.all_builtins()
    if only:
        unknown = sorted(set(only) - {recipe.name for recipe in recipes})
        if unknown:
            raise UsageError(f"--recipe {unknown[0]}: not a built-in recipe (see kvdoctor repro --list)")
        recipes = [recipe for recipe in recipes if recipe.name in only]
    setups = [_audit_setup(recipe, overrides, default_worker) for recipe in recipes]
    refused = [setup for setup in setups if isinstance(setup, UsageError)]
    if len(refused) == len(setups):
        raise refused[0]  # the flags themselves are wrong, for every recipe
    measured = measured_bugs() if not only else []
    total = len(recipes) + len(measured)
    progress = on_progress or (lambda done, total, what: None)
    progress(0, 0, "importing vLLM")  # no count yet: the recipes have not started
    api = load_vllm()
    if overrides.spec_name:
        check_spec_name(api, recipes[0], next(s for s in setups if isinstance(s, Setup)), overrides)
    report = AuditReport(vllm_version=api.version_text, command=command, engine=engine)
    jobs = []
    for recipe, setup in zip(recipes, setups, strict=True):
        if isinstance(setup, UsageError):  # this recipe's needs exceed the user's settings; the rest run
            own = resolve_setup(recipe, Overrides(worker="simulated", engine=engine))
            installed, fixed = (RunResult(logic, Outcome.UNTESTED, detail=str(setup))
                                for logic in ("installed", "fixed"))
            report.rows.append(AuditRow(recipe.bug or "-", recipe, own, installed, fixed, _fixed_in(recipe)))
        else:
            jobs.append((recipe, setup, _fixed_in(recipe)))
    # the level plays them (the serve level starts every recipe's servers at once)
    report.rows += level.audit_rows(api, jobs, lambda done, _total, what: progress(done, total, what))
    report.rows.sort(key=lambda row: (bug_order(row.bug), row.recipe.name))
    for done, bug in enumerate(measured, len(recipes)):
        progress(done, total, f"{bug.bug} {bug.doing}")
        try:
            report.metrics.append(MetricRow(bug.bug, bug.title, bug.refs, take_measurement(bug, api), level=engine))
        except MeasurementIncomplete as exc:
            report.metrics.append(MetricRow(bug.bug, bug.title, bug.refs, None, error=str(exc), level=engine))
    return report


def _audit_setup(recipe: Recipe, overrides: Overrides, default_worker: str | None) -> Setup | UsageError:
    """A recipe's setup at the user's flags, or why it cannot run there (audit makes that row untested).
    A --model over a recipe's own KV layout is resolved as `repro` resolves it: the run measures whether the
    model's groups hold the trigger (`kv_layout.TriggerGroupsMissing`)."""
    try:
        return resolve_setup(recipe, overrides, worker_fallback=True, default_worker=default_worker)
    except UsageError as exc:
        return exc


def _fixed_in(recipe: Recipe) -> FixedIn | None:
    """The first release where kvdoctor measured a built-in recipe stop reproducing, if any."""
    return fixed_in(recipe.name) if recipe.builtin else None


