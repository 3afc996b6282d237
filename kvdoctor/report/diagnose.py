"""`kvdoctor diagnose` output: rich renderables, the Markdown attachment and the JSON document.

Formatting only. Nothing of the log is shown beyond the crash's reconstructed
traceback (file paths trimmed to `vllm/...`), the version and the redacted
serve arguments of interest: no request lines, hostnames, paths or secrets.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from kvdoctor import SCHEMA_VERSION, __version__
from kvdoctor.check.app import as_dict as check_as_dict
from kvdoctor.diagnose.kinds import ENGINE, describe_native
from kvdoctor.diagnose.match import innermost_vllm
from kvdoctor.diagnose.redact import format_value, redact_serve_args
from kvdoctor.diagnose.traceback import display_path

if TYPE_CHECKING:  # the types only: this module formats what the CLI hands it
    from kvdoctor.diagnose.app import DiagnoseReport
    from kvdoctor.engine.setup import Setup
    from kvdoctor.recipes.model import Recipe
    from kvdoctor.results import RunResult


def _refs(recipe: Recipe) -> tuple[list[str], list[str]]:
    issues = [r for r in recipe.refs if "(issue" in r]
    fixes = [r for r in recipe.refs if "(fix" in r]
    return issues, fixes


def _ref_link(ref: str) -> str:
    number = ref.split("#", 1)[1].split(" ", 1)[0] if "#" in ref else ""
    kind = "pull" if "(fix" in ref or "(introduced" in ref else "issues"
    return f"https://github.com/vllm-project/vllm/{kind}/{number}" if number.isdigit() else ""


def log_lines(report: DiagnoseReport) -> list[str]:
    s = report.summary
    out = [f"log: {s.source} ({s.lines:,} line{'' if s.lines == 1 else 's'} read)"]
    if s.read_note:
        out.append(f"note: {s.read_note}")
    if s.version:
        out.append(f"vLLM version in the log: {s.version} (from the {s.version_source})")
    else:
        out.append("vLLM version in the log: not found (no start-up banner)")
    if s.serve_args:
        shown = redact_serve_args(s.serve_args)
        out.append(f"serve arguments (from the {s.args_source}):")
        out += [f"  {k} = {format_value(v)}" for k, v in shown.items()]
    else:
        out.append("serve arguments: not in the log")
    for note in report.geometry.notes:
        out.append(f"  note: {note}")
    if s.features:
        out.append("features the log names:")
        out += [f"  {n.feature}" + (f" ({n.detail})" if n.detail else "") + f": line {n.line}: `{n.evidence}`"
                for n in s.features.values()]
    return out


def crash_lines(report: DiagnoseReport) -> list[str]:
    s = report.summary
    crash = s.crash
    loose = s.loose
    if crash is None and loose is not None and (loose.frames or loose.statements or loose.exceptions):
        out = ["no whole traceback; the log shows:"]
        out += [f"  frame: {display_path(f.file)}" + (f":{f.line}" if f.line else "") + f" in {f.function}"
                for f in loose.frames[-6:]]
        out += [f"  statement (line {st.line}): {' '.join(st.text.split())[:200]}" for st in loose.statements[-4:]]
        out += [f"  exception (line {number}): {name}" + (f": {message[:200]}" if message else "")
                for name, message, number in loose.exceptions[-3:]]
        if s.fatal_line is not None:
            out.append(f"  the engine's fatal-error line (line {s.fatal_line})")
        return out
    if crash is None:
        if loose is not None and loose.dump_line is not None:
            return [f"vLLM's crash dump starts at line {loose.dump_line}, but the engine's traceback is not in "
                    f"this log"]
        if s.fatal_line is not None:
            return [f"the engine's fatal error is at line {s.fatal_line} of the log, but its traceback is cut short "
                    f"before its first frame"]
        if s.reraise_seen:
            return ["no engine crash found in this log: only the API server's EngineDeadError, which says the "
                    "engine died; its own traceback is earlier in the full log (look for `EngineCore "
                    "encountered a fatal error`)"]
        return ["no engine crash found in this log"]
    out = []
    kind = report.kind or ENGINE  # a crash always has one (DiagnoseReport.kind is None only without a crash)
    who = f"in {crash.process}" if crash.process else "(no process prefix)"
    if crash.native:
        out.append(f"{kind.label} {who}: {describe_native(crash)}")
        if crash.header:
            out.append(f"  the log says: {crash.header}")
        if crash.frames:
            out.append("native frames (outermost first):")
            out += [f"  {f.function}" + (f" ({display_path(f.file)}:{f.line})" if f.file != "<unknown>" else "")
                    for f in crash.frames[-10:]]
        return out
    if crash.cut_short:
        out.append(f"{kind.label} {who}, cut short before its exception line")
    else:
        out.append(f"{kind.label} {who}")
        out.append(f"exception: {crash.exception}" + (f": {crash.message}" if crash.message else "")
                   + {"above": " (the exception line was pasted above its frames)",
                      "header": " (from the line that announced the traceback)"}.get(crash.exception_from, ""))
    if crash.header and not crash.native:
        out.append(f"the log says: {crash.header}")
    inner = innermost_vllm(crash)
    if inner is not None and not crash.cut_short:
        out.append(f"where: {display_path(inner.file)}:{inner.line} in {inner.function}()")
        if inner.code:
            out.append(f"code: {inner.code}")
    frames = crash.vllm_frames
    if inner is not None and not crash.cut_short and inner in frames:
        frames = frames[:frames.index(inner)]
    if frames:
        out.append("vLLM frames (outermost first):")
        out += [f"  {display_path(f.file)}:{f.line} {f.function}" + (f": {f.code}" if f.code else "")
                for f in frames[-12:]]
    if crash.elided:
        out.append("(frames are missing from the log above this point: elided or cut)")
    if s.reraise_seen:
        out.append("the API server's EngineDeadError re-raise is a consequence; the engine's own traceback "
                   "is the crash")
    return out


def fix_text(known_fix: Any) -> str:
    """`fixed in vLLM 0.27.0; last reproducing 0.26.0`, from kvdoctor's own matrix measurements."""
    if known_fix is None:
        return "fixing release: none in kvdoctor's release measurements (not measured, or still reproducing)"
    return (f"fixed in vLLM {known_fix.release}; last reproducing {known_fix.last_reproducing} "
            f"(kvdoctor matrix, measured {known_fix.measured_on})")


