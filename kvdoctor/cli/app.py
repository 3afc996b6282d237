"""The `kvdoctor` command line: parse, call one application function, render, exit.

Importing this module must stay cheap: vLLM (and everything heavy) is imported
only inside a command, through `kvdoctor.app`.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer

from kvdoctor import __version__
from kvdoctor.cli import options as opt
from kvdoctor.errors import (
    EXIT_NOT_REPRODUCED, EXIT_REPRODUCED, EXIT_SETUP_OR_OTHER_FAILURE, KvdoctorError,
)

EXIT_CODES_HELP = (
    "Exit codes: 0 not reproduced (or not applicable) · 1 reproduced · 2 usage error or bad recipe file · "
    "3 vLLM missing, broken or outside >=0.26.0,<0.34 · 4 recipe setup error or other failure."
)

app = typer.Typer(
    name="kvdoctor",
    help="Reproduce and diagnose scheduler-side bugs of vLLM's KV offloading connector, on a CPU, "
         "with the vLLM installed here.\n\n" + EXIT_CODES_HELP,
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"kvdoctor {__version__}")
        raise typer.Exit(0)


@app.callback()
def _main(
    version: Annotated[Optional[bool], typer.Option("--version", callback=_version_callback, is_eager=True,
                                                    help="Show kvdoctor's version and exit.")] = None,
) -> None:
    """kvdoctor."""


def exit_code_for(outcome: str) -> int:
    if outcome == "reproduced":
        return EXIT_REPRODUCED
    if outcome in ("not_reproduced", "not_applicable"):
        return EXIT_NOT_REPRODUCED
    return EXIT_SETUP_OR_OTHER_FAILURE


def _command_line() -> str:
    return "kvdoctor " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def _run(action: Callable[[], int]) -> None:
    """Turn kvdoctor's own errors into one line on stderr and their exit code."""
    try:
        code = action()
    except KvdoctorError as exc:
        typer.echo(f"kvdoctor: error: {exc}", err=True)
        raise typer.Exit(exc.exit_code) from None
    except KeyboardInterrupt:
        typer.echo("kvdoctor: interrupted", err=True)
        raise typer.Exit(130) from None
    raise typer.Exit(code)


def _console(record: bool = False) -> Any:
    from rich.console import Console

    console = Console(record=record, highlight=False, soft_wrap=False)
    if not console.is_terminal:  # piped or recorded: keep the wide state tables readable
        console = Console(record=record, highlight=False, soft_wrap=False, width=160)
    return console


def _emit(renderables: list[Any], svg: Path | None) -> None:
    console = _console(record=svg is not None)
    for item in renderables:
        console.print(item)
    if svg is not None:
        console.save_svg(str(svg), title="kvdoctor")
        typer.echo(f"SVG written to {svg}", err=True)


@app.command()
def repro(
    recipe: Annotated[Optional[str], typer.Argument(help="A built-in recipe name or a path to a recipe .toml.",
                                                    show_default=False)] = None,
    list_recipes: Annotated[bool, typer.Option("--list", help="List the built-in recipes and exit.")] = False,
    logic: Annotated[str, typer.Option("--logic", help="installed | fixed | unpatched | all")] = "all",
    block_size: opt.BlockSize = None,
    blocks_per_chunk: opt.BlocksPerChunk = None,
    gpu_blocks: opt.GpuBlocks = None,
    async_scheduling: opt.AsyncScheduling = None,
    max_num_batched_tokens: opt.MaxBatchedTokens = None,
    max_num_seqs: opt.MaxNumSeqs = None,
    max_model_len: opt.MaxModelLen = None,
    enable_chunked_prefill: opt.ChunkedPrefill = None,
    kv_transfer_config: opt.KvTransferConfig = None,
    model: opt.Model = None,
    json_out: opt.Json = False,
    report: opt.ReportFile = None,
    svg: opt.SvgFile = None,
    export_script: Annotated[Optional[Path], typer.Option(
        "--export-script", help="Write a standalone Python script (vLLM APIs only) that reproduces the recipe, "
                                "and exit.", rich_help_panel=opt.OUTPUT)] = None,
) -> None:
    """Run a recipe on the installed vLLM under each logic variant and print the verdicts.

    The installed logic's outcome sets the exit code (see kvdoctor --help)."""

    def action() -> int:
        from kvdoctor.errors import UsageError

        if list_recipes:
            if recipe is not None:
                raise UsageError("--list takes no RECIPE")
            return _list_recipes(json_out)
        if recipe is None:
            raise UsageError("give a RECIPE (a built-in name or a .toml file); `kvdoctor repro --list` shows them")
        if json_out and svg is not None:
            raise UsageError("--svg renders the tables; it cannot be combined with --json")
        overrides = opt.geometry_overrides(block_size, blocks_per_chunk, gpu_blocks, async_scheduling,
                                           max_num_batched_tokens, max_num_seqs, enable_chunked_prefill,
                                           kv_transfer_config, model, max_model_len)
        from kvdoctor import app as application

        if export_script is not None:
            if json_out or report is not None or svg is not None:
                raise UsageError("--export-script writes a script and runs nothing: drop --json/--report/--svg")
            application.export(recipe, overrides, export_script)
            typer.echo(f"standalone script written to {export_script} (run it with: python {export_script})",
                       err=True)
            return EXIT_NOT_REPRODUCED
        result = application.repro(recipe, overrides, logic, record_timeline=report is not None,
                                   command=_command_line())
        from kvdoctor.report.json_doc import repro_document
        from kvdoctor.report.tables import repro_renderables

        _output("repro", result, json_out, repro_document, repro_renderables, svg, report)
        return exit_code_for(result.decisive.outcome.value)

    _run(action)


