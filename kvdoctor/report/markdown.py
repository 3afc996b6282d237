"""Markdown attachments for an upstream GitHub issue. Formatting only.

Reports carry no environment-variable values and no home paths: paths are
shown relative to site-packages or with the home directory replaced by `~`.
Two runs of the same command give the same file except for the timestamp.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

from kvdoctor.installed import environment
from kvdoctor.recipes.writer import recipe_to_toml
from kvdoctor.report.audit_text import metric_summary, row_hint
from kvdoctor.report.engine_level import report_engine_phrase
from kvdoctor.report.next_steps import FIXED_LOGIC, github_refs, next_steps
from kvdoctor.report.tables import events_line, kv_cache_lines, row_next_steps, setup_fields, why_lines

if TYPE_CHECKING:  # the types only: this module formats what the CLI hands it
    from kvdoctor.engine.setup import Setup
    from kvdoctor.explore.triage import Triage
    from kvdoctor.observe.snapshot import RequestSnapshot
    from kvdoctor.results import AuditReport, ReproReport, RunResult


def _scrub(text: str) -> str:
    home = os.path.expanduser("~")
    if home and home != "/":
        text = text.replace(home, "~")
    return text


def _env_section() -> list[str]:
    env = environment()
    try:
        import torch

        gpu = "yes" if torch.cuda.is_available() else "no"
    except Exception:  # a report must not fail on a broken torch
        gpu = "unknown"
    lines = ["## Environment", "", "| | |", "|---|---|"]
    for key in ("kvdoctor", "vllm", "torch", "python", "os"):
        lines.append(f"| {key} | {env.get(key) or 'not installed'} |")
    lines.append(f"| GPU present | {gpu} |")
    return [*lines, ""]


def _state_table(requests: list[RequestSnapshot]) -> list[str]:
    lines = ["| request | status | prompt | computed | group | keys | blocks | chunks | next stored | "
             "storable (installed) | storable (fixed) | in flight | |",
             "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|---|"]
    for snap in requests:
        if not snap.groups:
            note = "" if snap.connector_state else "connector state released"
            lines.append(f"| {snap.request} | {snap.status} | {snap.prompt_tokens} | {snap.computed_tokens} "
                         f"| - | - | - | - | - | - | - | - | {note} |")
        for g in snap.groups:
            lines.append(
                f"| {snap.request} | {snap.status} | {snap.prompt_tokens} | {snap.computed_tokens} | {g.group} "
                f"| {g.offload_keys} | {g.allocated_blocks} | {g.allocated_chunks} | {g.next_stored_chunk} "
                f"| {g.storable_installed} | {g.storable_fixed} | {', '.join(snap.in_flight_jobs) or '-'} "
                f"| {'**will trip**' if g.would_trip else ''} |")
    return [*lines, ""]


def _result_rows(report: ReproReport) -> list[str]:
    lines = ["| logic | outcome | where / why |", "|---|---|---|"]
    for result in report.results:
        lines.append(f"| {result.logic} | **{result.outcome.value}** | "
                     f"{_scrub('<br>'.join(_cell(line) for line in why_lines(result)))} |")
    lines.append("")
    if any(r.logic in ("fixed", "unpatched") for r in report.results):
        lines += [f"_{FIXED_LOGIC}._", ""]
    impacts = [f"- Impact ({r.logic} logic): {_scrub(r.answers.line)}" for r in report.results
               if r.answers is not None]
    return lines + ([*impacts, ""] if impacts else [])


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _setup_section(setup: Setup) -> list[str]:
    lines = ["## Setup", "", "Every setting that shaped the run:", "", "| setting | value |", "|---|---|"]
    lines += [f"| `{key}` | `{value}` |" for key, value in setup_fields(setup)]
    return [*lines, ""]


def _next_steps_section(steps: list[tuple[str, str]]) -> list[str]:
    if not steps:
        return []
    lines = ["## What to do next", ""]
    lines += [f"- **{label}**: {github_refs(text)}" for label, text in steps
              if label != "report it"]  # this file is the report
    return [*lines, ""]


def _reproduce_section(report: ReproReport, command_line: str) -> list[str]:
    recipe = report.recipe
    lines = ["## Recipe (TOML)", "", "```toml", recipe_to_toml(recipe).rstrip(), "```", ""]
    file_name = f"{recipe.name}.toml"
    lines += ["## Reproduce", "", "On a CPU, no GPU and no download needed:", "", "```bash",
              f'pip install "vllm=={report.vllm_version}"   # and kvdoctor: `pip install .` in its checkout',
              f"{_scrub(command_line)}" + ("" if recipe.builtin else
                                          f"   # with the recipe above saved as {file_name}"),
              "```", ""]
    if not recipe.signature.invariant:
        lines += ["Or, with vLLM's own APIs only (no kvdoctor needed to run it):", "", "```bash",
                  f"kvdoctor repro {recipe.name if recipe.builtin else file_name} --export-script repro.py "
                  f"&& python repro.py", "```", ""]
    return lines


def _failure(result: RunResult) -> list[str]:
    """The run's failure section (nothing for a run that did not fail)."""
    f = result.failure
    if f is None:
        return []
    lines = [f"### Failure under the `{result.logic}` logic (step {result.failure_step})", "",
             f"`{f.exception}{': ' + f.message if f.message else ''}` at `{f.file}:{f.line}` in `{f.function}()`", "",
             "vLLM frames (outermost first):", "", "```"]
    lines += [f"{fr.file}:{fr.line} {fr.function}: {fr.code}" for fr in f.vllm_frames]
    lines += ["```", "", "Request state when it fired:", ""]
    return lines + _state_table(result.requests)


