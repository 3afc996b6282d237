"""Rich renderables for repro and inspect results. Formatting only, no logic."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rich import box
from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from kvdoctor.report.audit_text import metric_summary, row_hint
from kvdoctor.report.engine_level import level_note, report_engine_phrase
from kvdoctor.report.guards import guard_lines
from kvdoctor.report.layout import Cut, Fit, Items
from kvdoctor.report.next_steps import FIXED_LOGIC, next_steps

OUTCOME_STYLE = {
    "reproduced": "bold red",
    "not_reproduced": "bold green",
    "other_failure": "bold magenta",
    "not_applicable": "dim",
    "setup_error": "bold yellow",
    "not_reached": "yellow",
    "untested": "yellow",
}
TRIP_MARK = "⚠ will trip"


def outcome_text(outcome: str) -> Text:
    return Text(outcome, style=OUTCOME_STYLE.get(outcome, ""))


def verdict_table(report: Any) -> Any:
    """The verdicts: a table where it fits, else one block per logic variant."""
    table = Table(title=f"{report.recipe.name} on vLLM {report.vllm_version}", box=box.SIMPLE_HEAVY,
                  title_justify="left")
    table.add_column("logic", style="bold", no_wrap=True)
    table.add_column("outcome", no_wrap=True)
    table.add_column("where / why")
    for result in report.results:
        table.add_row(result.logic, outcome_text(result.outcome.value), why(result))
    blocks: list[Any] = [Text(""), Text(f"{report.recipe.name} on vLLM {report.vllm_version}", style="italic")]
    for result in report.results:
        blocks.append(Text.assemble((f"{result.logic:<10}", "bold"), " ", outcome_text(result.outcome.value)))
        for line in why_lines(result):
            blocks.append(Items(line.split(" "), prefix="  ", sep=" ", indent=4))
    return Fit(table, Group(*blocks))


def failure_where(result: Any) -> tuple[str, str]:
    """(`Exception in function (step N)`, `path:line`): a path is shown on a line of its own."""
    f = result.failure
    return (f"{f.exception} in {f.function} (step {result.failure_step})", f"at {f.file}:{f.line}")


def why_lines(result: Any) -> list[str]:
    if result.failure is not None:
        return list(failure_where(result))
    parts = []
    if result.detail:
        step = (f"step {result.failure_step}: " if result.failure_step is not None
                and not result.detail.startswith("step ") else "")
        parts.append(step + result.detail)
    coverage = getattr(result, "coverage", None)
    if coverage is not None and not coverage.gone and coverage.reached:
        parts.append("crash site " + coverage.line())
    parts.extend(guard_lines(result))
    passed = [c.description for c in result.checks if c.passed]
    if passed:
        parts.append("checks held: " + "; ".join(passed))
    return parts or ["ran through; no failure"]


def why(result: Any) -> str:
    if result.failure is not None:
        f = result.failure
        return f"{f.exception} at {f.file}:{f.line} in {f.function} (step {result.failure_step})"
    return "\n".join(why_lines(result))


def _message(f: Any) -> tuple[str, ...]:
    """`: message` after an exception's name; nothing where it has none (a bare `assert`), not an empty
    `AssertionError: ` heading."""
    return (": ", f.message) if f.message else ()


def failure_panel(result: Any) -> Any:
    f = result.failure
    lines = [
        Text.assemble(("exception  ", "bold"), (f.exception, "red"), *_message(f)),
        Text.assemble(("where      ", "bold"), f"{f.file}:{f.line} in {f.function}()"),
        Text("vLLM frames (outermost first):", style="bold"),
    ]
    if f.code and f.code != f.message:
        lines.insert(2, Text.assemble(("code       ", "bold"), (f.code, "italic")))
    for frame in f.vllm_frames:
        lines.append(Text(f"  {frame.file}:{frame.line} {frame.function}: {frame.code}"))
    title = f"{result.logic} logic: failure at step {result.failure_step}"
    panel = Panel(Group(*lines), title=title, border_style="red", expand=False)
    block: list[Any] = [Text(title, style="bold red"),
                        Text.assemble("  ", (f.exception, "red"), *_message(f)),
                        Text(f"  in {f.function}() at"), Text(f"  {f.file}:{f.line}"),
                        Text("  vLLM frames (outermost first):", style="bold")]
    for frame in f.vllm_frames:
        block.append(Text(f"  {frame.file}:{frame.line}"))
        block.append(Items(f"{frame.function}: {frame.code}".split(" "), prefix="     ", sep=" ", indent=8,
                           style="dim"))
    return Fit(panel, Group(Text(""), *block))


_STATE_COLUMNS = ("request", "status", "prompt", "computed", "group", "keys", "blocks", "chunks", "next stored",
                  "storable installed", "storable fixed", "in flight", "")


def state_table(requests: Iterable[Any], title: str) -> Any:
    """Each request's chunk/block state: a table where it fits, else one block per request."""
    requests = list(requests)
    table = Table(title=title or None, box=box.SIMPLE, title_justify="left", show_lines=False)
    for column in _STATE_COLUMNS:
        table.add_column(column, justify="right" if column not in ("request", "status", "in flight", "") else "left",
                         no_wrap=True)
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
    return Fit(table, stacked_state(requests, title))


