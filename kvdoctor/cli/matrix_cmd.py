"""`kvdoctor matrix`: the same recipes asked of many vLLM releases, one environment each.

Registered in `kvdoctor.cli.app`; what commands share comes from `kvdoctor.cli.common`,
never from `kvdoctor.cli.app`. Importing this module stays cheap (Typer only): the work
is in `kvdoctor.matrix.app`, imported inside the command.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from kvdoctor.cli import options as opt
from kvdoctor.cli.common import command_line, run
from kvdoctor.releases import KNOWN_RELEASES

RELEASES = "Releases"


def matrix(
    recipes: Annotated[list[str] | None, typer.Argument(
        help="Built-in recipe names or recipe .toml files.", show_default=False, metavar="RECIPE")] = None,
    vllm: Annotated[str | None, typer.Option(
        "--vllm", help=f"Releases: a list (0.26.0,0.30.0) or an inclusive range (0.26.0..0.34.0) of "
                       f"{', '.join(KNOWN_RELEASES)}. Default: all of them.",
        rich_help_panel=RELEASES, show_default=False)] = None,
    audit: Annotated[bool, typer.Option(
        "--audit", help="Every built-in recipe (kvdoctor audit) on each release; with RECIPE names, only those "
                        "(audit --recipe).", rich_help_panel=RELEASES)] = False,
    bisect: Annotated[bool, typer.Option(
        "--bisect", help="Find the first release where each recipe stops reproducing (and the last where it "
                         "still does), testing as few releases as a binary search needs.",
        rich_help_panel=RELEASES)] = False,
    env_dir: Annotated[Path | None, typer.Option(
        "--env-dir", envvar="KVDOCTOR_MATRIX_ENV_DIR",
        help="Use the virtual environments found directly under DIR (e.g. a checkout's .venv-vllm-*) for "
             "the releases they hold, as they are; others are built in $KVDOCTOR_CACHE_DIR/envs "
             "(default ~/.cache/kvdoctor/envs).", rich_help_panel=RELEASES)] = None,
    ray: opt.Ray = False,
    ray_address: opt.RayAddress = None,
    engine: opt.Engine = None,
    json_out: opt.Json = False,
    output_format: opt.Format = None,
    report: opt.ReportFile = None,
    write_data: Annotated[Path | None, typer.Option(
        "--write-data", help="With --audit: write the measured outcomes into the release-outcomes data file "
                             "FILE (rows of the releases measured are replaced, of the RECIPEs named only; "
                             "each release is audited "
                             "twice, as is and under --async-scheduling; for kvdoctor's maintainers).",
        rich_help_panel=opt.OUTPUT)] = None,
) -> None:
    """Run recipes on several vLLM releases, each in its own uv-built environment, and tabulate
    release x recipe -> outcome under the installed logic, with the failure site where reproduced.

    Environments are built once (uv, from the package registry) and reused. kvdoctor runs in each
    with --json, from this kvdoctor's own source. Every cell counts, as in `audit`."""
    def action() -> int:
        from kvdoctor.errors import UsageError

        fmt = opt.output_format(output_format, json_out)
        address = opt.ray_address(ray, ray_address)
        level = opt.engine_override(engine).engine or "scheduler"
        if write_data is not None and (not audit or bisect):
            raise UsageError("--write-data records a whole --audit run: use it with --audit, without --bisect")
        if write_data is not None and level != "scheduler":
            raise UsageError(f"--write-data records scheduler-level measurements (what kvdoctor's release table "
                             f"holds): drop --engine {level}")
        for path, flag in ((report, "--report"), (write_data, "--write-data")):
            if path is not None and not path.resolve().parent.is_dir():
                raise UsageError(f"{flag} {path}: no such directory {path.resolve().parent}")
        from kvdoctor.matrix import app as matrix_app

        with _Display() as display:
            result = matrix_app.matrix(recipes or [], audit, vllm, bisect, env_dir=env_dir,
                                       command=command_line(), progress=display.callbacks(),
                                       audit_async=write_data is not None, engine=level,
                                       ray=address)
        from kvdoctor.cli import output
        from kvdoctor.cli.failures import raise_unwritten
        from kvdoctor.report.formats import Shown
        from kvdoctor.report.matrix import matrix_document, matrix_markdown, matrix_renderables

        shown = Shown(renderables=lambda: matrix_renderables(result), document=lambda: matrix_document(result),
                      markdown=lambda: matrix_markdown(result))
        unwritten = output.show(shown, fmt)
        if report is not None:
            unwritten += output.write_output(report, matrix_markdown(result), "--report", "report", whole=True)
        if write_data is not None:
            from kvdoctor.matrix import data

            for release, why in matrix_app.unmeasured_releases(result).items():
                typer.echo(f"kvdoctor matrix: vLLM {release} not written to {write_data} ({why})", err=True)
            limited = result.recipes if recipes else None  # --audit RECIPE...: only their rows are replaced
            rows = data.merge(data.load(write_data), matrix_app.data_rows(result), limited)
            unwritten += output.write_output(write_data, data.render(rows), "--write-data", "release outcomes",
                                             whole=True)
        raise_unwritten(unwritten)
        return int(result.exit_status)

    run(action, opt.wants_json(output_format, json_out))