def _per_bug(candidates: list[Any]) -> list[tuple[str, list[Any]]]:
    out: dict[str, list[Any]] = {}
    for c in candidates:
        out.setdefault(c.recipe.bug or c.recipe.name, []).append(c)
    return list(out.items())


def _what_was_seen(report: DiagnoseReport) -> str:
    s = report.summary
    crash = s.crash
    if crash is not None and crash.native:
        return f"a native crash: {describe_native(crash)}"
    if crash is not None and not crash.cut_short:
        inner = innermost_vllm(crash) or (crash.frames[-1] if crash.frames else None)
        where = f" in {inner.function} ({display_path(inner.file)})" if inner is not None else ""
        return f"{crash.exception}{where}"
    if crash is not None:
        deepest = crash.frames[-1] if crash.frames else None
        return "a traceback cut short before its exception line" + (f" (last frame {deepest.function})"
                                                                    if deepest else "")
    loose = s.loose
    if loose is not None and (loose.frames or loose.statements or loose.exceptions):
        bits = []
        if loose.exceptions:
            bits.append(loose.exceptions[-1][0])
        if loose.statements:
            bits.append(f"`{' '.join(loose.statements[-1].text.split())[:100]}`")
        if loose.frames:
            bits.append(f"in {loose.frames[-1].function}")
        return " ".join(bits)
    if s.fatal_line is not None:
        return f"the engine's fatal-error line (line {s.fatal_line}) without its traceback"
    if loose is not None and loose.dump_line is not None:
        return f"vLLM's crash dump (line {loose.dump_line}) without the engine's traceback"
    return "only the API server's EngineDeadError (the engine died; its traceback is not in this log)"