def stacked_state(requests: list[Any], title: str) -> Group:
    """One block per request: its status line, then one line (or more) per KV group."""
    blocks: list[Any] = [Text(""), Text(title, style="italic")] if title else []
    for snap in requests:
        head = [Text(snap.request, style="bold"), Text(snap.status), Text(f"prompt {snap.prompt_tokens}"),
                Text(f"computed {snap.computed_tokens}")]
        if snap.in_flight_jobs:
            head.append(Text("in flight " + ", ".join(snap.in_flight_jobs)))
        if snap.would_trip:
            head.append(Text(TRIP_MARK, style="bold red"))
        if not snap.groups and not snap.connector_state:
            head.append(Text("connector state released", style="dim"))
        blocks.append(Items(head))
        for g in snap.groups:
            installed_style = "bold red" if g.storable_installed > g.allocated_chunks else ""
            blocks.append(Items([
                Text(f"keys {g.offload_keys}"), Text(f"blocks {g.allocated_blocks}"),
                Text(f"chunks {g.allocated_chunks}"), Text(f"next stored {g.next_stored_chunk}"),
                Text.assemble("storable ", (str(g.storable_installed), installed_style),
                              f" (fixed {g.storable_fixed})"),
            ], prefix=Text(f"  group {g.group}:"), indent=12))
    return Group(*blocks)


def checks_table(result: Any, logics: list[str] | None = None) -> Any:
    if not result.checks:
        return None
    names = ", ".join(logics or [result.logic])
    title = f"{names} logic: checks"
    table = Table(title=title, box=box.SIMPLE, title_justify="left")
    table.add_column("check")
    table.add_column("held", no_wrap=True)
    table.add_column("observed")
    blocks: list[Any] = [Text(""), Text(title, style="italic")]
    for check in result.checks:
        held = Text("yes", style="green") if check.passed else Text("NO", style="red")
        table.add_row(check.description, held, check.observed)
        blocks.append(Text.assemble("  ", held, "  ", check.description))
        blocks.append(Items(check.observed.split(" "), prefix="       ", indent=7, sep=" ", style="dim"))
    return Fit(table, Group(*blocks))


def _checks_key(result: Any) -> tuple:
    return tuple((c.description, c.passed, c.observed) for c in result.checks)


def next_steps_renderable(steps: list[tuple[str, str]]) -> Any:
    if not steps:
        return None
    width = max(len(label) for label, _ in steps)
    lines: list[Any] = [Text(""), Text("what to do next", style="bold")]
    for label, text in steps:
        lines.append(Items(text.split(" "), prefix=Text.assemble("  ", (f"{label:<{width}}", "bold"), " "),
                           indent=width + 4, sep=" "))
    return Group(*lines)


