"""The `hunt` application function: read the log, aim explore at its crash site, say what came of it.

Free of Typer and of formatting (the CLI renders `HuntReport`). One worker, in-process: the crash function's
line coverage is counted over the whole search (`observe.function_lines`), which needs the search in this
process. A finding counts as the crash when it fails with the log's exception in the log's function and, when
the log shows the statement, at that statement; other failures the search meets are listed apart.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from kvdoctor.diagnose.match import match_log
from kvdoctor.diagnose.reader import read_log
from kvdoctor.errors import ExitStatus, UsageError
from kvdoctor.hunt.aim import MAX_SCAN_BYTES, HuntAim, aim_from_log


@dataclass
class HuntReport:
    source: str
    aim: HuntAim
    explored: Any = None  # explore.app.ExploreReport
    reach: Any = None  # observe.function_lines.FunctionReach
    at_site: list[Any] = field(default_factory=list)  # findings at the crash site (the hunt's answer)
    elsewhere: list[Any] = field(default_factory=list)  # other failures of the search
    vllm_version: str = ""
    wall_s: float = 0.0
    command: str = ""

    @property
    def examples(self) -> int:
        return self.explored.result.stats.examples if self.explored is not None else 0

    @property
    def inconclusive_reason(self) -> str:
        """Why a hunt that found nothing tested nothing ("" when its examples reached the function)."""
        if self.at_site:
            return ""
        if self.examples == 0:
            return "no example ran within the time budget: nothing was tested (give a longer --time-budget)"
        reach = self.reach
        if reach is None or not reach.measured:
            why = reach.why_not if reach is not None else "not measured"
            return f"whether any example reached {self.aim.function} is unknown ({why})"
        if reach.examples == 0:
            return (f"none of the {self.examples} example(s) reached {self.aim.function}: the crash's function "
                    f"was not tested")
        return ""

    @property
    def exit_status(self) -> ExitStatus:
        if self.at_site:
            return ExitStatus.REPRODUCED
        explored = self.explored
        if explored is not None and (explored.result.lost or explored.result.errors):
            return ExitStatus.SETUP_OR_OTHER_FAILURE
        return ExitStatus.INCONCLUSIVE if self.inconclusive_reason else ExitStatus.NOT_REPRODUCED


def _normalized(text: str) -> str:
    return " ".join(text.replace("(", " ").replace(")", " ").split())


def at_site(finding: Any, aim: HuntAim) -> bool:
    """Whether a finding is the log's crash: its exception in its function, at its statement when known."""
    signature = finding.recipe.signature
    if finding.kind != "exception" or signature.exception != aim.exception:
        return False
    if aim.function not in signature.functions():
        return False
    if not aim.statement:
        return True
    wanted = _normalized(aim.statement.removeprefix("assert "))
    return wanted in _normalized(" ".join(filter(None, (finding.detail, signature.contains))))


def read_aim(log: str, target: str | None = None, force: list[str] | None = None, include_known: bool = False,
             stdin: IO[bytes] | None = None) -> HuntAim:
    """The aim, before anything heavy is imported (a bad log or flag: one line, exit 2)."""
    summary = read_log(log, stdin=stdin)
    from kvdoctor.recipes.builtins import all_builtins

    return aim_from_log(summary, match_log(summary, all_builtins()), target, force, include_known, _log_text(log))


def _log_text(log: str) -> str:
    """The log's text for the layout words (`hunt.aim.implied_layouts`): a file's first MAX_SCAN_BYTES
    (decompressed as `diagnose` reads it), pasted text itself; "" for stdin (read once, by `read_log`)."""
    if log == "-":
        return ""
    path = Path(log)
    if not path.is_file():
        return log
    from kvdoctor.diagnose.reader import open_log_stream

    try:
        with path.open("rb") as handle:
            return open_log_stream(handle, log).read(MAX_SCAN_BYTES).decode("utf-8", errors="replace")
    except (OSError, UsageError, EOFError, ValueError):
        return ""


def keep_buildable_layouts(api: Any, aim: HuntAim) -> None:
    """Drop from the aim's forced layouts those this vLLM cannot build (a probe: `explore.search.layout_refusal`),
    saying so with the features not expressed; none left: the layout is drawn at random."""
    from kvdoctor.explore.aim import LAYOUT_PREFIX, forced_layouts
    from kvdoctor.explore.search import layout_refusal

    for layout in forced_layouts(aim.force):
        refusal = layout_refusal(api, layout)
        if refusal is not None:
            aim.force = aim.force - {LAYOUT_PREFIX + (layout or "default")}
            aim.unexpressed.append((f"layout {layout}", f"not expressed: this vLLM does not build it ({refusal})"))


def validate(time_budget: float, max_events: int) -> None:
    if not time_budget > 0:
        raise UsageError(f"--time-budget must be > 0 seconds, got {time_budget}")
    if max_events < 1:
        raise UsageError(f"--max-events must be >= 1, got {max_events}")


def hunt(aim: HuntAim, out_dir: Path, time_budget: float, seed: int = 0, max_events: int | None = None,
         triage: bool = True, command: str = "", source: str = "",
         on_progress: Callable[[Any, Any], None] | None = None, on_finding: Callable[[Any], None] | None = None,
         write_attachment: Callable[[Any, Any], str | None] | None = None) -> HuntReport:
    """Explore aimed at `aim` (its target, forced features, excluded triggers) for `time_budget` seconds after
    vLLM's import, counting the crash function's lines; `on_progress(explore result, reach so far)`."""
    from kvdoctor.engine import compat
    from kvdoctor.explore import DEFAULT_MAX_EVENTS
    from kvdoctor.explore import app as explore_app
    from kvdoctor.explore.search import ExploreConfig, warm_up
    from kvdoctor.observe.function_lines import FunctionLines

    validate(time_budget, max_events or DEFAULT_MAX_EVENTS)
    start = time.monotonic()
    api = compat.load()
    warm_up(api)  # vLLM's first build before the lines are counted and the clock starts
    keep_buildable_layouts(api, aim)
    config = ExploreConfig(seed=seed, max_events=max_events or DEFAULT_MAX_EVENTS, time_budget=time_budget,
                           workers=1, triage=triage, target=(aim.exception, aim.function), force=aim.force,
                           exclude_triggers=aim.exclude)
    stats: list[Any] = []

    def example() -> int:
        """The number of the example running now (the counters move once it has run; -1 before the first report)."""
        return stats[0].examples + stats[0].shrink_examples if stats else -1

    report = HuntReport(source=source, aim=aim, vllm_version=api.version_text, command=command)
    tracer = FunctionLines(aim.function, example, aim.file, aim.statement)

    def progress(result: Any) -> None:
        if not stats:
            stats.append(result.stats)
        stats[0] = result.stats
        if on_progress is not None:
            on_progress(result, tracer.reach)

    with tracer as reach:
        report.explored = explore_app.explore(config, out_dir, command=command, on_progress=progress,
                                              on_finding=on_finding, api=api, write_attachment=write_attachment)
    report.reach = reach
    for finding in report.explored.findings:
        (report.at_site if at_site(finding, aim) else report.elsewhere).append(finding)
    report.wall_s = time.monotonic() - start
    return report
