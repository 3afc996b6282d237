"""`kvdoctor hunt LOG` (and `kvdoctor diagnose LOG --hunt`, through `hunt_action`): explore aimed at a log's crash.

Registered in `kvdoctor.cli.app`; importing it stays cheap (Typer only). The work is in `kvdoctor.hunt.app`;
the finding's attachment is written by explore's CLI helper (`explore_cmd.write_attachment`).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from kvdoctor.cli import options as opt
from kvdoctor.cli.common import command_line, run
from kvdoctor.hunt import DEFAULT_OUT, DEFAULT_TIME_BUDGET

AIM = "Aim"
PROGRESS_EVERY_S = 15.0

Target = Annotated[str | None, typer.Option(
    "--target", help="EXC:FUNCTION to hunt for, over the log's own (needed when the traceback is cut before its "
                     "exception and function).", rich_help_panel=AIM)]
Force = Annotated[list[str] | None, typer.Option(
    "--force", help="A feature to force besides those the log names: speculative | fs-tier | workers | "
                    "withheld-hashes | pd-decode | sleep-wake | layout=NAME (a shipped KV layout or default; "
                    "repeatable).",
    rich_help_panel=AIM)]
IncludeKnown = Annotated[bool, typer.Option(
    "--include-known", help="Count routes through known bugs' triggers too (by default a route through K1's or "
                            "K6's trigger is that bug, not this crash, and is run past).", rich_help_panel=AIM)]
TimeBudget = Annotated[float, typer.Option(
    "--time-budget", help="Seconds of hunting after vLLM's import (search, shrinking, triage).",
    rich_help_panel=AIM)]
Out = Annotated[Path, typer.Option("--out", help="Folder for the shrunk recipes and their report attachments.",
                                   rich_help_panel=opt.OUTPUT)]


def hunt(
    log: Annotated[str, typer.Argument(help="A vLLM log file (or a pasted traceback); `-` reads stdin.",
                                       metavar="LOG")],
    target: Target = None,
    force: Force = None,
    include_known: IncludeKnown = False,
    time_budget: TimeBudget = DEFAULT_TIME_BUDGET,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the search.", rich_help_panel=AIM)] = 0,
    triage: Annotated[bool, typer.Option(
        "--triage/--no-triage", help="Rerun a finding without the connector and through EngineCore (default on).",
        rich_help_panel=AIM)] = True,
    out: Out = Path(DEFAULT_OUT),
    json_out: opt.Json = False,
    output_format: opt.Format = None,
) -> None:
    """Hunt for a route to a log's unknown crash: read the log as diagnose does, aim explore at its crash site
    (exception, function, the statement when the log shows it), force the features the log names (speculative
    decoding, KV tiers; async scheduling is always tried), and run past routes through known bugs' triggers.

    A route found is shrunk to a recipe, triaged (connector off, EngineCore) and written under --out with its
    report attachment (exit 1). Otherwise it says which lines of the crash's function the search ran and which
    features the log names that it could not express: exit 0 when examples reached the function and none failed
    there, 6 (inconclusive) when none reached it. A log with no crash site to aim at needs --target (exit 2)."""
    run(lambda: hunt_action(log, target, force or [], include_known, time_budget, seed, triage, out,
                            output_format, json_out), opt.wants_json(output_format, json_out))


def hunt_action(log: str, target: str | None, force: list[str], include_known: bool, time_budget: float, seed: int,
                triage: bool, out: Path, output_format: str | None, json_out: bool) -> int:
    """The hunt, from flags to exit code: one implementation for `hunt` and `diagnose --hunt`."""
    from kvdoctor.hunt import app as hunt_app

    fmt = opt.output_format(output_format, json_out)
    hunt_app.validate(time_budget, 1)
    opt.check_output_dir("--out", out)
    aim = hunt_app.read_aim(log, target, force, include_known, stdin=_stdin_bytes() if log == "-" else None)
    from kvdoctor.cli.explore_cmd import write_attachment

    progress = _Progress(aim, time_budget)
    report = hunt_app.hunt(aim, out, time_budget, seed=seed, triage=triage, command=command_line(),
                           source=log, on_progress=progress.update, on_finding=progress.finding,
                           write_attachment=write_attachment)
    from rich.text import Text

    from kvdoctor.cli import output
    from kvdoctor.report.formats import Shown
    from kvdoctor.report.hunt import hunt_document, hunt_lines

    output.show(Shown(renderables=lambda: [Text(line) for line in hunt_lines(report)],
                      document=lambda: hunt_document(report)), fmt)
    reason = report.inconclusive_reason
    if reason and not report.at_site:
        from kvdoctor.cli.streams import note

        note(f"kvdoctor: hunt inconclusive: {reason}")
    return int(report.exit_status)


class _Progress:
    """A line on stderr every PROGRESS_EVERY_S seconds and at each finding: examples, reach of the function."""

    def __init__(self, aim: Any, budget: float) -> None:
        self.aim = aim
        self.budget = budget
        self.last = 0.0
        print(f"kvdoctor hunt: {aim.site}; forcing {', '.join(sorted(aim.force)) or 'nothing'}"
              + (f"; excluding {', '.join(sorted(aim.exclude))}'s triggers" if aim.exclude else "")
              + f"; importing vLLM, then {budget:g} s", file=sys.stderr, flush=True)

    def update(self, result: Any, reach: Any) -> None:
        now = time.monotonic()
        if now - self.last < PROGRESS_EVERY_S:
            return
        self.last = now
        stats = result.stats
        print(f"kvdoctor hunt: {stats.elapsed:.0f}/{self.budget:g} s, {stats.examples} examples, "
              f"{reach.calls} call(s) of {self.aim.function}, {stats.excluded} excluded run(s); {stats.phase}",
              file=sys.stderr, flush=True)

    def finding(self, finding: Any) -> None:
        print(f"kvdoctor hunt: found {finding.label} ({finding.steps} steps, after {finding.elapsed_s:.1f} s)",
              file=sys.stderr, flush=True)


def _stdin_bytes() -> Any:
    from kvdoctor.cli.streams import current

    stream = current().stdin_stream
    return getattr(stream, "buffer", stream)
