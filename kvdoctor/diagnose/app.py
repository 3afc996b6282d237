"""The `diagnose` application function: read the log, match, run the matches, say what next.

Free of Typer and of formatting: returns a `DiagnoseReport` for
`kvdoctor.report.diagnose` to render. vLLM is imported only when a matched
recipe is run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any

from kvdoctor.diagnose.kinds import ENGINE, GENERIC_FRAMES, STARTUP, CrashKind, classify
from kvdoctor.diagnose.match import Candidate, MatchResult, innermost_vllm, match_log
from kvdoctor.diagnose.reader import LogSummary, read_log
from kvdoctor.diagnose.startup import CONFIRMED, StartupCheck, startup_check
from kvdoctor.diagnose.traceback import display_path
from kvdoctor.engine.overrides import Overrides
from kvdoctor.engine.serve_args import MappedGeometry, setup_overrides_from_serve_args
from kvdoctor.errors import ExitStatus, UsageError, VllmUnavailableError
from kvdoctor.export.script import export_script
from kvdoctor.installed import vllm_version
from kvdoctor.levels.scheduler import run_scenario
from kvdoctor.matrix.known import fixed_in
from kvdoctor.outcome_codes import exit_code_for
from kvdoctor.recipes.model import Recipe, Signature, Step
from kvdoctor.recipes.writer import recipe_to_toml
from kvdoctor.resolution import resolve_setup
from kvdoctor.results import RunResult

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
    results: list[RunResult] = field(default_factory=list)  # installed first
    log_geometry_attempt: list[RunResult] = field(default_factory=list)  # results under the log geometry, if replaced
    log_geometry_problem: str = ""

    @property
    def installed(self) -> RunResult | None:
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
    fixed_in: dict[str, Any] = field(default_factory=dict)  # recipe -> FixedIn | None
    starting_recipe: str = ""  # TOML, when no known bug matches a complete crash
    script: str = ""  # the exported standalone script of the best match
    command: str = ""
    startup: StartupCheck | None = None  # a start-up failure: `kvdoctor check` at the log's (and the user's) flags

    @property
    def versions_differ(self) -> bool:
        return bool(self.summary.version and self.installed_vllm
                    and self.summary.version.split("+")[0] != self.installed_vllm.split("+")[0])

    @property
    def kind(self) -> CrashKind | None:
        """Where the log's crash happened (engine, transfer worker, start-up, native): its traceback's, else its
        loose lines'; None when the log shows neither."""
        from kvdoctor.diagnose.kinds import from_loose

        body = self.summary.crash if self.summary.crash is not None else from_loose(self.summary.loose)
        return classify(body) if body is not None else None

    @property
    def no_recipe_reason(self) -> str:
        """Why there is no starting recipe to write ("" when there is one)."""
        if self.starting_recipe:
            return ""
        if self.match.candidates:
            bugs = ", ".join(self.match.best_bugs)
            return f"a known bug matches ({bugs}): its recipe is `kvdoctor repro {self.match.best[0].recipe.name}`"
        if not self.summary.holds_crash:
            return "the log holds no engine crash to start from"
        kind = self.kind
        if kind is not None and kind is not ENGINE:
            return (f"the crash is a {kind.label}: a recipe drives the scheduler, which this crash is not in")
        crash = self.summary.crash
        if crash is not None and crash.cut_short:
            return ("the traceback is cut short before its exception line: a recipe needs the exception and the "
                    "function it was raised in (find the rest of the traceback, or write the recipe's [signature] "
                    "by hand)")
        return "the log names no function and exception to start from"

    @property
    def hunt_command(self) -> str:
        """For an unknown crash in the engine: the `kvdoctor hunt` command that aims explore at its site (the log's
        exception, function and statement; the features it names forced; known bugs' triggers excluded), with
        `--target` to fill in where the log names no site ("" for a known bug or no engine crash)."""
        if self.match.candidates or not self.summary.holds_crash or self.kind not in (ENGINE, None):
            return ""
        from kvdoctor.hunt.aim import aim_from_log

        try:
            aim_from_log(self.summary, self.match)
        except UsageError:
            return "kvdoctor hunt LOG --target EXCEPTION:FUNCTION"
        return "kvdoctor hunt LOG  (or: kvdoctor diagnose LOG --hunt)"

    @property
    def unnamed_crash(self) -> bool:
        """The log holds a crash and no known bug fits it."""
        return not self.match.candidates and self.summary.holds_crash

    @property
    def exit_status(self) -> ExitStatus:
        if self.startup is not None and self.startup.verdict == CONFIRMED:
            return ExitStatus.STARTUP_REFUSED  # vLLM's start-up refuses these flags here, as the log says
        if self.unnamed_crash:
            return ExitStatus.UNNAMED_CRASH
        if self.vllm_error:
            return ExitStatus.VLLM_UNAVAILABLE
        if not self.runs:
            return ExitStatus.NOT_REPRODUCED
        installed = self.runs[0].installed
        if installed is None:
            return ExitStatus.NOT_REPRODUCED

        return exit_code_for(installed)


