"""`kvdoctor audit`: every built-in recipe against the installed vLLM, one row per known bug.

Registered in `kvdoctor.cli.app`; what commands share comes from `kvdoctor.cli.common`,
`output` and `serve_flags`, never from `kvdoctor.cli.app`. Importing this module stays
cheap (Typer only); the work is in `kvdoctor.app.audit`.
"""

from __future__ import annotations

from typing import Annotated

import typer

from kvdoctor.cli import options as opt
from kvdoctor.cli import output
from kvdoctor.cli.common import command_line, run
from kvdoctor.cli.serve_flags import ServeFlags, overrides, with_serve_flags


@with_serve_flags
def audit(
    serve: ServeFlags = ServeFlags(),
    json_out: opt.Json = False,
    verbose: opt.Verbose = False,
    output_format: opt.Format = None,
    report: opt.ReportFile = None,
    svg: opt.SvgFile = None,
    only: Annotated[list[str] | None, typer.Option(
        "--recipe", help="Audit only this built-in recipe (repeatable); default: every one.",
        metavar="NAME", show_default=False)] = None,
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
        fmt = opt.output_format(output_format, json_out, svg)
        opt.check_output_paths(report=report, svg=svg)
        setup_overrides = overrides(serve)
        from kvdoctor import app as application
        from kvdoctor.cli.progress import Progress

        with Progress("audit") as progress:
            result = application.audit(command=command_line(), overrides=setup_overrides, only=tuple(only or ()),
                                       default_worker=opt.DEFAULT_WORKER, on_progress=progress.callback)
        from kvdoctor.report.json_doc import audit_document
        from kvdoctor.report.tables import audit_renderables

        code = result.exit_status
        output.show_result("audit", result, fmt, audit_document, lambda res: audit_renderables(res, verbose),
                           svg, report)
        return code

    run(action, opt.wants_json(output_format, json_out))