def repro_renderables(report: Any) -> list[Any]:
    items: list[Any] = [
        Text.assemble(("recipe ", "bold"), report.recipe.name,
                      f" ({report.recipe.bug})" if report.recipe.bug else "", " — ", report.recipe.title or ""),
        Items(setup_line(report.setup).split(" "), prefix=Text("setup:"), sep=" ", indent=7, style="dim"),
        *[Text(line, style="dim") for line in kv_cache_lines(report.kv_plan)],
        verdict_table(report),
    ]
    if any(r.logic in ("fixed", "unpatched") for r in report.results):
        items.append(Items(FIXED_LOGIC.split(" "), sep=" ", indent=0, style="dim"))
    items += [Items(f"[{r.logic}] impact: {r.answers.line}".split(" "), sep=" ", indent=4)
              for r in report.results if r.answers is not None]
    shown: dict[tuple, str] = {}
    checks_shown: dict[tuple, list[str]] = {}
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
        if result.checks:
            checks_shown.setdefault(_checks_key(result), []).append(result.logic)
    by_key = {_checks_key(r): r for r in report.results if r.checks}
    for key, logics in checks_shown.items():  # identical checks under several variants: one table
        items.append(checks_table(by_key[key], logics))
    decisive = report.decisive
    fixed = next((r for r in report.results if r.logic == "fixed"), None)
    cap = None if fixed is None or decisive.logic == "fixed" else fixed.outcome.value != "reproduced"
    steps = next_steps(report.recipe, decisive.outcome.value, getattr(report, "fixed_in", None), cap,
                       decisive.detail)
    rendered = next_steps_renderable(steps)
    if rendered is not None:
        items.append(rendered)
    return items


def setup_fields(setup: Any) -> list[tuple[str, Any]]:
    """Every setup field that shapes the run, in a stable order (extra connector keys last)."""
    fields = [("block_size", setup.block_size), ("blocks_per_chunk", setup.blocks_per_chunk),
              ("gpu_blocks", setup.gpu_blocks), ("max_model_len", setup.max_model_len),
              ("max_num_batched_tokens", setup.max_num_batched_tokens), ("max_num_seqs", setup.max_num_seqs),
              ("async_scheduling", setup.async_scheduling),
              ("enable_chunked_prefill", setup.enable_chunked_prefill)]
    if hasattr(setup, "enable_prefix_caching"):
        fields.append(("enable_prefix_caching", setup.enable_prefix_caching))
    fields += [("offload_prompt_only", setup.offload_prompt_only), ("cpu_bytes_to_use", setup.cpu_bytes_to_use),
               ("spec_name", setup.spec_name or "CPUOffloadingSpec"),
               ("model", setup.model or "tiny-llama"),  # kvdoctor's own config.json (2 layers, 2 KV heads)
               ("worker", setup.worker_described() if hasattr(setup, "worker_described") else setup.worker)]
    device = setup.device_described() if hasattr(setup, "device_described") else getattr(setup, "device", None)
    runner = getattr(setup, "model_runner", None)
    fields += [(name, value) for name, value in (("device", device), ("model_runner", runner)) if value]
    engine = getattr(setup, "engine", "scheduler")
    if engine != "scheduler":  # the default level stays unnamed (README examples unchanged)
        described = {"core": "core (vLLM's EngineCore)", "serve": "serve (vllm serve)"}
        fields.append(("engine", described.get(engine, engine)))
    if getattr(setup, "speculative_method", None):  # speculative decoding; kvdoctor stands in for the drafter
        fields += [("speculative_method", setup.speculative_method),
                   ("num_speculative_tokens", setup.num_speculative_tokens),
                   ("draft_acceptance", setup.draft_acceptance or "all")]
    for key, value in sorted((getattr(setup, "extra_connector_config", None) or {}).items()):
        fields.append((f"kv_connector_extra_config.{key}", value))
    derived = getattr(setup, "derived", ())  # sizes kvdoctor derived for the trigger (the user gave none)
    if derived:
        fields.append(("derived", "; ".join(derived)))
    groups = getattr(setup, "kv_groups", None)  # set by recipes with several KV cache groups
    if groups:
        fields.append(("kv_groups", groups))
    return fields


