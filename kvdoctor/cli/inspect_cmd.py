"""`kvdoctor inspect RECIPE`: one logic variant's run, step by step.

Registered in `kvdoctor.cli.app`; what commands share comes from `kvdoctor.cli.common`,
`output` and `serve_flags`, never from `kvdoctor.cli.app`. Importing this module stays
cheap (Typer only); the run is `kvdoctor.app.repro` with a timeline recorded.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from kvdoctor.cli import options as opt
from kvdoctor.cli import output
from kvdoctor.cli.common import command_line, run
from kvdoctor.cli.serve_flags import ServeFlags, overrides, with_serve_flags


@with_serve_flags
def inspect(
    recipe: Annotated[str, typer.Argument(help="A built-in recipe name or a path to a recipe .toml.",
                                          metavar="RECIPE")],
    logic: Annotated[str, typer.Option("--logic", metavar="LOGIC",
                                       help="installed | fixed | unpatched (see kvdoctor repro --help)")
                     ] = "installed",
    step: Annotated[int | None, typer.Option("--step", metavar="N", help="Show only step N.")] = None,
    serve: ServeFlags = ServeFlags(),
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
        from kvdoctor.outcome_codes import exit_code_for

        if logic == "all":
            raise UsageError("inspect shows one timeline: choose --logic installed, fixed or unpatched")
        fmt = opt.output_format(output_format, json_out, svg)
        if step is not None and step < 1:
            raise UsageError(f"--step must be >= 1, got {step}")
        opt.check_output_paths(report=report, svg=svg)
        setup_overrides = overrides(serve)
        from kvdoctor import app as application
        from kvdoctor.cli.progress import Progress

        with Progress("inspect") as progress:
            result = application.repro(recipe, setup_overrides, logic, record_timeline=True,
                                       command=command_line(), default_worker=opt.DEFAULT_WORKER,
                                       on_progress=progress.callback)
        run_result = result.results[0]
        if step is not None and not any(e.index == step for e in run_result.timeline):
            raise UsageError(f"--step {step}: the run has steps 1–{len(run_result.timeline)}")
        from kvdoctor.report.json_doc import repro_document
        from kvdoctor.report.tables import timeline_renderables, verdict_table

        def document(res: Any) -> dict:
            doc = repro_document(res, with_timeline=True)
            if step is not None:
                for entry in doc["results"]:
                    entry["timeline"] = [e for e in entry["timeline"] if e["index"] == step]
            return doc

        code = exit_code_for(run_result)
        output.note_untested_level(run_result, result.setup.engine)
        output.show_result("inspect", result, fmt, document,
                           lambda res: [*timeline_renderables(run_result, step), verdict_table(res)], svg, report)
        return code

    run(action, opt.wants_json(output_format, json_out))
