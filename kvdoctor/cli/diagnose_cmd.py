"""`kvdoctor diagnose LOG`: read a vLLM log, name the known bug, run its recipe here.

Registered in `kvdoctor.cli.app`; what commands share comes from
`kvdoctor.cli.common`, never from `kvdoctor.cli.app`. Importing this module stays
cheap (Typer only); the work is in `kvdoctor.diagnose.app`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from kvdoctor.cli import hunt_cmd
from kvdoctor.cli import options as opt
from kvdoctor.cli.common import command_line, run
from kvdoctor.hunt import DEFAULT_OUT, DEFAULT_TIME_BUDGET


def diagnose(
    log: Annotated[str, typer.Argument(
        help="A vLLM log file (or a pasted traceback); `-` reads stdin.", metavar="LOG")],
    logic: Annotated[str, typer.Option("--logic", help="installed | fixed | both: the logic the matches run "
                                                       "under.")] = "both",
    no_run: Annotated[bool, typer.Option("--no-run", help="Read and match only; run nothing (no vLLM "
                                                          "import).")] = False,
    json_out: opt.Json = False,
    output_format: opt.Format = None,
    report: opt.ReportFile = None,
    write_recipe: Annotated[Path | None, typer.Option(
        "--write-recipe", help="When no known bug matches, write the starting recipe to FILE.",
        rich_help_panel=opt.OUTPUT)] = None,
    hunt: Annotated[bool, typer.Option(
        "--hunt", help="Hunt for a route to the log's crash instead (the same as `kvdoctor hunt LOG`; its "
                       "--target, --force, --include-known, --time-budget and --out apply).",
        rich_help_panel=hunt_cmd.AIM)] = False,
    target: hunt_cmd.Target = None,
    force: hunt_cmd.Force = None,
    include_known: hunt_cmd.IncludeKnown = False,
    time_budget: hunt_cmd.TimeBudget = DEFAULT_TIME_BUDGET,
    out: hunt_cmd.Out = Path(DEFAULT_OUT),
    serve_flags: Annotated[list[str] | None, typer.Argument(
        help="After `--`: vllm serve flags (over the log's own) for a start-up failure's check, e.g. "
             "`-- --kv-offloading-size 64 --block-size 16`.", metavar="-- SERVE_FLAGS",
        show_default=False)] = None,
) -> None:
    """Read a vLLM log: the version, the serve arguments that matter and the engine's crash; name the
    known bug it matches (and why) and run that recipe on the installed vLLM under the installed and
    fixed logic, with the log's geometry (scaled down when production-sized).

    A log with no engine crash is not an error (exit 0); a crash no known bug matches exits 7. The
    installed logic's outcome on the best match sets the exit code. A start-up failure is checked here:
    vLLM's start-up runs at the log's serve flags (and those after `--`), as `kvdoctor check` runs it;
    exit 8 when it refuses them as the log says. LOG may be one pasted line
    (`kvdoctor diagnose "TimeoutError: ..."`) and a gzip, xz or bzip2 (zstd where the `zstandard`
    module is installed) compressed log; a file that is not text is refused (exit 2)."""
    def action() -> int:
        from kvdoctor.errors import UsageError

        aimed = [flag for flag, given in (("--target", target), ("--force", force), ("--include-known", include_known),
                                          ("--time-budget", time_budget != DEFAULT_TIME_BUDGET),
                                          ("--out", out != Path(DEFAULT_OUT))) if given]
        if not hunt and aimed:
            raise UsageError(f"{aimed[0]} is a hunt flag: add --hunt (or run kvdoctor hunt LOG)")
        unused = [flag for flag, given in (("--no-run", no_run), ("--report", report),
                                           ("--write-recipe", write_recipe), ("-- SERVE_FLAGS", serve_flags)) if given]
        if hunt and unused:
            raise UsageError(f"{unused[0]} is not a hunt flag: run kvdoctor diagnose LOG {unused[0]} without --hunt")
        if hunt:
            return hunt_cmd.hunt_action(log, target, force or [], include_known, time_budget, 0, True, out,
                                        output_format, json_out)
        from kvdoctor.diagnose import app as diagnose_app

        fmt = opt.output_format(output_format, json_out)
        for path in (report, write_recipe):  # before any run: a bad output path costs no vLLM import
            if path is not None and path.is_dir():
                raise UsageError(f"{path}: is a directory")
            if path is not None and not path.parent.is_dir():
                raise UsageError(f"{path}: no such directory {path.parent}")
        from kvdoctor.cli.progress import Progress

        with Progress("diagnose") as progress:
            result = diagnose_app.diagnose(log, run=not no_run, logic=logic, command=command_line(),
                                           stdin=_stdin_bytes() if log == "-" else None,
                                           progress=progress.update if progress.enabled else None,
                                           serve_flags=serve_flags)
        from kvdoctor.cli import output
        from kvdoctor.cli.failures import raise_unwritten
        from kvdoctor.report import diagnose as render
        from kvdoctor.report.formats import Shown

        shown = Shown(renderables=lambda: render.diagnose_renderables(result),
                      document=lambda: render.diagnose_document(result),
                      markdown=lambda: render.render_diagnose_markdown(result))
        unwritten = output.show(shown, fmt)
        if report is not None:
            unwritten += output.write_output(report, render.render_diagnose_markdown(result), "--report", "report")
        if write_recipe is not None:
            if result.starting_recipe:
                unwritten += output.write_output(write_recipe, result.starting_recipe, "--write-recipe",
                                                 "starting recipe")
            else:  # the diagnosis stands (its exit code too): only the file is not written, and why
                from kvdoctor.cli.streams import note

                note(f"--write-recipe: {write_recipe} not written: {result.no_recipe_reason}")
        raise_unwritten(unwritten)
        return int(result.exit_status)

    run(action, opt.wants_json(output_format, json_out))


def _stdin_bytes() -> Any:
    """`diagnose -`: the bytes of the command's stdin (`streams.Environment`)."""
    from kvdoctor.cli.streams import current

    stream = current().stdin_stream
    return getattr(stream, "buffer", stream)