def scale_geometry(geometry: MappedGeometry) -> tuple[Overrides, list[str]]:
    """The log's overrides with production-sized values dropped (the recipe's are used), and what was dropped."""
    overrides = geometry.overrides
    notes = []
    for name, limit in TOY_LIMITS.items():
        value = getattr(overrides, name)
        if isinstance(value, int) and value > limit:
            overrides = overrides.replaced(**{name: limit})
            notes.append(f"{name} {value:,} is production-sized: scaled down to {limit:,}")
    return overrides, notes


def fixing_releases(recipes: list[Any]) -> dict[str, Any]:
    """Per recipe: the first measured release where it stops reproducing and the last where it does
    (`kvdoctor matrix` measurements, `kvdoctor/data/release_outcomes.toml`); None when unknown."""
    return {recipe.name: fixed_in(recipe.name) for recipe in recipes}


def _run_candidate(api: Any, candidate: Candidate, overrides: Overrides, logics: list[str],
                   progress: Callable[[str], None] | None = None) -> RecipeRun:
    recipe = candidate.recipe

    def run_all(setup: Any, geometry: str) -> list[Any]:
        results = []
        for logic in logics:
            if progress is not None:
                progress(f"{recipe.name} ({recipe.bug or '-'}): {logic} logic, {geometry}")
            results.append(run_scenario(api, recipe, setup, logic))
        return results

    problem = ""
    setup = None
    try:
        setup = resolve_setup(recipe, overrides)
    except UsageError as exc:
        problem = f"the log's geometry does not fit this recipe: {exc}"
    attempt: list[Any] = []
    if setup is not None and not overrides.any_given():  # the log names no geometry: the recipe's own it is
        return RecipeRun(recipe, setup, "recipe", run_all(setup, "the recipe's geometry"))
    if setup is not None:
        attempt = run_all(setup, "the log's geometry")
        if attempt[0].outcome.value in _FINE:
            return RecipeRun(recipe, setup, "log", attempt)
        problem = f"under the log's geometry the run ended {attempt[0].outcome.value}: {attempt[0].detail}"
    own = resolve_setup(recipe)
    results = run_all(own, "the recipe's geometry")
    return RecipeRun(recipe, own, "recipe", results, log_geometry_attempt=attempt, log_geometry_problem=problem)


def _code_for_contains(code: str) -> str | None:
    """The failing statement's most telling line (a multi-line assert's `assert (` names nothing)."""
    lines = [line.strip() for line in code.split("\n") if line.strip()]
    named = [line for line in lines if any(ch.isalpha() for ch in line.replace("assert", ""))]
    best = lines[0] if len(lines) == 1 else max(named, key=len) if named else None
    return best if best and len(best) <= 200 else None


def _fragment_recipe(summary: LogSummary, overrides: Overrides) -> str:
    """A starting recipe from a fragment (no whole traceback): a frame's function and its exception or
    statement; "" when the fragment names no function."""
    loose = summary.loose
    if loose is None or not loose.frames:
        return ""
    frame = loose.frames[-1]
    statement = frame.code or (loose.statements[-1].text if loose.statements else "")
    exceptions = [e for e in loose.exceptions if not e[0].endswith(("DeadError", "GenerateError"))]
    exception = exceptions[-1][0] if exceptions else ("AssertionError" if statement.startswith("assert") else None)
    if exception is None:
        return ""
    return _recipe_toml(exception, frame.function, display_path(frame.file), frame.line,
                        _code_for_contains(statement) if statement else None, (), overrides)


def starting_recipe_toml(summary: LogSummary, overrides: Overrides) -> str:
    """The crash's signature as a recipe file to edit: steps are a placeholder the user replaces."""
    crash = summary.crash
    inner = innermost_vllm(crash) if crash is not None else None
    if crash is None or inner is None or crash.exception is None:
        return ""  # nothing to start from (the caller asks only for a complete crash with a vLLM frame)
    frames = crash.vllm_frames
    above = frames[:frames.index(inner)] if inner in frames else frames[:-1]
    callers = tuple(dict.fromkeys(f.function for f in above if f.function not in GENERIC_FRAMES))[-3:]
    contains = _code_for_contains(inner.code) if inner.code else None
    return _recipe_toml(crash.exception, inner.function, display_path(inner.file), inner.line, contains, callers,
                        overrides)


