"""Rich renderables for repro and inspect results. Formatting only, no logic."""

from __future__ import annotations

from typing import Any, Iterable

from rich import box
from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

OUTCOME_STYLE = {
    "reproduced": "bold red",
    "not_reproduced": "bold green",
    "other_failure": "bold magenta",
    "not_applicable": "dim",
    "setup_error": "bold yellow",
}
TRIP_MARK = "⚠ will trip"


def outcome_text(outcome: str) -> Text:
    return Text(outcome, style=OUTCOME_STYLE.get(outcome, ""))


def verdict_table(report: Any) -> Table:
    table = Table(title=f"{report.recipe.name} on vLLM {report.vllm_version}", box=box.SIMPLE_HEAVY,
                  title_justify="left")
    table.add_column("logic", style="bold")
    table.add_column("outcome")
    table.add_column("where / why")
    for result in report.results:
        table.add_row(result.logic, outcome_text(result.outcome.value), why(result))
    return table


def why(result: Any) -> str:
    if result.failure is not None:
        f = result.failure
        return f"{f.exception} at {f.file}:{f.line} in {f.function} (step {result.failure_step})"
    parts = []
    if result.detail:
        parts.append(result.detail)
    parts.extend(result.guards)
    passed = [c.description for c in result.checks if c.passed]
    if passed:
        parts.append("checks held: " + "; ".join(passed))
    return "\n".join(parts) or "ran through; no failure"


def failure_panel(result: Any) -> Panel:
    f = result.failure
    lines = [
        Text.assemble(("exception  ", "bold"), (f.exception, "red"), ": ", f.message),
        Text.assemble(("where      ", "bold"), f"{f.file}:{f.line} in {f.function}()"),
        Text.assemble(("code       ", "bold"), (f.code or "", "italic")),
        Text("vLLM frames (outermost first):", style="bold"),
    ]
    for frame in f.vllm_frames:
        lines.append(Text(f"  {frame.file}:{frame.line} {frame.function}: {frame.code}"))
    return Panel(Group(*lines), title=f"{result.logic} logic: failure at step {result.failure_step}",
                 border_style="red", expand=False)


def state_table(requests: Iterable[Any], title: str) -> Table:
    table = Table(title=title, box=box.SIMPLE, title_justify="left", show_lines=False)
    for column in ("request", "status", "prompt", "computed", "group", "keys", "blocks",
                   "chunks", "next stored", "storable installed", "storable fixed", "in flight", ""):
        table.add_column(column, justify="right" if column not in ("request", "status", "in flight", "") else "left",
                         no_wrap=column in ("request", "status", ""))
    for snap in requests:
        base = [snap.request, snap.status, str(snap.prompt_tokens), str(snap.computed_tokens)]
        if not snap.groups:
            table.add_row(*base, "-", "-", "-", "-", "-", "-", "-", "-",
                          "" if snap.connector_state else "connector state released")
            continue
        for i, g in enumerate(snap.groups):
            row = base if i == 0 else [""] * 4
            installed_style = "bold red" if g.storable_installed > g.allocated_chunks else ""
            table.add_row(
                *row, str(g.group), str(g.offload_keys), str(g.allocated_blocks), str(g.allocated_chunks),
                str(g.next_stored_chunk), Text(str(g.storable_installed), style=installed_style),
                str(g.storable_fixed), ", ".join(snap.in_flight_jobs) or "-",
                Text(TRIP_MARK, style="bold red") if g.would_trip else "",
            )
    return table


def checks_table(result: Any) -> Table | None:
    if not result.checks:
        return None
    table = Table(title=f"{result.logic} logic: checks", box=box.SIMPLE,
                  title_justify="left")
    table.add_column("check")
    table.add_column("held")
    table.add_column("observed")
    for check in result.checks:
        table.add_row(check.description, Text("yes", style="green") if check.passed else Text("NO", style="red"),
                      check.observed)
    return table


def repro_renderables(report: Any) -> list[Any]:
    items: list[Any] = [
        Text.assemble(("recipe ", "bold"), report.recipe.name,
                      f" ({report.recipe.bug})" if report.recipe.bug else "", " — ", report.recipe.title or ""),
        Text(f"setup: {setup_line(report.setup)}", style="dim"),
        verdict_table(report),
    ]
    shown: dict[tuple, str] = {}
    for result in report.results:
        if result.failure is not None:
            f = result.failure
            key = (f.exception, f.file, f.line, result.failure_step,
                   repr([(r.as_dict() | {"groups": [(g.offload_keys, g.allocated_blocks, g.next_stored_chunk)
                                                      for g in r.groups]}) for r in result.requests]))
            if key in shown:
                items.append(Text(f"[{result.logic}] the same failure as under the {shown[key]} logic, "
                                  f"at the same step, with the same request state.", style="dim"))
                continue
            shown[key] = result.logic
            items.append(failure_panel(result))
            items.append(state_table(result.requests, f"{result.logic} logic: request state when it fired"))
        elif result.outcome.value == "setup_error":
            items.append(Text(f"[{result.logic}] setup error: {result.detail}", style="yellow"))
            items.append(state_table(result.requests, f"{result.logic} logic: request state"))
        checks = checks_table(result)
        if checks is not None:
            items.append(checks)
    return items