def match_lines(report: DiagnoseReport) -> list[str]:
    m = report.match
    if not m.candidates:
        if not report.summary.holds_crash:
            crash = report.summary.crash
            if crash is not None:
                label = (report.kind or ENGINE).label
                return [(f"no engine crash found in this log: the {label} above was logged as a "
                         f"{crash.level} (the process went on), and no known bug matches it")]
            return ["no engine crash found in this log"]
        out = [f"a crash no known bug matches: {_what_was_seen(report)}"]
        if m.why_none.startswith("the engine's fatal error"):
            out.append(f"  cannot name a bug: {m.why_none}")
        if m.nearest:
            out.append("nearest known bugs, and why they are ruled out:")
            out += [f"  {r.bug}: {r.reason}" for r in m.nearest]
        else:
            out.append("no known bug's crash site shares its function, file or statement")
        if report.starting_recipe:
            out.append("starting recipe with the crash's signature (write it with --write-recipe FILE, edit its "
                       "steps, then `kvdoctor repro FILE`):")
        return out
    out = []
    for bug, cands in _per_bug(m.candidates):
        first = cands[0]
        names = ", ".join(c.recipe.name for c in cands)
        out.append(f"{bug} ({names}): {first.why}")
        for reason in first.reasons:
            out.append(f"  - {reason}")
        if first.gaps:
            out.append(f"  not confirmed: {'; '.join(first.gaps)}")
        out.append(f"  {fix_text(report.fixed_in.get(first.recipe.name))}")
    bugs = m.best_bugs
    if len(m.best) > 1 and len(bugs) == 1:
        out.append(f"the best matches are one bug ({bugs[0]}) reached by different paths; the simplest is run "
                   f"below")
    elif len(bugs) > 1:
        out.append(f"the log cannot tell {', '.join(bugs)} apart (the same evidence); the simplest recipe of each "
                   f"is run below")
    return out


def run_lines(report: DiagnoseReport) -> list[str]:
    out = []
    if report.vllm_error:
        return [f"not run: {report.vllm_error}"]
    if not report.runs:
        return []
    installed = report.installed_vllm or "not installed"
    out.append(f"ran on the installed vLLM {installed}")
    if report.versions_differ:
        out.append(f"note: the log is from vLLM {report.summary.version}, the installed vLLM is {installed}: the "
                   f"verdict below is about {installed}")
    elif not report.summary.version:
        out.append(f"note: the log does not say its vLLM version; the verdict below is about {installed}")
    for note in report.scaled:
        out.append(f"geometry: {note}")
    for run in report.runs:
        if run.geometry == "log":
            where = "the log's geometry" + (" (scaled down where production-sized)" if report.scaled else "")
        elif run.log_geometry_problem:
            where = "the recipe's own geometry"
        else:
            where = "the recipe's own geometry (the log names none of its serve arguments)"
        out.append(f"{run.recipe.name} ({run.recipe.bug or '-'}) with {where}: {_setup_text(run.setup)}")
        if run.log_geometry_problem:
            out.append(f"  {run.log_geometry_problem}")
        for result in run.results:
            out.append(f"  {result.logic:<10} {result.outcome.value:<15} {_why(result)}")
        out.append(f"  {fix_text(report.fixed_in.get(run.recipe.name))}")
    return out


def _setup_text(setup: Setup) -> str:
    from kvdoctor.report.tables import setup_line

    return setup_line(setup)


def _why(result: RunResult) -> str:
    from kvdoctor.report.tables import why

    return why(result).replace("\n", "; ")


def _kind_lines(report: DiagnoseReport) -> list[str]:
    """What kvdoctor can and cannot check for a crash outside the scheduler (a worker's, start-up, native)."""
    kind = report.kind
    if kind is None or kind is ENGINE:
        return []
    out = [f"this is a {kind.label}, not the scheduler's:"]
    from kvdoctor.diagnose.kinds import from_loose, startup_cause

    body = report.summary.crash or from_loose(report.summary.loose)
    cause = startup_cause(body) if body is not None and kind.name == "start-up" else ""
    if cause:
        out.append(f"  what vLLM's message means: {cause}")
    if kind.can:
        out.append(f"  kvdoctor can: {kind.can}")
    if kind.cannot:
        out.append(f"  kvdoctor cannot: {kind.cannot}")
    return out


