"""`kvdoctor explore`: search for new offload-scheduler failures with generated event sequences.

Register with `app.command()(explore)` in `kvdoctor.cli.app`. Importing this
module stays cheap (Typer only): hypothesis and vLLM are imported inside the
command, through `kvdoctor.explore.app`. It takes what commands share from
`kvdoctor.cli.common`, never from `kvdoctor.cli.app` (which imports it).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from kvdoctor.cli import options as opt
from kvdoctor.cli.common import command_line, run
from kvdoctor.explore import (
    DEFAULT_MAX_EVENTS,
    DEFAULT_MAX_EXAMPLES,
    DEFAULT_OUT,
    DEFAULT_SEED,
    DEFAULT_TIME_BUDGET,
)

SEARCH = "Search"


def explore(
    logic: Annotated[str, typer.Option(
        "--logic", help="installed | fixed | unpatched: the storable_chunks logic to explore under.",
        rich_help_panel=SEARCH)] = "installed",
    seed: Annotated[int, typer.Option("--seed", help="Seed of the search (same seed, same examples).",
                                      rich_help_panel=SEARCH)] = DEFAULT_SEED,
    max_examples: Annotated[int | None, typer.Option(
        "--max-examples", help="Generated examples to run at most (per worker; shrinking not counted). "
                               "Default: no limit, the time budget decides.",
        rich_help_panel=SEARCH)] = DEFAULT_MAX_EXAMPLES,
    time_budget: Annotated[float, typer.Option(
        "--time-budget", help="Seconds of exploring at most, after vLLM is imported (a failure being "
                              "shrunk when it runs out gets up to 30 s more).",
        rich_help_panel=SEARCH)] = DEFAULT_TIME_BUDGET,
    workers: Annotated[int | None, typer.Option(
        "--workers", help="Processes searching in parallel (one vLLM import each, distinct seeds); at most one "
                          "a CPU and a ~1.5 GiB of available memory (more is refused). Default 1; with --ray, "
                          "Ray tasks: one per slot of the cluster.",
        rich_help_panel=SEARCH)] = None,
    ray: opt.Ray = False,
    ray_address: opt.RayAddress = None,
    max_events: Annotated[int, typer.Option(
        "--max-events", help="Events per generated sequence at most.", rich_help_panel=SEARCH)] = DEFAULT_MAX_EVENTS,
    worker: Annotated[str, typer.Option(
        "--worker", help="simulated (default, fast: bookkeeping only) | vllm: vLLM's worker-role connector on "
                         "real KV tensors, every run also checked for KV content.",
        rich_help_panel=SEARCH)] = "simulated",
    triage: Annotated[bool, typer.Option(
        "--triage/--no-triage", help="Rerun each finding without the offloading connector and through vLLM's "
                                     "EngineCore, and check its steps against what an engine core can produce "
                                     "(on by default).",
        rich_help_panel=SEARCH)] = True,
    target: Annotated[str | None, typer.Option(
        "--target", help="EXC:FUNCTION: only failures of that exception in that vLLM function count (e.g. "
                         "AssertionError:_build_store_jobs); others are run past.", rich_help_panel=SEARCH)] = None,
    force: Annotated[list[str] | None, typer.Option(
        "--force", help="Draw a feature whatever this vLLM's probes say: speculative | fs-tier | workers | "
                        "withheld-hashes | pd-decode | sleep-wake (played at --engine core) | layout=NAME (a shipped "
                        "layout, the only one drawn) "
                        "(repeatable).",
        rich_help_panel=SEARCH)] = None,
    exclude_trigger: Annotated[str | None, typer.Option(
        "--exclude-trigger", help="Known bugs (K1,K6) whose trigger a finding must not go through: a run "
                                  "through one is that bug, not a new route.", rich_help_panel=SEARCH)] = None,
    coverage: Annotated[bool, typer.Option(
        "--coverage", help="Measure the line coverage of vLLM's offloading connector code (coverage.py) and report "
                           "it per file at the end; the search then favours examples that reach more of it. "
                           "Slower (docs/explore-vocabulary.md measures by how much); off by default.",
        rich_help_panel=SEARCH)] = False,
    out: Annotated[Path, typer.Option(
        "--out", help="Folder for the shrunk recipes, one file per failure signature and path.",
        rich_help_panel=opt.OUTPUT)] = Path(DEFAULT_OUT),
    json_out: opt.Json = False,
    output_format: opt.Format = None,
) -> None:
    """Search for new offload-scheduler failures with generated event sequences on the real scheduler.

    Hypothesis draws a serving geometry (block and chunk sizes, pool, batch budget, the offloading spec,
    the model's KV layout) and a sequence of events (add, with shared prefixes; schedule;
    abort; finish by EOS; hold, complete or fail transfers; reset the prefix cache; drain; delay or
    release a request's block hashes) and runs it, sync and async, under every kvdoctor invariant; then
    every transfer completes and every finished request's connector state must be released.

    Each distinct failure (exception + innermost vLLM function, or invariant) is shrunk by hypothesis
    and written to --out as a recipe that `kvdoctor repro FILE` replays; a finding whose signature is
    a known recipe's is labelled with that bug (K1, K4, ...).

    Each finding is then triaged: rerun without the offloading connector (a failure there too is
    vLLM's core scheduler's), its steps checked against what vLLM's engine core can produce, and
    replayed through vLLM's EngineCore (--engine core). One that survives all three and is no known
    bug is a candidate upstream report, with its `repro --report` attachment written beside its
    recipe."""
    def action() -> int:
        from kvdoctor.explore import app as explore_app
        from kvdoctor.explore.search import ExploreConfig

        fmt = opt.output_format(output_format, json_out)
        address = opt.ray_address(ray, ray_address)
        asked = workers if workers is not None else (0 if ray else 1)  # 0: one per slot of the Ray cluster
        explore_app.validate(logic, max_examples, time_budget, asked, max_events, worker, ray=address)
        opt.check_output_dir("--out", out)
        from kvdoctor.explore.aim import parse_aim

        aim = parse_aim(target, force or [], exclude_trigger)
        config = ExploreConfig(seed=seed, logic=logic, max_examples=max_examples, time_budget=time_budget,
                               max_events=max_events, workers=asked, worker=worker, triage=triage, ray=address,
                               coverage=coverage, **aim)
        display = _Display(config, quiet_lines=fmt == "json")
        with display:
            report = explore_app.explore(config, out, command=command_line(),
                                         on_progress=display.progress, on_finding=display.finding,
                                         write_attachment=write_attachment)
        from kvdoctor.cli import output
        from kvdoctor.report.explore import explore_shown

        output.show(explore_shown(report), fmt)
        untested = explore_app.nothing_tested(report)
        if untested is not None and not report.result.errors:
            from kvdoctor.cli.streams import note

            note(f"kvdoctor: {untested}")
        return explore_app.exit_status(report)

    run(action, opt.wants_json(output_format, json_out))


class _Display:
    """Live progress on stderr when it is a terminal; otherwise one line per finding."""

    def __init__(self, config: Any, quiet_lines: bool) -> None:
        from rich.console import Console

        from kvdoctor.cli.streams import current

        self.config = config
        self.console = Console(stderr=True, highlight=False, width=current().width())
        self.live_mode = self.console.is_terminal
        self.quiet_lines = quiet_lines
        self.live: Any = None
        self.result: Any = None
        self.found: list[Any] = []
        self.started = time.monotonic()

    def __enter__(self) -> _Display:
        if self.live_mode:
            from rich.live import Live

            # `self` (its __rich__) is rendered at each refresh, so the clock moves between reports
            self.live = Live(self, console=self.console, refresh_per_second=4, transient=True)
            self.live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.live is not None:
            self.live.__exit__(*exc)

    def __rich__(self) -> Any:
        return self._render()

    def progress(self, result: Any) -> None:
        self.result = result
        if self.live is not None:
            self.live.refresh()

    def finding(self, finding: Any) -> None:
        self.found.append(finding)
        if self.live is not None:
            self.live.refresh()
        elif not self.quiet_lines:
            print(f"kvdoctor explore: found {finding.label} ({finding.steps} steps, "
                  f"after {finding.elapsed_s:.1f} s)", file=sys.stderr, flush=True)

    def _render(self) -> Any:
        from rich.table import Table
        from rich.text import Text

        config = self.config
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold")
        grid.add_column()
        head = f"logic {config.logic} · seed {config.seed} · workers {config.workers or 'per Ray slot'}"
        if config.ray is not None:
            head += f" · Ray {config.ray}"
        if self.result is None:
            from kvdoctor.cli.progress import elapsed_text

            grid.add_row("explore", head + f" · importing vLLM… {elapsed_text(time.monotonic() - self.started)}")
            return grid
        stats, config = self.result.stats, self.result.config  # sized: under Ray, by the cluster
        head = f"logic {config.logic} · seed {config.seed} · workers {config.workers}"
        if config.ray is not None:
            head += f" · Ray {config.ray}"
        grid.add_row("explore", f"vLLM {self.result.vllm_version} · {head}")
        budget = "" if config.max_examples is None else f"/{config.max_examples * config.workers}"
        grid.add_row("examples", f"{stats.examples}{budget} (+{stats.shrink_examples} while shrinking)"
                                 + (f" · {stats.invalid} refused by vLLM" if stats.invalid else ""))
        rate = stats.examples / stats.elapsed if stats.elapsed > 0 else 0.0
        grid.add_row("speed", f"{rate:,.1f} examples/s, {stats.steps_per_second:,.0f} scheduler steps/s "
                              f"({stats.scheduler_steps:,} steps in {stats.elapsed:.1f} s "
                              f"of {config.time_budget:g} s; "
                              f"{max(config.time_budget - stats.elapsed, 0):.0f} s left)")
        grid.add_row("doing", stats.phase)
        if config.ray is not None and self.result.workers:
            nodes = sorted({w.node for w in self.result.workers})
            grid.add_row("cluster", f"{len(self.result.workers)} of {config.workers} tasks ready on "
                                    f"{len(nodes)} node(s): {', '.join(nodes)}")
        failures = Text(str(len(self.found)), style="bold red" if self.found else "green")
        grid.add_row("failures", failures)
        for finding in self.found:
            grid.add_row("", Text(f"{finding.label} ({finding.steps} steps)"))
        return grid


def write_attachment(finding: Any, result: Any) -> str | None:
    """`kvdoctor repro FILE --report` for a candidate finding's recipe, with its triage, written beside
    the recipe (`<name>.report.md`); explore's application calls it, the formatting stays here."""
    from kvdoctor import app as application
    from kvdoctor.engine.overrides import Overrides
    from kvdoctor.report.markdown import render_markdown, triage_markdown

    path = Path(finding.file)
    target = path.with_suffix(".report.md")
    engine = finding.engine  # a sleep/wake finding replays at its level: --engine core
    replay = (f"kvdoctor repro {path}" + (f" --logic {finding.logic}" if finding.logic != "installed" else "")
              + (f" --engine {engine}" if engine != "scheduler" else ""))
    overrides = Overrides(engine=engine) if engine != "scheduler" else Overrides()
    report = application.repro(str(path), overrides, finding.logic, record_timeline=True, command=replay)
    try:
        target.write_text(render_markdown("repro", report).rstrip("\n") + "\n\n" + triage_markdown(result),
                          encoding="utf-8")
    except OSError:
        return None
    return str(target)
