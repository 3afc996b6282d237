"""`kvdoctor repro RECIPE`: run a recipe under each logic variant; `--list` the built-in ones.

Registered in `kvdoctor.cli.app`; what commands share comes from `kvdoctor.cli.common`,
`output` and `serve_flags`, never from `kvdoctor.cli.app`. Importing this module stays
cheap (Typer only); the work is in `kvdoctor.app`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvdoctor.cli import options as opt
from kvdoctor.cli import output
from kvdoctor.cli.common import command_line, run
from kvdoctor.cli.serve_flags import ServeFlags, overrides, with_serve_flags
from kvdoctor.errors import EXIT_NOT_REPRODUCED

LOGIC_HELP = ("installed | fixed | unpatched | all. installed: vLLM's own storable_chunks; fixed: with the "
              "PR #49146 cap (storable chunks <= allocated chunks), kvdoctor's 'fixed logic'; unpatched: "
              "the installed method with that cap removed.")


@with_serve_flags
def repro(
    recipe: Annotated[str | None, typer.Argument(help="A built-in recipe name or a path to a recipe .toml.",
                                                    show_default=False, metavar="RECIPE")] = None,
    list_recipes: Annotated[bool, typer.Option("--list", help="List the built-in recipes (one line each) and exit; "
                                                              "with RECIPE, show that one in full.")] = False,
    logic: Annotated[str, typer.Option("--logic", metavar="LOGIC", help=LOGIC_HELP)] = "all",
    serve: ServeFlags = ServeFlags(),
    json_out: opt.Json = False,
    verbose: opt.Verbose = False,
    output_format: opt.Format = None,
    report: opt.ReportFile = None,
    svg: opt.SvgFile = None,
    export_script: Annotated[Path | None, typer.Option(
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
        from kvdoctor.outcome_codes import exit_code_for

        if list_recipes:
            return list_builtins(opt.output_format(output_format, json_out), verbose, recipe)
        if recipe is None:
            raise UsageError("give a RECIPE (a built-in name or a .toml file); `kvdoctor repro --list` shows them")
        fmt = opt.output_format(output_format, json_out, svg)
        opt.check_output_paths(report=report, svg=svg, export_script=export_script)
        setup_overrides = overrides(serve)
        from kvdoctor import app as application

        if export_script is not None:
            if json_out or output_format is not None or report is not None or svg is not None:
                raise UsageError("--export-script writes a script and runs nothing: drop "
                                 "--json/--format/--report/--svg")
            application.export(recipe, setup_overrides, export_script, default_worker=opt.DEFAULT_WORKER)
            from kvdoctor.cli.streams import note

            note(f"standalone script written to {export_script} (run it with: python {export_script})")
            return EXIT_NOT_REPRODUCED
        from kvdoctor.cli.progress import Progress

        with Progress("repro") as progress:
            result = application.repro(recipe, setup_overrides, logic, record_timeline=report is not None,
                                       command=command_line(), default_worker=opt.DEFAULT_WORKER,
                                       on_progress=progress.callback)
        from kvdoctor.report.json_doc import repro_document
        from kvdoctor.report.tables import repro_renderables

        code = exit_code_for(result.decisive)
        output.show_result("repro", result, fmt, repro_document, repro_renderables, svg, report)
        output.note_untested_level(result.decisive, result.setup.engine)
        return code

    run(action, opt.wants_json(output_format, json_out))


def list_builtins(fmt: str, verbose: bool, name: str | None) -> int:
    """One line per built-in recipe; `name` (a built-in or a .toml): that recipe in full."""
    from kvdoctor.recipes.builtins import all_builtins, resolve
    from kvdoctor.report.recipes import recipes_shown

    recipes = [resolve(name)] if name is not None else all_builtins()
    output.show(recipes_shown(recipes, verbose, detail=name is not None), fmt)
    return 0