def next_lines(report: DiagnoseReport, in_report: bool = False) -> list[str]:
    """`in_report`: for the --report attachment itself (it does not tell its reader to make one)."""
    attach = "attach this report" if in_report else "`kvdoctor diagnose LOG --report FILE`"
    if not report.match.candidates:
        if not report.summary.holds_crash:
            return _kind_lines(report)
        out = []
        crash = report.summary.crash
        if crash is None and report.summary.fatal_line is not None:
            out.append("find the engine's traceback under its fatal-error line in the full log and run kvdoctor "
                       "diagnose on that")
        elif crash is not None and crash.cut_short:
            out.append("find the rest of the traceback in the full log (from its `Traceback` line to the "
                       "exception line under it) and run kvdoctor diagnose on that")
        out += _kind_lines(report)
        if report.startup is not None and not in_report:
            out.append("check the deployment's other flags the same way: kvdoctor diagnose LOG -- --flag value ... "
                       "(vllm serve's flags, over the log's), or kvdoctor check FLAGS before deploying")
        if report.starting_recipe and not in_report:
            out.append("write a starting recipe: kvdoctor diagnose LOG --write-recipe FILE")
        if report.hunt_command:
            out.append(f"hunt for a route to it: {report.hunt_command}")
        out.append(f"file an upstream issue with the traceback (and {attach})")
        return out
    recipe = report.runs[0].recipe if report.runs else report.match.best[0].recipe
    issues, fixes = _refs(recipe)
    out = [f"{recipe.bug or recipe.name}: {fix_text(report.fixed_in.get(recipe.name))}"]
    for ref in issues:
        out.append(f"upstream issue: {ref} {_ref_link(ref)}".rstrip())
    for ref in fixes:
        out.append(f"fix: {ref} {_ref_link(ref)}".rstrip())
    if recipe.workaround:
        out.append(f"workaround: {recipe.workaround}")
    run = report.runs[0] if report.runs else None
    if run is not None and run.installed is not None and run.installed.outcome.value == "reproduced":
        fixed = next((r for r in run.results if r.logic == "fixed"), None)
        if fixed is not None and fixed.outcome.value == "not_reproduced":
            out.append("the fixed logic (PR #49146 cap) prevents it on this vLLM")
    out.append(f"reproduce: kvdoctor repro {recipe.name}"
               + ("" if in_report else "   ·   attach: kvdoctor diagnose LOG --report FILE"))
    return out


def startup_lines(report: DiagnoseReport) -> list[str]:
    """A start-up failure's check: vLLM's start-up run here at the log's flags (`kvdoctor check`)."""
    from kvdoctor.diagnose.startup import CONFIRMED, STARTS
    from kvdoctor.report.check import stage_lines, verdict_lines

    startup = report.startup
    if startup is None:
        return []
    crash = report.summary.crash
    logged = f"{crash.exception}" if crash is not None and crash.exception else "the log's failure"
    verdict = {CONFIRMED: f"confirmed: vLLM's start-up refuses these flags here as the log says ({logged})",
               STARTS: ("not reproduced: vLLM starts here at these flags; the log's failure depends on its host "
                        "(memory, /dev/shm, other nodes) or on a flag the log does not show: add it after `--`")}
    lines = [f"kvdoctor check at {startup.flags_from}, on vLLM {startup.result.vllm_version}:",
             verdict.get(startup.verdict, f"vLLM refuses these flags here, but not as the log says ({logged})")]
    lines += verdict_lines(startup.result)[1:] if startup.result.refusal is not None else []
    lines += stage_lines(startup.result)
    return lines + [f"  note: {note}" for note in startup.notes]


SECTIONS = (("What the log says", log_lines), ("The crash", crash_lines), ("Which known bug", match_lines),
            ("Start-up, checked here", startup_lines), ("The run", run_lines), ("What to do next", next_lines))


def diagnose_renderables(report: DiagnoseReport) -> list[Any]:
    from rich.text import Text

    from kvdoctor.report.layout import Hanging

    out: list[Any] = []
    for title, lines in SECTIONS:
        body = lines(report)
        if not body:
            continue
        out.append(Text(title, style="bold underline"))
        out += [Hanging(line) for line in body]  # plain text: `[...]` from a log is not rich markup
        if title == "Which known bug" and report.starting_recipe:
            out.append(Text(report.starting_recipe.rstrip()))
        out.append(Text(""))
    return out