def setup_line(setup: Any) -> str:
    return (f"block_size={setup.block_size} blocks_per_chunk={setup.blocks_per_chunk} "
            f"gpu_blocks={setup.gpu_blocks} async_scheduling={setup.async_scheduling} "
            f"max_num_batched_tokens={setup.max_num_batched_tokens} max_num_seqs={setup.max_num_seqs} "
            f"max_model_len={setup.max_model_len} enable_chunked_prefill={setup.enable_chunked_prefill} "
            f"offload_prompt_only={setup.offload_prompt_only} cpu_bytes_to_use={setup.cpu_bytes_to_use}"
            + (f" spec_name={setup.spec_name}" if setup.spec_name else ""))


def events_line(events: Any) -> str:
    if events is None:
        return ""
    parts = []
    if events.scheduled_tokens:
        parts.append("scheduled " + ", ".join(f"{r}:{n}" for r, n in events.scheduled_tokens.items()))
    if events.new_store_jobs:
        parts.append("store jobs " + ", ".join(f"#{j}({r})" for j, r in events.new_store_jobs.items()))
    if events.new_load_jobs:
        parts.append("load jobs " + ", ".join(f"#{j}({r})" for j, r in events.new_load_jobs.items()))
    if events.completed_jobs:
        parts.append("completed " + ", ".join(f"#{j}" for j in events.completed_jobs))
    if events.failed_jobs:
        parts.append("failed " + ", ".join(f"#{j}" for j in events.failed_jobs))
    if events.jobs_to_flush:
        parts.append("flush " + ", ".join(f"#{j}" for j in events.jobs_to_flush))
    if events.preempted:
        parts.append("preempted " + ", ".join(events.preempted))
    if events.finished:
        parts.append("finished " + ", ".join(events.finished))
    return "; ".join(parts) or "nothing scheduled"


def timeline_renderables(result: Any, only_step: int | None = None) -> list[Any]:
    """One block per step; consecutive steps that changed nothing fold into one line."""
    items: list[Any] = [Text(f"timeline under the {result.logic} logic", style="bold underline")]
    previous_state = None
    folded: list[int] = []

    def flush_folded() -> None:
        if folded:
            span = f"{folded[0]}" if len(folded) == 1 else f"{folded[0]}–{folded[-1]}"
            items.append(Text(f"steps {span}: no change", style="dim"))
            folded.clear()

    for entry in result.timeline:
        if only_step is not None and entry.index != only_step:
            continue
        state_key = [r.as_dict() for r in entry.requests]
        quiet = (entry.events is None or entry.events.is_quiet()) and entry.action == "schedule"
        if only_step is None and quiet and state_key == previous_state and not entry.failed:
            folded.append(entry.index)
            continue
        flush_folded()
        previous_state = state_key
        header = Text.assemble((f"step {entry.index} ", "bold"), (entry.description, "cyan"),
                               (f"  (line {entry.line})" if entry.line else "", "dim"))
        items.append(header)
        line = events_line(entry.events)
        if line:
            items.append(Text("  " + line))
        if entry.failed and result.failure is not None:
            items.append(failure_panel(result))
        elif entry.failed:  # a violated invariant or a precondition that did not hold
            items.append(Text(f"  {result.outcome.value}: {result.detail}", style=OUTCOME_STYLE.get(
                result.outcome.value, "")))
        if entry.predicted_trip and not entry.failed:
            items.append(Text(f"  {TRIP_MARK}: {', '.join(entry.predicted_trip)} — storable chunks exceed what "
                              f"the next store pass can pair with blocks", style="bold red"))
        items.append(state_table(entry.requests, ""))
    flush_folded()
    return items


def audit_renderables(report: Any) -> list[Any]:
    items: list[Any] = [audit_table(report)]
    if report.metrics:
        table = Table(title="measured (performance bugs)", box=box.SIMPLE, title_justify="left")
        for column in ("bug", "upstream", "what it costs", "measured"):
            table.add_column(column, overflow="fold")
        for metric in report.metrics:
            table.add_row(metric.bug, "\n".join(metric.refs), metric.title, metric.summary)
        items.append(table)
    return items


def audit_table(report: Any) -> Table:
    table = Table(title=f"known KV-offload bugs on vLLM {report.vllm_version}", box=box.SIMPLE_HEAVY,
                  title_justify="left")
    for column in ("bug", "recipe", "upstream", "what it breaks", "installed logic", "hint"):
        table.add_column(column, overflow="fold")
    for row in report.rows:
        table.add_row(row.bug, row.recipe.name, "\n".join(row.recipe.refs[:2]), row.recipe.title or "",
                      outcome_text(row.installed.outcome.value), row.hint)
    return table
