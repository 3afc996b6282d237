"""`kvdoctor version` as plain text: one `name: value` line each, then one line per probe."""

from __future__ import annotations

from typing import Any


def version_text(report: Any) -> str:
    lines = [f"kvdoctor: {report.kvdoctor}",
             f"vLLM: {report.vllm or 'not installed'}",
             f"torch: {report.torch or 'not installed'}",
             f"Python: {report.python}",
             f"platform: {report.platform}"]
    if report.problem:
        lines.append(f"problem: {report.problem}")
    if report.note:
        lines.append(f"note: {report.note}")
    if report.probes:
        held = sum(p.holds for p in report.probes)
        lines.append(f"probes: {held} of {len(report.probes)} hold")
        width = max(len(p.name) for p in report.probes)
        for probe in report.probes:
            mark = "holds" if probe.holds else "FAILS"
            lines.append(f"  {probe.name:<{width}}  {mark}  {probe.answer}")
    return "\n".join(lines)