def setup_line(setup: Any) -> str:
    return " ".join(f"{key}={value}" for key, value in setup_fields(setup))


def kv_cache_lines(plan: Any) -> list[str]:
    """The KV cache groups of a run, one line each, then what kvdoctor had to say about them."""
    if plan is None:
        return []
    lines = [f"kv cache: {plan.layout.source}, {len(plan.groups)} group(s) planned by vLLM's {plan.planner}"]
    lines += [f"  {group.describe()}" for group in plan.groups]
    lines += [f"  note: {note}" for note in plan.notes]
    return lines


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
    for finding in getattr(events, "content_findings", ()):
        parts.append(f"{finding.invariant}: {finding.message}")
    return "; ".join(parts) or "nothing scheduled"


def timeline_renderables(result: Any, only_step: int | None = None) -> list[Any]:
    """One block per step; consecutive steps that changed nothing fold into one line."""
    items: list[Any] = [Text(f"timeline under the {result.logic} logic", style="bold underline")]
    items += [Text(line, style="dim") for line in kv_cache_lines(result.kv_plan)]
    if getattr(result, "worker", ""):
        items.append(Text(f"worker: {result.worker}", style="dim"))
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
            items.append(Items(f"{TRIP_MARK}: {', '.join(entry.predicted_trip)} — storable chunks exceed what "
                               f"the next store pass can pair with blocks".split(" "), prefix="  ", sep=" ",
                               indent=4, style="bold red"))
        items.append(state_table(entry.requests, ""))
    flush_folded()
    return items


def audit_renderables(report: Any, verbose: bool = False) -> list[Any]:
    """The compact audit (one line per recipe, then a one-line summary); `verbose`: every row's
    refs, what it breaks and what to do next, as before."""
    return audit_detail_renderables(report) if verbose else audit_compact_renderables(report)


_INCONCLUSIVE = ("other_failure", "setup_error", "not_reached", "untested")


def audit_summary(report: Any) -> str:
    """`3 of 11 known bugs reproduce on vLLM 0.26.0; upgrade to 0.30.0 fixes all but K9, K11`."""
    bugs = list(dict.fromkeys(row.bug for row in report.rows if row.bug and row.bug != "-"))
    reproducing = list(report.reproducing)
    where = f"vLLM {report.vllm_version}{report_engine_phrase(report)}"
    if reproducing:
        text = (f"{len(reproducing)} of {len(bugs)} known bugs reproduce on {where}"
                if len(reproducing) > 1 or len(bugs) > 1 else f"the known bug reproduces on {where}")
    else:
        text = f"none of the {len(bugs)} known bugs reproduces on {where}"
    hint = report.upgrade_hint if reproducing else None
    if hint is not None:
        left = hint.still_reproducing
        text += f"; upgrading to {hint.release} fixes " + ("all" if not left else "all but " + ", ".join(left))
    text += level_note(report)  # --engine core|serve: the recipes that level cannot play
    # a bug another of its recipes reproduced has its verdict; only one without any is "no verdict"
    unsure = list(dict.fromkeys(f"{row.bug} {row.installed.outcome.value}" for row in report.rows
                                if row.installed.outcome.value in _INCONCLUSIVE and row.bug not in reproducing))
    if unsure:
        text += "; no verdict: " + ", ".join(unsure)
    return text


def _metric_line(metric: Any) -> str:
    m = metric.value
    if metric.error or m is None:
        return metric_summary(metric)
    return (f"measured: {m.extra_steps:+d} steps to first token when {m.requests} requests share a prefix "
            f"({m.shared_steps} vs {m.baseline_steps})")


