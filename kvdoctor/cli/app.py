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
from kvdoctor.cli.shell import KvCommand, KvGroup, exit_codes_text, working
from kvdoctor.errors import EXIT_NOT_REPRODUCED, EXIT_REPRODUCED, EXIT_SETUP_OR_OTHER_FAILURE, ExitStatus
from kvdoctor.outcome_codes import exit_code_for  # noqa: F401 - re-exported for the commands

EXIT_CODES_HELP = exit_codes_text()

app = typer.Typer(
    name="kvdoctor",
    cls=KvGroup,
    help="Reproduce and diagnose scheduler-side bugs of vLLM's KV offloading connector, on a CPU, "
         "with the vLLM installed here.\n\n"
         "Start with `kvdoctor audit` (every known bug against this vLLM) or `kvdoctor repro --list`.\n\n"
         + EXIT_CODES_HELP,
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain help: reflowed to the terminal, nothing cut, no markup eaten
)


_RUN_EXIT_CODES = exit_codes_text()
_AUDIT_EXIT_CODES = exit_codes_text(meanings={
    ExitStatus.NOT_REPRODUCED: "no known bug reproduces under the installed logic",
    ExitStatus.REPRODUCED: "a known bug reproduces under the installed logic",
    ExitStatus.SETUP_OR_OTHER_FAILURE: "none reproduces, but a row ended other_failure or setup_error"})
_EXPLORE_EXIT_CODES = exit_codes_text(meanings={
    ExitStatus.NOT_REPRODUCED: "nothing found", ExitStatus.REPRODUCED: "a failure found (written under --out)",
    ExitStatus.SETUP_OR_OTHER_FAILURE: "nothing found, but a search worker failed: the search is incomplete"})


def _with_exit_codes(text: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Append a command's exit codes (generated from ExitStatus) to its help."""
    def decorate(function: Callable[..., Any]) -> Callable[..., Any]:
        function.__doc__ = (function.__doc__ or "").rstrip() + "\n\n    " + text
        return function
    return decorate


def _examples(*lines: str) -> str:
    """An epilog of examples, kept line by line (click's \\b: no reflow)."""
    return "\b\nExamples:\n" + "\n".join(f"  {line}" for line in lines)


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"kvdoctor {__version__}")
        raise typer.Exit(0)


@app.callback()
def _main(
    version: Annotated[Optional[bool], typer.Option("--version", callback=_version_callback, is_eager=True,
                                                    help="Show kvdoctor's version and exit.")] = None,
    debug: Annotated[bool, typer.Option("--debug", help="On kvdoctor's own failure, print the traceback "
                                                        "(also KVDOCTOR_DEBUG=1).")] = False,
) -> None:
    """kvdoctor."""
    if debug:
        from kvdoctor.cli.failures import enable_debug

        enable_debug()


def _command_line() -> str:
    return "kvdoctor " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def _run(action: Callable[[], int], json_out: bool = False) -> None:
    """Run a command's action and exit with the status it earned (see `kvdoctor.cli.failures`)."""
    from kvdoctor.cli.failures import run_guarded

    raise typer.Exit(run_guarded(action, json_out))


def _console(record: bool = False) -> Any:
    """The terminal's width, or $COLUMNS (else 80) when piped; tables that do not fit stack."""
    from rich.console import Console

    return Console(record=record, highlight=False, soft_wrap=False)


def _emit(renderables: list[Any], svg: Path | None) -> None:
    console = _console(record=svg is not None)
    if console.is_terminal:
        for item in renderables:
            console.print(item)
    else:  # piped: the same text without the padding rich adds to the right of each line
        import io

        from rich.console import Console

        console = Console(record=True, file=io.StringIO(), highlight=False, soft_wrap=False)
        for item in renderables:
            console.print(item)
        text = "\n".join(line.rstrip() for line in console.export_text(clear=False).splitlines())
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    if svg is not None:
        try:
            console.save_svg(str(svg), title="kvdoctor")
        except OSError as exc:  # checked before the run; a writer's error never changes the verdict's code
            typer.echo(f"kvdoctor: error: --svg {svg}: {exc.strerror or exc}", err=True)
            return
        typer.echo(f"SVG written to {svg}", err=True)


