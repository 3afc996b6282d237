"""`kvdoctor check`'s result in each format: text (rich), JSON, Markdown. Formatting only."""

from __future__ import annotations

from typing import Any

from kvdoctor import SCHEMA_VERSION, __version__
from kvdoctor.check.app import as_dict, exit_status
from kvdoctor.check.result import CheckResult


def _gib(value: int | None) -> str:
    return "?" if value is None else f"{value / 2**30:.2f} GiB"


def verdict_lines(result: CheckResult) -> list[str]:
    refusal = result.refusal
    if refusal is None:
        return [f"starts: vLLM {result.vllm_version}'s start-up path accepts these flags "
                f"({', '.join(s.name for s in result.stages)})"]
    kind = "would fail at start-up (predicted from vLLM's sizes)" if refusal.predicted else "fails at start-up"
    lines = [f"{kind}, in the {refusal.stage} stage:",
             f"  {refusal.exception}: {refusal.message}",
             f"  at {refusal.site}" if refusal.site else "  (no vLLM frame to name)"]
    if refusal.fix is None:
        lines.append("avoided by: no flag change known to kvdoctor; file the message above upstream")
    else:
        checked = "checked here: it starts" if refusal.fix_checked else "not confirmed: it did not start here either"
        lines.append(f"avoided by: {refusal.fix} ({checked})")
    return lines


def stage_lines(result: CheckResult) -> list[str]:
    lines = [f"  {'ok ' if s.passed else 'NO '} {s.name}: {s.detail}" for s in result.stages]
    if result.region_bytes is not None:
        lines.append(f"  CPU tier: {_gib(result.region_bytes)} per engine, against {_gib(result.host_bytes)} "
                     f"({result.host_source or 'unknown'})")
    return lines + [f"  note: {note}" for note in result.notes]


def bug_lines(result: CheckResult) -> list[str]:
    if result.audit is None:
        return ["not run (--no-audit, or vLLM would not start)"]
    found = result.reproduced_bugs()
    if not found:
        return [f"none of the {len(result.audit.rows)} known bugs reproduces at these flags"]
    return [f"{row.bug} {row.recipe.name}: reproduces here (kvdoctor repro {row.recipe.name} for the detail)"
            for row in found]


SECTIONS = (("Start-up", verdict_lines), ("Stages", stage_lines), ("Known bugs at these flags", bug_lines))


def check_renderables(result: CheckResult) -> list[Any]:
    from rich.text import Text

    out: list[Any] = []
    for title, lines in SECTIONS:
        out.append(Text(title, style="bold underline"))
        out += [Text(line) for line in lines(result)]
        out.append(Text(""))
    return out


def check_markdown(result: CheckResult) -> str:
    lines = [f"# kvdoctor check: {result.verdict}", "", f"vLLM {result.vllm_version} · `{result.command}`", ""]
    for title, body in SECTIONS:
        lines += [f"## {title}", "", "```", *[line.strip() for line in body(result)], "```", ""]
    return "\n".join(lines)


def check_document(result: CheckResult) -> dict[str, Any]:
    return {"schema_version": SCHEMA_VERSION, "kvdoctor_version": __version__, "command": "check",
            "exit_code": int(exit_status(result)), **as_dict(result)}