def _timeline(result: RunResult) -> list[str]:
    if not result.timeline:
        return []
    lines = ["<details>", f"<summary>Timeline under the {result.logic} logic ({len(result.timeline)} steps)</summary>",
             ""]
    if getattr(result, "worker", ""):
        lines += [f"Worker: {result.worker}", ""]
    for entry in result.timeline:
        lines.append(f"**step {entry.index}** `{entry.description}` {events_line(entry.events)}")
        if entry.predicted_trip and not entry.failed:
            lines.append(f"> will trip the store assertion next: {', '.join(entry.predicted_trip)}")
        lines.append("")
        lines += _state_table(entry.requests)
    return [*lines, "</details>", ""]


def _header(title: str, command_line: str) -> list[str]:
    lines = [f"# {title}", "", f"_Generated {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}_", ""]
    lines += _env_section()
    return [*lines, "## Command", "", "```", _scrub(command_line), "```", ""]


def render_markdown(command: str, report: ReproReport | AuditReport) -> str:
    """A repro, inspect or audit report, ready to paste into a GitHub issue."""
    from kvdoctor.results import AuditReport

    if isinstance(report, AuditReport):
        return render_audit_markdown(report)
    recipe = report.recipe
    command_line = report.command or f"kvdoctor {command} {recipe.name}"
    lines = _header(f"kvdoctor {command}: {recipe.name}" + (f" ({recipe.bug})" if recipe.bug else ""),
                    command_line)
    lines += ["## Recipe", "", f"**{recipe.title or recipe.name}**", "", recipe.summary, ""]
    if recipe.refs:
        lines += ["Upstream: " + github_refs(", ".join(recipe.refs)), ""]
    lines += [f"Reproduced means: {recipe.signature.describe()}", ""]
    lines += _setup_section(report.setup)
    lines += [f"- {line.strip()}" for line in kv_cache_lines(report.kv_plan)] + ([""] if report.kv_plan else [])
    lines += ["## Outcome", "", *_result_rows(report)]
    checks_seen: dict[tuple, list[str]] = {}
    for result in report.results:
        if result.failure is not None:
            lines += _failure(result)
        if result.checks:
            checks_seen.setdefault(tuple((c.description, c.passed, c.observed) for c in result.checks),
                                   []).append(result.logic)
    for key, logics in checks_seen.items():  # identical checks under several variants: listed once
        lines += [f"Checks under {', '.join(f'`{logic}`' for logic in logics)}:", ""]
        lines += [f"- [{'x' if passed else ' '}] {description} ({observed})" for description, passed, observed in key]
        lines.append("")
    decisive = report.decisive
    fixed = next((r for r in report.results if r.logic == "fixed"), None)
    cap = None if fixed is None or decisive.logic == "fixed" else fixed.outcome.value != "reproduced"
    lines += _next_steps_section(next_steps(recipe, decisive.outcome.value, report.fixed_in,
                                            cap, decisive.detail))
    lines += _reproduce_section(report, command_line)
    for result in report.results:
        lines += _timeline(result)
    if report.server_log:  # --engine serve: the server's own log, its last lines
        tail = report.server_log.splitlines()[-200:]
        lines += ["## Server log (`vllm serve`, last lines)", "", "<details><summary>server.log</summary>", "",
                  "```", *tail, "```", "", "</details>", ""]
    return _scrub("\n".join(lines)) + "\n"