@app.command(cls=KvCommand, epilog=_examples(
    "kvdoctor repro queued-abort",
    "kvdoctor repro my-recipe.toml --logic installed --report issue.md",
    "kvdoctor repro queued-abort --kv-offloading-size 8 --tensor-parallel-size 2"))
@_with_exit_codes(_RUN_EXIT_CODES)
def repro(
    recipe: Annotated[Optional[str], typer.Argument(help="A built-in recipe name or a path to a recipe .toml.",
                                                    show_default=False, metavar="RECIPE")] = None,
    list_recipes: Annotated[bool, typer.Option("--list", help="List the built-in recipes and exit.")] = False,
    logic: Annotated[str, typer.Option("--logic", metavar="LOGIC", help=(
        "installed | fixed | unpatched | all. installed: vLLM's own storable_chunks; fixed: with the "
        "PR #49146 cap (storable chunks <= allocated chunks), kvdoctor's 'fixed logic'; unpatched: "
        "the installed method with that cap removed."))] = "all",
    block_size: opt.BlockSize = None,
    blocks_per_chunk: opt.BlocksPerChunk = None,
    gpu_blocks: opt.GpuBlocks = None,
    async_scheduling: opt.AsyncScheduling = None,
    max_num_batched_tokens: opt.MaxBatchedTokens = None,
    max_num_seqs: opt.MaxNumSeqs = None,
    max_model_len: opt.MaxModelLen = None,
    enable_chunked_prefill: opt.ChunkedPrefill = None,
    enable_prefix_caching: opt.PrefixCaching = None,
    kv_transfer_config: opt.KvTransferConfig = None,
    kv_offloading_size: opt.KvOffloadingSize = None,
    kv_offloading_backend: opt.KvOffloadingBackend = None,
    model: opt.Model = None,
    worker: opt.Worker = None,
    model_runner: opt.ModelRunner = None,
    device: opt.Device = None,
    json_out: opt.Json = False,
    report: opt.ReportFile = None,
    svg: opt.SvgFile = None,
    export_script: Annotated[Optional[Path], typer.Option(
        "--export-script", help="Write a standalone Python script (vLLM APIs only) that reproduces the recipe, "
                                "and exit.", rich_help_panel=opt.OUTPUT)] = None,
) -> None:
    """Run a recipe on the installed vLLM under each logic variant and print the verdicts.

    After the verdicts: the upstream issue and fix, a workaround where one is known, and how to
    report it. The installed logic's outcome sets the exit code.

    Serve flags that do not reach the scheduler (--gpu-memory-utilization, --tensor-parallel-size,
    --dtype, ...) are accepted and ignored, with a note."""

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
        opt.check_output_paths(report=report, svg=svg, export_script=export_script)
        overrides = opt.geometry_overrides(block_size, blocks_per_chunk, gpu_blocks, async_scheduling,
                                           max_num_batched_tokens, max_num_seqs, enable_chunked_prefill,
                                           kv_transfer_config, model, enable_prefix_caching=enable_prefix_caching,
                                           kv_offloading_size=kv_offloading_size,
                                           kv_offloading_backend=kv_offloading_backend,
                                           max_model_len=max_model_len)
        overrides.update(opt.worker_overrides(worker, model_runner, device))
        from kvdoctor import app as application

        if export_script is not None:
            if json_out or report is not None or svg is not None:
                raise UsageError("--export-script writes a script and runs nothing: drop --json/--report/--svg")
            application.export(recipe, overrides, export_script)
            typer.echo(f"standalone script written to {export_script} (run it with: python {export_script})",
                       err=True)
            return EXIT_NOT_REPRODUCED
        with working():
            result = application.repro(recipe, overrides, logic, record_timeline=report is not None,
                                       command=_command_line())
        from kvdoctor.report.json_doc import repro_document
        from kvdoctor.report.tables import repro_renderables

        code = exit_code_for(result.decisive.outcome.value)
        _output("repro", result, json_out, repro_document, repro_renderables, svg, report)
        return code

    _run(action, json_out)