def audit_compact_renderables(report: Any) -> list[Any]:
    """One line per recipe (bug, recipe, outcome, first release measured not to reproduce it)."""
    name_width = max([len(row.recipe.name) for row in report.rows] + [len("recipe")])
    bug_width = max([len(row.bug) for row in report.rows] + [len(m.bug) for m in report.metrics] + [3])
    outcome_width = max([len(row.installed.outcome.value) for row in report.rows] + [len("outcome")])
    items: list[Any] = [
        Text(f"known KV-offload bugs on vLLM {report.vllm_version}{report_engine_phrase(report)}", style="bold"),
        Text(f"  {'bug':<{bug_width}}  {'recipe':<{name_width}}  {'outcome':<{outcome_width}}  fixed in",
             style="dim")]
    for row in report.rows:
        outcome = row.installed.outcome.value
        hint = getattr(row, "fixed_in", None)
        fixed_in = hint.release if hint is not None and outcome == "reproduced" else ""
        items.append(Text.assemble(f"  {row.bug:<{bug_width}}  {row.recipe.name:<{name_width}}  ",
                                   outcome_text(outcome), " " * (outcome_width - len(outcome) + 2), fixed_in))
    for metric in report.metrics:
        items.append(Cut(f"  {metric.bug:<{bug_width}}  ", _metric_line(metric)))
    items.append(Text(""))
    items.append(Items(audit_summary(report).split(" "), sep=" ", indent=2, style="bold"))
    notes = ["fixed in: the first release kvdoctor measured not reproducing it (a hint)",
             "each row in full: kvdoctor audit --verbose"
             + ("; to attach: --report audit.md" if report.any_reproduced else "")]
    items.extend(Items(note.split(" "), sep=" ", indent=2, style="dim") for note in notes)
    return items


def audit_detail_renderables(report: Any) -> list[Any]:
    items: list[Any] = [audit_table(report)]
    if report.metrics:
        table = Table(title="measured (performance bugs)", box=box.SIMPLE, title_justify="left")
        for column in ("bug", "upstream", "what it costs", "measured"):
            table.add_column(column, no_wrap=column == "bug")
        blocks: list[Any] = [Text("measured (performance bugs)", style="italic")]
        for metric in report.metrics:
            table.add_row(metric.bug, "\n".join(metric.refs), metric.title, metric_summary(metric))
            blocks.append(Text.assemble((f"{metric.bug:<4}", "bold"), ", ".join(metric.refs)))
            blocks.append(Items(metric.title.split(" "), prefix="    ", sep=" ", indent=4))
            blocks.append(Items(metric_summary(metric).split(" "), prefix="    measured:", sep=" ", indent=6))
        items.append(Fit(table, Group(*blocks)))
    items.append(Items(audit_summary(report).split(" "), sep=" ", indent=2, style="bold"))
    if any(row.installed.outcome.value == "reproduced" for row in report.rows):
        items.append(Text("report one: kvdoctor repro RECIPE --report issue.md (or this table: "
                          "kvdoctor audit --report audit.md)", style="dim"))
    return items


def audit_table(report: Any) -> Any:
    title = f"known KV-offload bugs on vLLM {report.vllm_version}{report_engine_phrase(report)}"
    table = Table(title=title, box=box.SIMPLE_HEAVY, title_justify="left", caption=FIXED_LOGIC,
                  caption_justify="left")
    for column in ("bug", "recipe", "upstream", "what it breaks", "installed logic", "what to do next"):
        table.add_column(column, no_wrap=column in ("bug", "recipe", "installed logic"))
    blocks: list[Any] = [Text(title, style="italic")]
    for row in report.rows:
        steps = row_next_steps(row)
        table.add_row(row.bug, row.recipe.name, "\n".join(row.recipe.refs[:2]), row.recipe.title or "",
                      outcome_text(row.installed.outcome.value),
                      "\n".join(f"{label}: {text}" for label, text in steps) or row_hint(row))
        blocks.append(Text.assemble((f"{row.bug:<4}", "bold"), row.recipe.name, "  ",
                                    outcome_text(row.installed.outcome.value)))
        if row.recipe.title:
            blocks.append(Items(row.recipe.title.split(" "), prefix="    ", sep=" ", indent=4))
        for label, text in steps or [("", row_hint(row))]:
            if text:
                blocks.append(Items(text.split(" "), prefix=Text.assemble("    ", (f"{label}:" if label else "",
                                                                                  "bold")),
                                    sep=" ", indent=6, style="" if label else "dim"))
        blocks.append(Text(""))
    blocks.append(Items(FIXED_LOGIC.split(" "), sep=" ", indent=0, style="dim"))
    return Fit(table, Group(*blocks))


