"""The `kvdoctor` command line: parse, call one application function, render, exit.

Importing this module must stay cheap: vLLM (and everything heavy) is imported
only inside a command, through `kvdoctor.app`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer

from kvdoctor import __version__
from kvdoctor.cli import common, output
from kvdoctor.cli import options as opt
from kvdoctor.cli.diagnose_cmd import diagnose
from kvdoctor.cli.explore_cmd import explore
from kvdoctor.cli.matrix_cmd import matrix
from kvdoctor.cli.shell import KvCommand, KvGroup, exit_codes_text
from kvdoctor.cli.version_cmd import version
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
_MATRIX_EXIT_CODES = exit_codes_text(meanings={
    ExitStatus.NOT_REPRODUCED: "nothing reproduced on any release",
    ExitStatus.REPRODUCED: "a recipe reproduced on some release",
    ExitStatus.USAGE: "usage error: bad flag or release name, release out of range, unwritable output path",
    ExitStatus.VLLM_UNAVAILABLE: "a vLLM environment cannot be built (no uv, no package registry)",
    ExitStatus.SETUP_OR_OTHER_FAILURE: "a cell ended setup_error or other_failure, or an environment broke"})
_DIAGNOSE_EXIT_CODES = exit_codes_text(meanings={
    ExitStatus.NOT_REPRODUCED: "not reproduced, nothing to run (--no-run) or no crash in the log",
    ExitStatus.REPRODUCED: "the best match reproduces under the installed logic"})
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


# What commands share lives in `kvdoctor.cli.common` and `kvdoctor.cli.output` (the command
# modules import those, never this module); these names stay for the commands defined here.
_command_line = common.command_line
_run = common.run
_console = output.console
_emit = output.emit


@app.command(cls=KvCommand, epilog=_examples(
    "kvdoctor repro queued-abort",
    "kvdoctor repro my-recipe.toml --logic installed --report issue.md",
    "kvdoctor repro queued-abort --kv-offloading-size 8 --tensor-parallel-size 2"))
@_with_exit_codes(_RUN_EXIT_CODES)
def repro(
    recipe: Annotated[Optional[str], typer.Argument(help="A built-in recipe name or a path to a recipe .toml.",
                                                    show_default=False, metavar="RECIPE")] = None,
    list_recipes: Annotated[bool, typer.Option("--list", help="List the built-in recipes (one line each) and exit; "
                                                              "with RECIPE, show that one in full.")] = False,
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
    engine: opt.Engine = None,
    json_out: opt.Json = False,
    verbose: opt.Verbose = False,
    output_format: opt.Format = None,
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
            return _list_recipes(opt.output_format(output_format, json_out), verbose, recipe)
        if recipe is None:
            raise UsageError("give a RECIPE (a built-in name or a .toml file); `kvdoctor repro --list` shows them")
        fmt = opt.output_format(output_format, json_out, svg)
        opt.check_output_paths(report=report, svg=svg, export_script=export_script)
        overrides = opt.geometry_overrides(block_size, blocks_per_chunk, gpu_blocks, async_scheduling,
                                           max_num_batched_tokens, max_num_seqs, enable_chunked_prefill,
                                           kv_transfer_config, model, enable_prefix_caching=enable_prefix_caching,
                                           kv_offloading_size=kv_offloading_size,
                                           kv_offloading_backend=kv_offloading_backend,
                                           max_model_len=max_model_len)
        overrides.update(opt.worker_overrides(worker, model_runner, device))
        overrides.update(opt.engine_override(engine))
        from kvdoctor import app as application

        if export_script is not None:
            if json_out or output_format is not None or report is not None or svg is not None:
                raise UsageError("--export-script writes a script and runs nothing: drop "
                                 "--json/--format/--report/--svg")
            application.export(recipe, overrides, export_script, default_worker=opt.DEFAULT_WORKER)
            typer.echo(f"standalone script written to {export_script} (run it with: python {export_script})",
                       err=True)
            return EXIT_NOT_REPRODUCED
        from kvdoctor.cli.progress import Progress

        with Progress("repro") as progress:
            result = application.repro(recipe, overrides, logic, record_timeline=report is not None,
                                       command=_command_line(), default_worker=opt.DEFAULT_WORKER,
                                       on_progress=progress.callback)
        from kvdoctor.report.json_doc import repro_document
        from kvdoctor.report.tables import repro_renderables

        code = exit_code_for(result.decisive.outcome)
        _output("repro", result, fmt, repro_document, repro_renderables, svg, report)
        return code

    _run(action, opt.wants_json(output_format, json_out))


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
    output_format: opt.Format = None,
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
        fmt = opt.output_format(output_format, json_out, svg)
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

        from kvdoctor.cli.progress import Progress

        with Progress("inspect") as progress:
            result = application.repro(recipe, overrides, logic, record_timeline=True, command=_command_line(),
                                       default_worker=opt.DEFAULT_WORKER, on_progress=progress.callback)
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

        code = exit_code_for(run.outcome)
        _output("inspect", result, fmt, document,
                lambda res: timeline_renderables(run, step) + [verdict_table(res)], svg, report)
        return code

    _run(action, opt.wants_json(output_format, json_out))


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
    verbose: opt.Verbose = False,
    output_format: opt.Format = None,
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

        fmt = opt.output_format(output_format, json_out, svg)
        opt.check_output_paths(report=report, svg=svg)
        from kvdoctor import app as application

        overrides = opt.geometry_overrides(block_size, blocks_per_chunk, gpu_blocks, async_scheduling,
                                           max_num_batched_tokens, max_num_seqs, enable_chunked_prefill,
                                           kv_transfer_config, model, enable_prefix_caching=enable_prefix_caching,
                                           kv_offloading_size=kv_offloading_size,
                                           kv_offloading_backend=kv_offloading_backend,
                                           max_model_len=max_model_len)
        overrides.update(opt.worker_overrides(worker, model_runner, device))
        from kvdoctor.cli.progress import Progress

        with Progress("audit") as progress:
            result = application.audit(command=_command_line(), overrides=overrides,
                                       default_worker=opt.DEFAULT_WORKER, on_progress=progress.callback)
        from kvdoctor.report.json_doc import audit_document
        from kvdoctor.report.tables import audit_renderables

        code = result.exit_status
        _output("audit", result, fmt, audit_document, lambda res: audit_renderables(res, verbose), svg, report)
        return code

    _run(action, opt.wants_json(output_format, json_out))


# Registered after repro, inspect and audit: `kvdoctor --help` lists them in this order.
app.command(cls=KvCommand, epilog=_examples(
    "kvdoctor explore --time-budget 60",
    "kvdoctor explore --logic fixed --workers 2 --out findings/"))(_with_exit_codes(_EXPLORE_EXIT_CODES)(explore))
app.command(cls=KvCommand, epilog=_examples(
    "kvdoctor matrix queued-abort --vllm 0.26.0..0.34.0 --bisect",
    "kvdoctor matrix --audit --vllm 0.30.0,0.34.0"))(_with_exit_codes(_MATRIX_EXIT_CODES)(matrix))
app.command(cls=KvCommand, epilog=_examples(
    "kvdoctor diagnose vllm-serve.log",
    "kubectl logs my-vllm-pod | kvdoctor diagnose - --report issue.md"
))(_with_exit_codes(_DIAGNOSE_EXIT_CODES)(diagnose))
app.command(cls=KvCommand, epilog=_examples("kvdoctor version", "kvdoctor version --json"))(_with_exit_codes(
    exit_codes_text(meanings={ExitStatus.NOT_REPRODUCED: "vLLM imports and every probe holds",
                              ExitStatus.VLLM_UNAVAILABLE: "vLLM missing, broken on import or too old, or a probe "
                                                           "fails (named, with what changed)"}))(version))


def _output(command: str, result: Any, fmt: str, document: Callable[[Any], dict],
            renderables: Callable[[Any], list[Any]], svg: Path | None, report: Path | None) -> None:
    """The result on stdout in `--format`'s format (and as SVG), then the Markdown attachment.

    An output file that cannot be written after the run (a full disk) is named on stderr and
    the command exits 2: the verdict is printed, but what was asked for is not all there."""
    from kvdoctor.cli.failures import raise_unwritten
    from kvdoctor.report.formats import Shown
    from kvdoctor.report.markdown import render_markdown

    shown = Shown(renderables=lambda: renderables(result), document=lambda: document(result),
                  markdown=lambda: render_markdown(command, result))
    unwritten = output.show(shown, fmt, svg)
    if report is not None:
        unwritten += _write_report(report, command, result)
    raise_unwritten(unwritten)


def _list_recipes(fmt: str, verbose: bool, name: str | None) -> int:
    """One line per built-in recipe; `name` (a built-in or a .toml): that recipe in full."""
    from kvdoctor.recipes.builtins import all_builtins, resolve
    from kvdoctor.report.formats import Shown

    recipes = [resolve(name)] if name is not None else all_builtins()

    def document() -> dict:
        from kvdoctor.report.json_doc import SCHEMA_VERSION, recipe_dict

        return {"schema_version": SCHEMA_VERSION, "recipes": [recipe_dict(r) for r in recipes]}

    def renderables() -> list[Any]:
        from kvdoctor.report.tables import recipe_detail_renderables, recipe_list_renderables

        if name is not None:
            return recipe_detail_renderables(recipes[0])
        return recipe_list_renderables(recipes, verbose)

    def markdown() -> str:
        def cell(text: str) -> str:
            return text.replace("|", "\\|").replace("\n", "<br>")

        lines = ["| name | bug | what it reproduces | signature | upstream refs |", "|---|---|---|---|---|"]
        lines += [f"| {r.name} | {r.bug or ''} | {cell(r.title or r.summary.splitlines()[0])} | "
                  f"{cell(r.signature.describe())} | {cell(chr(10).join(r.refs))} |" for r in recipes]
        return "\n".join(lines) + "\n"

    output.show(Shown(renderables=renderables, document=document, markdown=markdown), fmt)
    return 0


def _write_report(path: Path, command: str, result: Any) -> list[str]:
    """Write the Markdown attachment; returns what could not be written."""
    from kvdoctor.report.markdown import render_markdown

    return output.write_output(path, render_markdown(command, result), "--report", "report")


def main() -> None:
    """The console script: caches in a scratch folder kvdoctor removes, and the prompt back as soon
    as the output is flushed (see `kvdoctor.cli.teardown`); in-process callers use `app`."""
    from kvdoctor.cli.teardown import exit_now, redirect_caches, remove_scratch

    redirect_caches()
    try:
        app()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException:  # not one of kvdoctor's outcomes: Python's own report, but no scratch left
        remove_scratch()
        raise
    exit_now(code)


if __name__ == "__main__":  # pragma: no cover
    main()
