"""The `diagnose` application function: read the log, match, run the matches, say what next.

Free of Typer and of formatting: returns a `DiagnoseReport` for
`kvdoctor.report.diagnose` to render. vLLM is imported only when a matched
recipe is run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import IO, Any

from kvdoctor.diagnose.match import Candidate, MatchResult, innermost_vllm, match_crash
from kvdoctor.diagnose.reader import LogSummary, read_log
from kvdoctor.diagnose.traceback import display_path
from kvdoctor.engine.serve_args import MappedGeometry, setup_overrides_from_serve_args
from kvdoctor.errors import ExitStatus, UsageError, VllmUnavailableError

MAX_RUNS = 3  # matched recipes run at most: the simplest recipe of each best-ranked bug, in bug order
# Above these a geometry is production-sized: it is scaled down to the limit (and said). The
# recipes plan their triggers at whatever geometry they run (kvdoctor.recipes.geometry), so a
# clamped pool still holds them; the recipe's own tiny pool would not hold the log's chunks.
TOY_LIMITS = {"gpu_blocks": 512, "max_num_batched_tokens": 2048, "max_num_seqs": 64, "max_model_len": 2048,
              "cpu_bytes_to_use": 64 << 20}
_FINE = ("reproduced", "not_reproduced", "not_applicable")


@dataclass
class RecipeRun:
    recipe: Any  # Recipe
    setup: Any  # Setup
    geometry: str  # "log" (the log's geometry, scaled) | "recipe" (the recipe's own)
    results: list[Any] = field(default_factory=list)  # RunResult, installed first
    log_geometry_attempt: list[Any] = field(default_factory=list)  # results under the log geometry, if replaced
    log_geometry_problem: str = ""

    @property
    def installed(self) -> Any:
        return next((r for r in self.results if r.logic == "installed"), self.results[0] if self.results else None)


@dataclass
class DiagnoseReport:
    summary: LogSummary
    match: MatchResult
    geometry: MappedGeometry
    scaled: list[str] = field(default_factory=list)
    runs: list[RecipeRun] = field(default_factory=list)
    installed_vllm: str | None = None
    vllm_error: str = ""
    first_release_not_reproducing: dict[str, str | None] = field(default_factory=dict)
    matrix_note: str = ""
    starting_recipe: str = ""  # TOML, when no known bug matches a complete crash
    script: str = ""  # the exported standalone script of the best match
    command: str = ""

    @property
    def versions_differ(self) -> bool:
        return bool(self.summary.version and self.installed_vllm
                    and self.summary.version.split("+")[0] != self.installed_vllm.split("+")[0])

    @property
    def exit_status(self) -> ExitStatus:
        if self.vllm_error:
            return ExitStatus.VLLM_UNAVAILABLE
        if not self.runs:
            return ExitStatus.NOT_REPRODUCED
        installed = self.runs[0].installed
        if installed is None:
            return ExitStatus.NOT_REPRODUCED
        from kvdoctor.outcome_codes import exit_code_for

        return exit_code_for(installed.outcome)


def scale_geometry(geometry: MappedGeometry) -> tuple[dict[str, Any], list[str]]:
    """The log's overrides with production-sized values dropped (the recipe's are used), and what was dropped."""
    overrides = dict(geometry.overrides)
    notes = []
    for name, limit in TOY_LIMITS.items():
        value = overrides.get(name)
        if isinstance(value, int) and value > limit:
            overrides[name] = limit
            notes.append(f"{name} {value:,} is production-sized: scaled down to {limit:,}")
    return overrides, notes


def _installed_version() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


def _first_release_not_reproducing(report: DiagnoseReport) -> None:
    """Integration point with `kvdoctor matrix` (issue 9): measured release outcomes per recipe."""
    try:
        from kvdoctor.matrix.known import first_release_not_reproducing  # type: ignore[import-not-found]
    except ImportError:
        report.matrix_note = ("release outcomes are not known to this kvdoctor (no `kvdoctor matrix` data): "
                              "the first release without the bug is not named")
        return
    for run in report.runs:
        try:
            report.first_release_not_reproducing[run.recipe.name] = first_release_not_reproducing(run.recipe)
        except Exception as exc:  # noqa: BLE001 - matrix data must not break a diagnosis
            report.matrix_note = f"release outcomes could not be read: {exc}"


def _run_candidate(api: Any, candidate: Candidate, overrides: dict[str, Any], logics: list[str]) -> RecipeRun:
    from kvdoctor.app import resolve_setup
    from kvdoctor.scenario import run_scenario

    recipe = candidate.recipe
    problem = ""
    setup = None
    try:
        setup = resolve_setup(recipe, overrides)
    except UsageError as exc:
        problem = f"the log's geometry does not fit this recipe: {exc}"
    attempt: list[Any] = []
    if setup is not None and not overrides:  # the log names no geometry: the recipe's own it is
        return RecipeRun(recipe, setup, "recipe", [run_scenario(api, recipe, setup, logic) for logic in logics])
    if setup is not None:
        attempt = [run_scenario(api, recipe, setup, logic) for logic in logics]
        if attempt[0].outcome.value in _FINE:
            return RecipeRun(recipe, setup, "log", attempt)
        problem = f"under the log's geometry the run ended {attempt[0].outcome.value}: {attempt[0].detail}"
    own = resolve_setup(recipe, {})
    results = [run_scenario(api, recipe, own, logic) for logic in logics]
    return RecipeRun(recipe, own, "recipe", results, log_geometry_attempt=attempt, log_geometry_problem=problem)


def starting_recipe_toml(summary: LogSummary, overrides: dict[str, Any]) -> str:
    """The crash's signature as a recipe file to edit: steps are a placeholder the user replaces."""
    from kvdoctor.recipes.model import Recipe, Signature, Step
    from kvdoctor.recipes.writer import recipe_to_toml

    crash = summary.crash
    inner = innermost_vllm(crash)
    callers = tuple(dict.fromkeys(f.function for f in crash.vllm_frames[:-1]))[-3:]
    contains = inner.code if inner.code and len(inner.code) <= 200 else None
    setup = {k: v for k, v in overrides.items() if k in (
        "block_size", "blocks_per_chunk", "gpu_blocks", "async_scheduling", "max_num_seqs", "max_num_batched_tokens",
        "max_model_len", "enable_chunked_prefill", "offload_prompt_only", "cpu_bytes_to_use", "spec_name")}
    recipe = Recipe(
        name="from-log",
        summary=(f"{crash.exception} in {inner.function} ({display_path(inner.file)}:{inner.line}), read from "
                 f"a vLLM log by kvdoctor diagnose. No known bug matches it. Replace the placeholder steps "
                 f"with the events that lead there, then run: kvdoctor repro this-file.toml"),
        title=f"{crash.exception} in {inner.function}",
        signature=Signature(exception=crash.exception, function=inner.function, contains=contains,
                            callers=callers),
        steps=(Step("add", {"request": "A", "prompt_chunks": 2, "max_tokens": 4}, 0), Step("schedule", {}, 0)),
        setup=setup,
    )
    return recipe_to_toml(recipe, header="Starting recipe written by `kvdoctor diagnose` from a crash no "
                                         "known bug matches.\nThe [signature] is the crash's; the steps are "
                                         "placeholders.")