def _recipe_toml(exception: str, function: str, file: str, line: int, contains: str | None,
                 callers: tuple[str, ...], overrides: Overrides) -> str:
    setup = {k: v for k, v in overrides.given().items() if k in (
        "block_size", "blocks_per_chunk", "gpu_blocks", "async_scheduling", "max_num_seqs", "max_num_batched_tokens",
        "max_model_len", "enable_chunked_prefill", "offload_prompt_only", "cpu_bytes_to_use", "spec_name")}
    recipe = Recipe(
        name="from-log",
        summary=(f"{exception} in {function} ({file}:{line}), read from "
                 f"a vLLM log by kvdoctor diagnose. No known bug matches it. Replace the placeholder steps "
                 f"with the events that lead there, then run: kvdoctor repro this-file.toml"),
        title=f"{exception} in {function}",
        signature=Signature(exception=exception, function=function, contains=contains, callers=callers),
        steps=(Step("add", {"request": "A", "prompt_chunks": 2, "max_tokens": 4}, 0), Step("schedule", {}, 0)),
        setup=setup,
    )
    return recipe_to_toml(recipe, header="Starting recipe written by `kvdoctor diagnose` from a crash no "
                                         "known bug matches.\nThe [signature] is the crash's; the steps are "
                                         "placeholders.")


def diagnose(log: str, run: bool = True, logic: str = "both", command: str = "",
             stdin: IO[bytes] | None = None, progress: Callable[[str], None] | None = None,
             serve_flags: list[str] | None = None) -> DiagnoseReport:
    """`serve_flags`: `vllm serve` flags given after `--`, over the log's own, for a start-up failure's check."""
    if logic not in ("installed", "fixed", "both"):
        raise UsageError(f"--logic must be installed, fixed or both, got {logic!r}")
    from kvdoctor.diagnose.serveline import argv_args

    user_args = argv_args(serve_flags or [])
    if serve_flags and not user_args:
        raise UsageError(f"after --: vllm serve flags (--name value), got {' '.join(serve_flags)!r}")
    summary = read_log(log, stdin=stdin)
    from kvdoctor.recipes.builtins import all_builtins

    recipes = all_builtins()
    match = match_log(summary, recipes)
    if not match.candidates and summary.crash is None and summary.fatal_line is not None:
        match = MatchResult(why_none=f"the engine's fatal error is at line {summary.fatal_line}, but no frame of "
                                     f"its traceback follows it in this log: nothing to match a signature against",
                            ruled_out=match.ruled_out)
    if not match.candidates and not summary.holds_crash and summary.crash is not None:
        crash = summary.crash  # logged as a warning: the process went on, whatever the traceback lacks
        site = innermost_vllm(crash)
        match = MatchResult(why_none=f"no engine crash: the traceback ({classify(crash).label}"
                                     + (f", {crash.exception} in {site.function}" if crash.exception and site else "")
                                     + f") was logged as a {crash.level}: the process went on",
                            ruled_out=match.ruled_out)
    geometry = setup_overrides_from_serve_args(summary.serve_args)
    overrides, scaled = scale_geometry(geometry)
    report = DiagnoseReport(summary=summary, match=match, geometry=geometry, scaled=scaled, command=command,
                            installed_vllm=vllm_version())
    report.fixed_in = fixing_releases([c.recipe for c in match.candidates])
    startup = report.kind is STARTUP
    if user_args and not startup:
        raise UsageError("the flags after -- are for a start-up failure's check (kvdoctor check); this log's crash "
                         "is " + (f"a {report.kind.label}" if report.kind is not None else "not in it"))
    if startup and run and not match.candidates:
        if progress is not None:
            progress("running vLLM's start-up at the log's flags (kvdoctor check)")
        try:
            report.startup = startup_check(summary.serve_args, user_args, summary.crash, command=command)
        except VllmUnavailableError as exc:
            report.vllm_error = str(exc)
    if not match.candidates:
        engine = summary.crash is None or classify(summary.crash) is ENGINE
        if not engine:
            pass  # a worker's, start-up or native crash: a scheduler recipe cannot start from it
        elif summary.crash is not None and not summary.crash.cut_short and innermost_vllm(summary.crash):
            report.starting_recipe = starting_recipe_toml(summary, overrides)
        elif report.unnamed_crash:
            report.starting_recipe = _fragment_recipe(summary, overrides)
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
        report.runs.append(_run_candidate(api, candidate, overrides, logics, progress))
    best = report.runs[0]
    if not best.recipe.signature.invariant:
        try:
            report.script = export_script(best.recipe, best.setup)
        except UsageError:
            report.script = ""
    return report