@app.command(cls=KvCommand, epilog=_examples(
    "kvdoctor inspect queued-abort",
    "kvdoctor inspect queued-abort --step 6 --logic fixed"))
@_with_exit_codes(_RUN_EXIT_CODES)
def inspect(
    recipe: Annotated[str, typer.Argument(help="A built-in recipe name or a path to a recipe .toml.",
                                          metavar="RECIPE")],
    logic: Annotated[str, typer.Option("--logic", metavar="LOGIC",
                                       help="installed | fixed | unpatched (see kvdoctor repro --help)")
                     ] = "installed",
    step: Annotated[Optional[int], typer.Option("--step", metavar="N", help="Show only step N.")] = None,
    block_size: opt.BlockSize = None,
    blocks_per_chunk: opt.BlocksPerChunk = None,
    gpu_blocks: opt.GpuBlocks = None,
    async_scheduling: opt.AsyncScheduling = None,
    max_num_batched_tokens: opt.MaxBatchedTokens = None,
    max_num_seqs: opt.MaxNumSeqs = None,
    max_model_len: opt.MaxModelLen = None,
    enable_chunked_prefill: opt.ChunkedPrefill = None,
    enable_prefix_caching: opt.PrefixCaching = None,
    kv_transfer_config: opt.KvTransferConfig = None,
    kv_offloading_size: opt.KvOffloadingSize = None,
    kv_offloading_backend: opt.KvOffloadingBackend = None,
    model: opt.Model = None,
    worker: opt.Worker = None,
    model_runner: opt.ModelRunner = None,
    device: opt.Device = None,
    json_out: opt.Json = False,
    report: opt.ReportFile = None,
    svg: opt.SvgFile = None,
) -> None:
    """Run a recipe and show every step: events and each request's chunk/block state.

    Requests whose storable chunks cannot be paired with allocated blocks are marked one step
    before the store assertion fires."""

    def action() -> int:
        from kvdoctor.errors import UsageError

        if logic == "all":
            raise UsageError("inspect shows one timeline: choose --logic installed, fixed or unpatched")
        if json_out and svg is not None:
            raise UsageError("--svg renders the tables; it cannot be combined with --json")
        if step is not None and step < 1:
            raise UsageError(f"--step must be >= 1, got {step}")
        opt.check_output_paths(report=report, svg=svg)
        overrides = opt.geometry_overrides(block_size, blocks_per_chunk, gpu_blocks, async_scheduling,
                                           max_num_batched_tokens, max_num_seqs, enable_chunked_prefill,
                                           kv_transfer_config, model, enable_prefix_caching=enable_prefix_caching,
                                           kv_offloading_size=kv_offloading_size,
                                           kv_offloading_backend=kv_offloading_backend,
                                           max_model_len=max_model_len)
        overrides.update(opt.worker_overrides(worker, model_runner, device))
        from kvdoctor import app as application

        with working():
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

        code = exit_code_for(run.outcome.value)
        _output("inspect", result, json_out, document,
                lambda res: timeline_renderables(run, step) + [verdict_table(res)], svg, report)
        return code

    _run(action, json_out)


@app.command(cls=KvCommand, epilog=_examples(
    "kvdoctor audit",
    "kvdoctor audit --report audit.md    # attach to an upstream issue",
    "kvdoctor audit --block-size 16 --async-scheduling    # your serve flags"))
