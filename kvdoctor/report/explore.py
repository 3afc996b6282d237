"""`kvdoctor explore`'s result in every format (formatting only): the search's summary, its findings and
their triage, the connector's line coverage (--coverage) as rich renderables, and its `--json` document."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvdoctor import SCHEMA_VERSION, __version__
from kvdoctor.report.formats import Shown

if TYPE_CHECKING:
    from kvdoctor.explore.app import ExploreReport
    from kvdoctor.observe.line_coverage import CoverageReport


def explore_shown(report: ExploreReport) -> Shown:
    """`kvdoctor explore` in every `--format` (Markdown: the text in a code block)."""
    return Shown(renderables=lambda: explore_renderables(report), document=lambda: explore_document(report))


def explore_renderables(report: ExploreReport) -> list[Any]:
    out = _search_summary(report)
    if report.coverage is not None:
        out.extend(_coverage_summary(report.coverage))
    return out


# Shorter names for the connector's two packages in the coverage table.
_SHORT = (("distributed/kv_transfer/kv_connector/v1/", ""), ("v1/kv_offload/", "kv_offload/"))


def _coverage_summary(covered: CoverageReport) -> list[Any]:
    """The connector's line coverage: one row per file (statements, executed, percent), then the total."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"connector line coverage: {covered.executed:,} of {covered.statements:,} statements "
                        f"({covered.percent:.1f}%)", box=box.SIMPLE, title_justify="left", pad_edge=False)
    for column in ("file", "statements", "executed", "%"):
        table.add_column(column, justify="left" if column == "file" else "right")
    for entry in covered.files:
        name = entry.file
        for prefix, short in _SHORT:
            if name.startswith(prefix):
                name = short + name[len(prefix):]
                break
        table.add_row(Text(name), str(entry.statements), str(entry.executed), f"{entry.percent:.0f}")
    return [table]


def _search_summary(report: ExploreReport) -> list[Any]:
    from rich import box
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    from kvdoctor.report.layout import Fit, Hanging, Items

    result, stats = report.result, report.result.stats
    config = result.config
    line = (f"explore on vLLM {result.vllm_version}, logic {config.logic}, seed {config.seed}: "
            f"{stats.examples} examples (+{stats.shrink_examples} while shrinking), "
            f"{stats.scheduler_steps:,} scheduler steps in {stats.elapsed:.1f} s "
            f"({stats.steps_per_second:,.0f} steps/s)")
    out: list[Any] = [Text(line)]
    for error in result.errors:
        out.append(Text(f"warning: {error}", style="yellow"))
    for lost in result.lost:
        out.append(Text(f"warning: {lost}", style="yellow"))
    if config.ray is not None and result.workers:
        nodes = sorted({w.node for w in result.workers})
        out.append(Text(f"{config.workers} Ray tasks on {len(nodes)} node(s): {', '.join(nodes)}"))
    if not report.findings:
        if result.lost:
            out.append(Text("no failure found in the part of the search that ran (incomplete: see the warnings)",
                            style="yellow"))
        else:
            out.append(Text("no example ran: nothing tested" if stats.examples == 0 else "no failure found",
                            style="yellow" if stats.examples == 0 else "green"))
        return out
    table = Table(title=f"{len(report.findings)} failure(s) found, shrunk and written to {report.out_dir}",
                  box=box.SIMPLE, title_justify="left")
    for column in ("signature", "steps", "found after", "recipe file"):
        table.add_column(column, no_wrap=column in ("steps", "recipe file"))
    for finding in report.findings:  # Text(): a `[...]` from vLLM's source is not rich markup
        table.add_row(Text(finding.label), str(finding.steps),
                      f"{finding.elapsed_s:.1f} s, {finding.examples_before} examples (worker {finding.worker})",
                      Text(finding.file or ""))
    blocks: list[Any] = [table.title if isinstance(table.title, Text) else Text(table.title or "")]
    for finding in report.findings:
        blocks.append(Items(finding.label.split(" "), prefix=" ", sep=" ", indent=4))
        blocks.append(Text(f"    {finding.steps} steps, after {finding.elapsed_s:.1f} s, "
                           f"{finding.examples_before} examples (worker {finding.worker})"))
        blocks.append(Text(f"    {finding.file or ''}"))
    out.append(Fit(table, Group(*blocks)))
    for finding in report.findings:  # Hanging: wrapped lines keep their indent (plain text, not markup)
        out.append(Hanging(f"{finding.label}: {finding.detail}"
                           + (" (flaky: hypothesis could not replay it deterministically)" if finding.flaky else ""),
                           extra=4))
        out.append(Hanging(f"    impact: {finding.impact.line}", extra=8))
        if finding.triage is not None:
            style = "bold" if finding.triage.report else ""
            out.append(Hanging(f"    triage: {finding.triage.line}", extra=8, style=style))
            for note in finding.triage.diagnosis:
                out.append(Hanging(f"    diagnosis: {note}", extra=8))
            if finding.triage.report:
                out.append(Hanging(f"    report attachment: {finding.triage.report}", extra=8))
    for note in report.notes:
        out.append(Hanging(f"note: {note}", extra=6, style="yellow"))
    out.append(Text("replay one with: kvdoctor repro <recipe file>"
                    + (f" --logic {config.logic}" if config.logic != "installed" else "")
                    + (" (a finding at core: add --engine core)"
                       if any(f.engine == "core" for f in report.findings) else "")))
    return out


def explore_document(report: ExploreReport) -> dict[str, Any]:
    """The `--json` document (stable keys, `schema_version`)."""
    result, config, stats = report.result, report.result.config, report.result.stats
    return {
        "schema_version": SCHEMA_VERSION,
        "kvdoctor_version": __version__,
        "vllm_version": result.vllm_version,
        "command": report.command or None,
        "logic": config.logic,
        "seed": config.seed,
        "workers": config.workers,
        "worker": config.worker,
        "max_examples": config.max_examples,
        "time_budget_s": config.time_budget,
        "out": str(report.out_dir),
        "examples": stats.examples,
        "shrink_examples": stats.shrink_examples,
        "invalid_examples": stats.invalid,
        "excluded_runs": stats.excluded,  # failing runs through an --exclude-trigger bug's trigger, run past
        "scheduler_steps": stats.scheduler_steps,
        "elapsed_s": round(stats.elapsed, 3),
        "wall_s": round(report.wall_s, 3),  # on the budget's clock: search, shrinking and triage
        "steps_per_second": round(stats.steps_per_second, 1),
        "findings": [finding.as_dict() for finding in report.findings],
        "errors": list(result.errors),
        "lost": list(result.lost),
        "ray": config.ray,
        "nodes": sorted({w.node for w in result.workers}),
        # --coverage: the connector's line coverage per file and in total (null without --coverage)
        "coverage": report.coverage.as_dict() if report.coverage is not None else None,
    }
