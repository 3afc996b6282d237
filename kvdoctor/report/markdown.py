"""Markdown attachments for an upstream GitHub issue. Formatting only.

Reports carry no environment-variable values and no home paths: paths are
shown relative to site-packages or with the home directory replaced by `~`.
Two runs of the same command give the same file except for the timestamp.
"""

from __future__ import annotations

import os
import time
from typing import Any

from kvdoctor.report.tables import events_line, release_hint_text, setup_line


def _scrub(text: str) -> str:
    home = os.path.expanduser("~")
    if home and home != "/":
        text = text.replace(home, "~")
    return text


def _env_section() -> list[str]:
    from kvdoctor.app import environment

    env = environment()
    try:
        import torch

        gpu = "yes" if torch.cuda.is_available() else "no"
    except Exception:  # noqa: BLE001 - a report must not fail on a broken torch
        gpu = "unknown"
    lines = ["## Environment", "", "| | |", "|---|---|"]
    for key in ("kvdoctor", "vllm", "torch", "python", "os"):
        lines.append(f"| {key} | {env.get(key) or 'not installed'} |")
    lines.append(f"| GPU present | {gpu} |")
    return lines + [""]


def _state_table(requests: list[Any]) -> list[str]:
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
    return lines + [""]


def _result_rows(report: Any) -> list[str]:
    from kvdoctor.report.tables import why

    lines = ["| logic | outcome | where / why |", "|---|---|---|"]
    for result in report.results:
        lines.append(f"| {result.logic} | **{result.outcome.value}** | {_scrub(why(result)).replace(chr(10), '<br>')} |")
    return lines + [""]


def _failure(result: Any) -> list[str]:
    f = result.failure
    lines = [f"### Failure under the `{result.logic}` logic (step {result.failure_step})", "",
             f"`{f.exception}: {f.message}` at `{f.file}:{f.line}` in `{f.function}()`", "",
             "vLLM frames (outermost first):", "", "```"]
    lines += [f"{fr.file}:{fr.line} {fr.function}: {fr.code}" for fr in f.vllm_frames]
    lines += ["```", "", "Request state when it fired:", ""]
    return lines + _state_table(result.requests)


def _timeline(result: Any) -> list[str]:
    if not result.timeline:
        return []
    lines = ["<details>", f"<summary>Timeline under the {result.logic} logic ({len(result.timeline)} steps)</summary>",
             ""]
    for entry in result.timeline:
        lines.append(f"**step {entry.index}** `{entry.description}` {events_line(entry.events)}")
        if entry.predicted_trip and not entry.failed:
            lines.append(f"> will trip the store assertion next: {', '.join(entry.predicted_trip)}")
        lines.append("")
        lines += _state_table(entry.requests)
    return lines + ["</details>", ""]


def _header(title: str, command_line: str) -> list[str]:
    lines = [f"# {title}", "", f"_Generated {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}_", ""]
    lines += _env_section()
    return lines + ["## Command", "", "```", _scrub(command_line), "```", ""]


def render_markdown(command: str, report: Any) -> str:
    """A repro, inspect or audit report, ready to paste into a GitHub issue."""
    if command == "audit":
        return render_audit_markdown(report)
    recipe = report.recipe
    lines = _header(f"kvdoctor {command}: {recipe.name}" + (f" ({recipe.bug})" if recipe.bug else ""),
                    report.command or f"kvdoctor {command} {recipe.name}")
    lines += ["## Recipe", "", f"**{recipe.title or recipe.name}**", "", recipe.summary, "",
              "Upstream: " + ", ".join(recipe.refs), "", f"Reproduced means: {recipe.signature.describe()}", ""]
    lines += ["## Setup", "", f"`{setup_line(report.setup)}`", ""]
    lines += ["## Outcome", ""] + _result_rows(report)
    if getattr(report, "release_hint", None) is not None:
        lines += [f"_{release_hint_text(report.release_hint)}_", ""]
    for result in report.results:
        if result.failure is not None:
            lines += _failure(result)
        if result.checks:
            lines += [f"Checks under `{result.logic}`:", ""]
            lines += [f"- [{'x' if c.passed else ' '}] {c.description} ({c.observed})" for c in result.checks]
            lines.append("")
    for result in report.results:
        lines += _timeline(result)
    return _scrub("\n".join(lines)) + "\n"


def render_audit_markdown(report: Any) -> str:
    lines = _header(f"kvdoctor audit: known KV-offload bugs on vLLM {report.vllm_version}",
                    report.command or "kvdoctor audit")
    lines += ["## Results", "", "| bug | recipe | upstream | what it breaks | installed logic | hint |",
              "|---|---|---|---|---|---|"]
    for row in report.rows:
        lines.append(f"| {row.bug} | {row.recipe.name} | {', '.join(row.recipe.refs)} | {row.recipe.title or ''} "
                     f"| **{row.installed.outcome.value}** | {_scrub(row.hint or '')}"
                     + (f"<br>{release_hint_text(row.release_hint)}" if row.release_hint else "") + " |")
    lines.append("")
    if report.metrics:
        lines += ["## Measured (performance bugs)", "", "| bug | upstream | what it costs | measured |",
                  "|---|---|---|---|"]
        lines += [f"| {m.bug} | {', '.join(m.refs)} | {m.title} | {m.summary} |" for m in report.metrics]
        lines.append("")
    for row in report.rows:
        result = row.installed
        if result.failure is not None:
            lines += [f"## {row.bug} `{row.recipe.name}`", "", f"Setup: `{setup_line(row.setup)}`", ""]
            lines += _failure(result)
            lines += _timeline(result)
        elif result.violations:
            lines += [f"## {row.bug} `{row.recipe.name}`", ""]
            lines += [f"- invariant `{v.invariant}` violated: {v.message}" for v in result.violations]
            lines.append("")
            lines += _timeline(result)
    return _scrub("\n".join(lines)) + "\n"