def diagnose(log: str, run: bool = True, logic: str = "both", command: str = "",
             stdin: IO[bytes] | None = None) -> DiagnoseReport:
    if logic not in ("installed", "fixed", "both"):
        raise UsageError(f"--logic must be installed, fixed or both, got {logic!r}")
    summary = read_log(log, stdin=stdin)
    from kvdoctor.recipes.builtins import all_builtins

    recipes = all_builtins()
    match = match_crash(summary.crash, recipes)
    if summary.crash is None and summary.fatal_line is not None:
        match = MatchResult(why_none=f"the engine's fatal error is at line {summary.fatal_line}, but no frame of "
                                     f"its traceback follows it in this log: nothing to match a signature against")
    geometry = setup_overrides_from_serve_args(summary.serve_args)
    overrides, scaled = scale_geometry(geometry)
    report = DiagnoseReport(summary=summary, match=match, geometry=geometry, scaled=scaled, command=command,
                            installed_vllm=_installed_version())
    if not match.candidates:
        if summary.crash is not None and not summary.crash.cut_short and innermost_vllm(summary.crash):
            report.starting_recipe = starting_recipe_toml(summary, overrides)
        return report
    if not run:
        return report
    logics = ["installed", "fixed"] if logic == "both" else [logic]
    try:
        from kvdoctor.engine import compat

        api = compat.load()
    except VllmUnavailableError as exc:
        report.vllm_error = str(exc)
        return report
    report.installed_vllm = api.version_text
    # One recipe per bug: a signature several bugs share (K1 and K6) runs each of them, not three
    # paths of the first.
    per_bug = list({(c.recipe.bug or c.recipe.name): c for c in reversed(match.best)}.values())[::-1]
    for candidate in per_bug[:MAX_RUNS]:
        report.runs.append(_run_candidate(api, candidate, overrides, logics))
    _first_release_not_reproducing(report)
    best = report.runs[0]
    if not best.recipe.signature.invariant:
        from kvdoctor.export.script import export_script

        try:
            report.script = export_script(best.recipe, best.setup)
        except UsageError:
            report.script = ""
    return report