@_with_exit_codes(_AUDIT_EXIT_CODES)
def audit(
    block_size: opt.BlockSize = None,
    blocks_per_chunk: opt.BlocksPerChunk = None,
    gpu_blocks: opt.GpuBlocks = None,
    async_scheduling: opt.AsyncScheduling = None,
    max_num_batched_tokens: opt.MaxBatchedTokens = None,
    max_num_seqs: opt.MaxNumSeqs = None,
    max_model_len: opt.MaxModelLen = None,
    enable_chunked_prefill: opt.ChunkedPrefill = None,
    enable_prefix_caching: opt.PrefixCaching = None,
    kv_transfer_config: opt.KvTransferConfig = None,
    kv_offloading_size: opt.KvOffloadingSize = None,
    kv_offloading_backend: opt.KvOffloadingBackend = None,
    model: opt.Model = None,
    worker: opt.Worker = None,
    model_runner: opt.ModelRunner = None,
    device: opt.Device = None,
    json_out: opt.Json = False,
    report: opt.ReportFile = None,
    svg: opt.SvgFile = None,
) -> None:
    """Run every built-in recipe against the installed vLLM: one row per known bug.

    The pip-audit idea, for KV-offload bugs: each row says what to do next (the fix, a workaround,
    the release that stops reproducing it where measured). Serve flags run every recipe at your
    geometry: sizes you do not give are derived for each trigger; a recipe your flags make impossible is
    untested (exit 6), naming the flag and the smallest change that allows it; so is a recipe whose
    needs exceed your settings (e.g. a CPU tier it would map), and the rest run. --model gives the KV
    layout of the recipes that do not ship their own. Serve flags that do not reach the scheduler
    (--tensor-parallel-size, ...) are accepted and ignored, with a note."""

    def action() -> int:
        from kvdoctor.errors import UsageError

        if json_out and svg is not None:
            raise UsageError("--svg renders the tables; it cannot be combined with --json")
        opt.check_output_paths(report=report, svg=svg)
        from kvdoctor import app as application

        overrides = opt.geometry_overrides(block_size, blocks_per_chunk, gpu_blocks, async_scheduling,
                                           max_num_batched_tokens, max_num_seqs, enable_chunked_prefill,
                                           kv_transfer_config, model, enable_prefix_caching=enable_prefix_caching,
                                           kv_offloading_size=kv_offloading_size,
                                           kv_offloading_backend=kv_offloading_backend,
                                           max_model_len=max_model_len)
        overrides.update(opt.worker_overrides(worker, model_runner, device))
        with working("importing vLLM and running every built-in recipe"):
            result = application.audit(command=_command_line(), overrides=overrides)
        from kvdoctor.report.json_doc import audit_document
        from kvdoctor.report.tables import audit_renderables

        code = result.exit_status
        _output("audit", result, json_out, audit_document, audit_renderables, svg, report)
        return code

    _run(action, json_out)


from kvdoctor.cli.explore_cmd import explore  # noqa: E402 - cheap (Typer only); registered below

app.command(cls=KvCommand, epilog=_examples(
    "kvdoctor explore --time-budget 60",
    "kvdoctor explore --logic fixed --workers 2 --out findings/"))(_with_exit_codes(_EXPLORE_EXIT_CODES)(explore))
from kvdoctor.cli.matrix_cmd import matrix  # noqa: E402 - cheap (Typer only)

app.command(cls=KvCommand, epilog=_examples(
    "kvdoctor matrix queued-abort --vllm 0.26.0..0.34.0 --bisect",
    "kvdoctor matrix --audit --vllm 0.30.0,0.34.0"))(matrix)

from kvdoctor.cli.diagnose_cmd import diagnose  # noqa: E402 - cheap (Typer only)

app.command()(diagnose)


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
    _emit([table], None)
    return 0


def _write_report(path: Path, command: str, result: Any) -> None:
    from kvdoctor.report.markdown import render_markdown

    text = render_markdown(command, result)
    try:
        path.write_text(text)
    except OSError as exc:  # checked before the run; a writer's error never changes the verdict's code
        typer.echo(f"kvdoctor: error: --report {path}: {exc.strerror or exc}", err=True)
        return
    typer.echo(f"report written to {path}", err=True)


def main() -> None:
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