def row_next_steps(row: Any) -> list[tuple[str, str]]:
    outcome = row.installed.outcome.value
    cap = row.fixed.outcome.value != "reproduced" if row.fixed is not None else None
    steps = next_steps(row.recipe, outcome, getattr(row, "fixed_in", None), cap, row.installed.detail)
    if outcome == "reproduced":  # one "report one" line under the table instead of one per row
        steps = [(label, text) for label, text in steps if label != "report it"]
    fallback = getattr(getattr(row, "setup", None), "worker_fallback", None)
    if fallback:  # vLLM's worker was asked for, this recipe ran with the simulated one: say so in the row
        if not steps and row_hint(row):
            steps = [("note", row_hint(row))]
        steps = [*steps, ("worker", f"{row.setup.worker} ({fallback})")]
    device_fallback = getattr(getattr(row, "setup", None), "device_fallback", None)
    if device_fallback:  # a GPU was there or asked for, this recipe kept its KV on the CPU: say so too
        steps = [*steps, ("device", row.setup.device_described())]
    return steps


def recipe_list_renderables(recipes: list[Any], verbose: bool = False) -> list[Any]:
    """`repro --list`: one line per recipe (name whole, bug, summary cut to fit); `verbose` adds
    each recipe's signature and upstream refs under its line."""
    width = max((len(r.name) for r in recipes), default=4)
    bug_width = max((len(r.bug or "-") for r in recipes), default=1)
    items: list[Any] = [Text(f"built-in recipes ({len(recipes)}); one in full: kvdoctor repro --list NAME",
                             style="bold")]
    for recipe in recipes:
        head = Text.assemble(f"  {recipe.name:<{width}}  ", (f"{recipe.bug or '-':<{bug_width}}", "bold"), "  ")
        items.append(Cut(head, recipe.title or recipe.summary.splitlines()[0]))
        if verbose:
            items.extend(_recipe_detail_lines(recipe, indent=4))
    return items


def _recipe_detail_lines(recipe: Any, indent: int) -> list[Any]:
    pad = " " * indent
    lines: list[Any] = [Items(f"signature: {recipe.signature.describe()}".split(" "), prefix=pad, sep=" ",
                              indent=indent + 2, style="dim")]
    for ref in recipe.refs:
        lines.append(Items(ref.split(" "), prefix=pad, sep=" ", indent=indent + 2, style="dim"))
    return lines


def recipe_detail_renderables(recipe: Any) -> list[Any]:
    """`repro --list NAME`: one recipe in full (what it reproduces, signature, refs, workaround)."""
    items: list[Any] = [Text.assemble((recipe.name, "bold"), f" ({recipe.bug})" if recipe.bug else "")]
    if recipe.title:
        items.append(Items(recipe.title.split(" "), prefix="  ", sep=" ", indent=2))
    for paragraph in recipe.summary.split("\n\n"):
        if paragraph.strip() and paragraph.strip() != (recipe.title or "").strip():
            items.append(Text(""))
            items.append(Items(paragraph.split(), prefix="  ", sep=" ", indent=2))
    items.append(Text(""))
    fields = [("signature", recipe.signature.describe())] + [("upstream", ref) for ref in recipe.refs]
    if recipe.workaround:
        fields.append(("workaround", recipe.workaround))
    for label, text in fields:
        items.append(Items(text.split(), prefix=Text(f"  {label:<11}", style="bold"), sep=" ", indent=13))
    items.append(Text(""))
    items.append(Text(f"  run it: kvdoctor repro {recipe.name}", style="dim"))
    return items