@app.command()
def inspect(
    recipe: Annotated[str, typer.Argument(help="A built-in recipe name or a path to a recipe .toml.")],
    logic: Annotated[str, typer.Option("--logic", help="installed | fixed | unpatched")] = "installed",
    step: Annotated[Optional[int], typer.Option("--step", help="Show only step N.")] = None,
    block_size: opt.BlockSize = None,
    blocks_per_chunk: opt.BlocksPerChunk = None,
    gpu_blocks: opt.GpuBlocks = None,
    async_scheduling: opt.AsyncScheduling = None,
    max_num_batched_tokens: opt.MaxBatchedTokens = None,
    max_num_seqs: opt.MaxNumSeqs = None,
    max_model_len: opt.MaxModelLen = None,
    enable_chunked_prefill: opt.ChunkedPrefill = None,
    kv_transfer_config: opt.KvTransferConfig = None,
    model: opt.Model = None,
    json_out: opt.Json = False,
    report: opt.ReportFile = None,
    svg: opt.SvgFile = None,
) -> None:
    """Run a recipe and show every step: events and each request's chunk/block state.

    Requests whose storable chunks cannot be paired with allocated blocks are marked
    one step before the store assertion fires."""

    def action() -> int:
        from kvdoctor.errors import UsageError

        if logic == "all":
            raise UsageError("inspect shows one timeline: choose --logic installed, fixed or unpatched")
        if json_out and svg is not None:
            raise UsageError("--svg renders the tables; it cannot be combined with --json")
        if step is not None and step < 1:
            raise UsageError(f"--step must be >= 1, got {step}")
        overrides = opt.geometry_overrides(block_size, blocks_per_chunk, gpu_blocks, async_scheduling,
                                           max_num_batched_tokens, max_num_seqs, enable_chunked_prefill,
                                           kv_transfer_config, model, max_model_len)
        from kvdoctor import app as application

        result = application.repro(recipe, overrides, logic, record_timeline=True, command=_command_line())
        run = result.results[0]
        if step is not None and not any(e.index == step for e in run.timeline):
            raise UsageError(f"--step {step}: the run has steps 1–{len(run.timeline)}")
        from kvdoctor.report.json_doc import repro_document
        from kvdoctor.report.tables import timeline_renderables, verdict_table

        def document(res: Any) -> dict:
            doc = repro_document(res, with_timeline=True)
            if step is not None:
                for entry in doc["results"]:
                    entry["timeline"] = [e for e in entry["timeline"] if e["index"] == step]
            return doc

        _output("inspect", result, json_out, document,
                lambda res: timeline_renderables(run, step) + [verdict_table(res)], svg, report)
        return exit_code_for(run.outcome.value)

    _run(action)


@app.command()
def audit(
    json_out: opt.Json = False,
    report: opt.ReportFile = None,
    svg: opt.SvgFile = None,
) -> None:
    """Run every built-in recipe against the installed vLLM: one row per known bug.

    Exits 1 when any known bug reproduces under the installed logic, 0 when none does
    (the pip-audit idea, for KV-offload bugs)."""

    def action() -> int:
        from kvdoctor.errors import UsageError

        if json_out and svg is not None:
            raise UsageError("--svg renders the tables; it cannot be combined with --json")
        from kvdoctor import app as application

        result = application.audit(command=_command_line())
        from kvdoctor.report.json_doc import audit_document
        from kvdoctor.report.tables import audit_renderables

        _output("audit", result, json_out, audit_document, audit_renderables, svg, report)
        return EXIT_REPRODUCED if result.any_reproduced else EXIT_NOT_REPRODUCED

    _run(action)


from kvdoctor.cli.explore_cmd import explore  # noqa: E402 - cheap (Typer only); registered below

app.command()(explore)


def _output(command: str, result: Any, json_out: bool, document: Callable[[Any], dict],
            renderables: Callable[[Any], list[Any]], svg: Path | None, report: Path | None) -> None:
    """JSON on stdout or the rendered tables (optionally as SVG), then the Markdown attachment."""
    if json_out:
        from kvdoctor.report.json_doc import dumps

        typer.echo(dumps(document(result)))
    else:
        _emit(renderables(result), svg)
    if report is not None:
        _write_report(report, command, result)


def _list_recipes(json_out: bool) -> int:
    from kvdoctor.recipes.builtins import all_builtins

    recipes = all_builtins()
    if json_out:
        from kvdoctor.report.json_doc import SCHEMA_VERSION, dumps, recipe_dict

        typer.echo(dumps({"schema_version": SCHEMA_VERSION, "recipes": [recipe_dict(r) for r in recipes]}))
        return 0
    from rich import box
    from rich.table import Table

    table = Table(title="built-in recipes", box=box.SIMPLE, title_justify="left")
    for column in ("name", "bug", "what it reproduces", "signature", "upstream refs"):
        table.add_column(column)
    for r in recipes:
        table.add_row(r.name, r.bug or "", r.title or r.summary.splitlines()[0], r.signature.describe(),
                      "\n".join(r.refs))
    _console().print(table)
    return 0


def _write_report(path: Path, command: str, result: Any) -> None:
    from kvdoctor.report.markdown import render_markdown

    try:
        path.write_text(render_markdown(command, result))
    except OSError as exc:
        from kvdoctor.errors import UsageError

        raise UsageError(f"--report {path}: {exc.strerror}") from None
    typer.echo(f"report written to {path}", err=True)


def main() -> None:
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
