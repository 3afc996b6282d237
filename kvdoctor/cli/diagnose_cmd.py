"""`kvdoctor diagnose LOG`: read a vLLM log, name the known bug, run its recipe here.

Register with `app.command()(diagnose)` in `kvdoctor.cli.app`. Importing this
module stays cheap (Typer only); the work is in `kvdoctor.diagnose.app`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from kvdoctor.cli import options as opt


def diagnose(
    log: Annotated[str, typer.Argument(help="A vLLM log file (or a pasted traceback); `-` reads stdin.")],
    logic: Annotated[str, typer.Option("--logic", help="installed | fixed | both: the logic the matches run "
                                                       "under.")] = "both",
    no_run: Annotated[bool, typer.Option("--no-run", help="Read and match only; run nothing (no vLLM "
                                                          "import).")] = False,
    json_out: opt.Json = False,
    report: opt.ReportFile = None,
    write_recipe: Annotated[Optional[Path], typer.Option(
        "--write-recipe", help="When no known bug matches, write the starting recipe to FILE.",
        rich_help_panel=opt.OUTPUT)] = None,
) -> None:
    """Read a vLLM log: the version, the serve arguments that matter and the engine's crash; name the
    known bug it matches (and why) and run that recipe on the installed vLLM under the installed and
    fixed logic, with the log's geometry (scaled down when production-sized).

    A log with no engine crash is not an error (exit 0); a crash no known bug matches exits 7.

    Exit codes (the installed logic's outcome on the best match): 0 not reproduced or no crash · 1 reproduced · 2 bad path or flag · 3 vLLM missing · 4 other failure · 6 the run did not test the bug · 7 a crash no known bug matches."""  # noqa: E501
    from kvdoctor.cli.app import _command_line, _console, _run

    def action() -> int:
        from kvdoctor.diagnose import app as diagnose_app
        from kvdoctor.errors import UsageError

        for path in (report, write_recipe):  # before any run: a bad output path costs no vLLM import
            if path is not None and path.is_dir():
                raise UsageError(f"{path}: is a directory")
            if path is not None and not path.parent.is_dir():
                raise UsageError(f"{path}: no such directory {path.parent}")
        progress = _Progress()
        try:
            result = diagnose_app.diagnose(log, run=not no_run, logic=logic, command=_command_line(),
                                           progress=progress if progress.live else None)
        finally:
            progress.done()
        from kvdoctor.report import diagnose as render

        if json_out:
            from kvdoctor.report.json_doc import dumps

            typer.echo(dumps(render.diagnose_document(result)))
        else:
            console = _console()
            for item in render.diagnose_renderables(result):
                console.print(item)
        if report is not None:
            _write(report, render.render_diagnose_markdown(result), "report")
        if write_recipe is not None:
            if not result.starting_recipe:
                raise UsageError("--write-recipe: a known bug matches (or the log names no function and "
                                 "exception to start from); no starting recipe to write")
            _write(write_recipe, result.starting_recipe, "starting recipe")
        return int(result.exit_status)

    _run(action)


class _Progress:
    """Which recipe and variant is running, on one stderr line that is rewritten; only on a terminal."""

    def __init__(self) -> None:
        import sys

        self.stream = sys.stderr
        self.live = self.stream.isatty()
        self.shown = False

    def __call__(self, text: str) -> None:
        self.stream.write(f"\r\x1b[Kdiagnose: running {text} …")
        self.stream.flush()
        self.shown = True

    def done(self) -> None:
        if self.shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()


def _write(path: Path, text: str, what: str) -> None:
    from kvdoctor.errors import UsageError

    try:
        path.write_text(text)
    except OSError as exc:
        raise UsageError(f"{path}: cannot write: {exc.strerror}") from None
    typer.echo(f"{what} written to {path}", err=True)