def render_diagnose_markdown(report: DiagnoseReport) -> str:
    from kvdoctor.report.markdown import _env_section, _scrub

    lines = [f"# kvdoctor diagnose: {report.summary.source}", "",
             f"_Generated {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}_", ""]
    lines += _env_section()
    for title, fn in SECTIONS:
        body = next_lines(report, in_report=True) if fn is next_lines else fn(report)
        if not body:
            continue
        lines += [f"## {title}", "", "```", *body, "```", ""]
        if title == "Which known bug" and report.starting_recipe:
            lines += ["```toml", report.starting_recipe.rstrip(), "```", ""]
    if report.script:
        lines += ["## Standalone reproducer", "",
                  f"`python repro.py` exits 1 with vLLM's traceback on the crash ({report.runs[0].recipe.name}):", "",
                  "<details><summary>repro.py</summary>", "", "```python", report.script.rstrip(), "```", "",
                  "</details>", ""]
    return _scrub("\n".join(lines)) + "\n"


def _fix_doc(known_fix: Any) -> dict[str, Any]:
    if known_fix is None:
        return {"fixed_in": None, "last_reproducing": None}
    return {"fixed_in": known_fix.release, "last_reproducing": known_fix.last_reproducing}


def diagnose_document(report: DiagnoseReport) -> dict[str, Any]:
    s = report.summary
    crash = s.crash
    inner = innermost_vllm(crash) if crash is not None else None
    return {
        "schema_version": SCHEMA_VERSION,
        "kvdoctor_version": __version__,
        "command": "diagnose",
        "startup_check": None if report.startup is None else {
            "flags_from": report.startup.flags_from, "verdict": report.startup.verdict,
            "notes": report.startup.notes, "check": check_as_dict(report.startup.result)},
        "log": {"source": s.source, "lines": s.lines, "vllm_version": s.version, "version_source": s.version_source,
                "serve_args": redact_serve_args(s.serve_args), "args_source": s.args_source,
                "read_note": s.read_note or None,
                "features": [{"feature": n.feature, "detail": n.detail or None, "line": n.line, "evidence": n.evidence}
                             for n in s.features.values()]},
        "crash": None if crash is None else {
            "process": crash.process, "exception": crash.exception, "message": crash.message,
            "cut_short": crash.cut_short, "elided": crash.elided, "kind": (report.kind or ENGINE).name,
            "native": crash.native, "header": crash.header or None, "exception_from": crash.exception_from or None,
            "kvdoctor_can": (report.kind or ENGINE).can or None,
            "kvdoctor_cannot": (report.kind or ENGINE).cannot or None,
            "file": display_path(inner.file) if inner else None, "line": inner.line if inner else None,
            "function": inner.function if inner else None, "code": inner.code if inner else None,
            "vllm_frames": [{"file": display_path(f.file), "line": f.line, "function": f.function, "code": f.code}
                            for f in crash.vllm_frames],
        },
        "matches": [{"recipe": c.recipe.name, "bug": c.recipe.bug, "strength": c.strength, "why": c.why,
                     "score": c.score, "reasons": c.reasons, "not_confirmed": c.gaps, "wording": c.wording or None,
                     "found_in": c.unit, **_fix_doc(report.fixed_in.get(c.recipe.name))}
                    for c in report.match.candidates],
        "no_match_reason": report.match.why_none or None,
        "holds_crash": report.summary.holds_crash,
        "unnamed_crash": report.unnamed_crash,
        "ruled_out": [{"bug": r.bug, "reason": r.reason} for r in report.match.ruled_out],
        "starting_recipe": report.starting_recipe or None,
        "installed_vllm": report.installed_vllm,
        "versions_differ": report.versions_differ,
        "geometry_scaled": report.scaled,
        "geometry_notes": report.geometry.notes,
        "runs": [{"recipe": r.recipe.name, "bug": r.recipe.bug, "geometry": r.geometry, "setup": r.setup.as_dict(),
                  "log_geometry_problem": r.log_geometry_problem or None,
                  "results": [{"logic": x.logic, "outcome": x.outcome.value, "why": _why(x)} for x in r.results],
                  **_fix_doc(report.fixed_in.get(r.recipe.name))}
                 for r in report.runs],
        "vllm_error": report.vllm_error or None,
        "next": next_lines(report),
        "hunt_command": report.hunt_command or None,
        "exit_code": int(report.exit_status),
    }