def count_text(completed: float, total: float | None) -> str:
    """`3/8`, or `3 done` where the total is not known beforehand (bisect picks its next release as it
    goes): never `0/None`."""
    return f"{int(completed)}/{int(total)}" if total else f"{int(completed)} done"


def _count_column() -> Any:
    from rich.progress import ProgressColumn
    from rich.text import Text

    class CountColumn(ProgressColumn):
        def render(self, task: Any) -> Text:
            return Text(count_text(task.completed, task.total))

    return CountColumn()


class _Display:
    """A rich progress bar on stderr while environments are built; one line per step otherwise."""

    def __init__(self) -> None:
        from rich.console import Console

        from kvdoctor.cli.streams import current

        self.console = Console(stderr=True, highlight=False, width=current().width())
        self.live = self.console.is_terminal
        self.progress: Any = None
        self.build_task: Any = None
        self.run_task: Any = None

    def __enter__(self) -> _Display:
        if self.live:
            from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

            self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                     _count_column(), TimeElapsedColumn(), console=self.console, transient=True)
            self.progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.progress is not None:
            self.progress.__exit__(*exc)

    def callbacks(self) -> Any:
        from kvdoctor.matrix.app import Progress

        return Progress(building=self._building, built=self._built, running=self._running, ran=self._ran)

    def _say(self, text: str) -> None:
        if self.progress is None:
            print(f"kvdoctor matrix: {text}", file=sys.stderr, flush=True)

    def _building(self, release: str, done: int, total: int) -> None:
        if self.progress is not None:
            if self.build_task is None:
                self.build_task = self.progress.add_task("environments", total=total)
            self.progress.update(self.build_task, total=total, completed=done,
                                 description=f"building the vLLM {release} environment (uv)")
        self._say(f"building the vLLM {release} environment with uv ({done + 1}/{total})")

    def _built(self, release: str, seconds: float) -> None:
        if self.progress is not None and self.build_task is not None:
            self.progress.advance(self.build_task)
            self.progress.update(self.build_task, description="environments")
        self._say(f"vLLM {release} environment ready ({seconds:.0f} s)")

    def _running(self, release: str, what: str) -> None:
        if self.progress is not None:
            if self.run_task is None:
                self.run_task = self.progress.add_task("running", total=None)
            self.progress.update(self.run_task, description=f"vLLM {release}: {what}")

    def _ran(self, cell: Any) -> None:
        if self.progress is not None and self.run_task is not None:
            self.progress.advance(self.run_task)