def render_audit_markdown(report: AuditReport) -> str:
    lines = _header(f"kvdoctor audit: known KV-offload bugs on vLLM {report.vllm_version}"
                    f"{report_engine_phrase(report)}",
                    report.command or "kvdoctor audit")
    lines += ["## Results", "", "| bug | recipe | upstream | what it breaks | installed logic | what to do next |",
              "|---|---|---|---|---|---|"]
    for row in report.rows:
        steps = row_next_steps(row)
        todo = ("<br>".join(f"{label}: {_cell(github_refs(text))}" for label, text in steps)
                or _cell(row_hint(row) or ""))
        lines.append(f"| {row.bug} | {row.recipe.name} | {github_refs(', '.join(row.recipe.refs))} "
                     f"| {row.recipe.title or ''} | **{row.installed.outcome.value}** | {_scrub(todo)} |")
    lines += ["", f"_{FIXED_LOGIC}._", ""]
    if report.any_reproduced:
        lines += ["To report one upstream: `kvdoctor repro RECIPE --report issue.md` (this report's "
                  "details for that recipe, its TOML and how to reproduce it).", ""]
    if report.metrics:
        lines += ["## Measured (performance bugs)", "", "| bug | upstream | what it costs | measured |",
                  "|---|---|---|---|"]
        lines += [f"| {m.bug} | {github_refs(', '.join(m.refs))} | {m.title} | {metric_summary(m)} |"
                  for m in report.metrics]
        lines.append("")
    for row in report.rows:
        result = row.installed
        if result.failure is not None:
            lines += [f"## {row.bug} `{row.recipe.name}`", "", *_setup_section(row.setup)[2:]]
            plan_lines = kv_cache_lines(row.installed.kv_plan)
            lines += [f"- {line.strip()}" for line in plan_lines] + ([""] if plan_lines else [])
            lines += _failure(result)
            lines += _timeline(result)
        elif result.violations:
            lines += [f"## {row.bug} `{row.recipe.name}`", ""]
            lines += [f"- invariant `{v.invariant}` violated: {v.message}" for v in result.violations]
            lines.append("")
            lines += _timeline(result)
    return _scrub("\n".join(lines)) + "\n"


def triage_markdown(result: Triage) -> str:
    """A finding's triage (`kvdoctor.explore.triage.Triage`) as the attachment's last section."""
    lines = ["## Triage (kvdoctor explore)", "", f"Verdict: **{result.verdict}**", "",
             f"- Without the offloading connector (`offloading = false`): {result.without_connector}"
             + (f" ({result.without_connector_detail})" if result.without_connector_detail else ""),
             f"- Through vLLM's EngineCore (`--engine core`): {result.engine_core_label}"]
    if result.impact:
        lines.append(f"- Impact: {result.impact}")
    lines += [f"- Diagnosis: {note}" for note in result.diagnosis]
    lines += [f"- Reachable: {note}" for note in result.reachable_notes]
    lines += [f"- Harness: {reason}" for reason in result.harness_reasons]
    lines += [f"- Caveat: {note}" for note in result.caveats]
    return "\n".join(lines) + "\n"
