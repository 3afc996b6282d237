"""`kvdoctor version` in every format: as plain text, one `name: value` line each, then one line per
probe, each wrapped at the terminal's width with its continuation under its value (probe answers ran
to 102 columns at 80); as Markdown, a table a bug report takes; as JSON, the report's own document."""

from __future__ import annotations

import textwrap
from typing import Any

from kvdoctor.report.formats import Shown
from kvdoctor.report.json_doc import SCHEMA_VERSION


def _wrapped(line: str, indent: int, width: int) -> list[str]:
    """`line` cut at spaces to `width`, continuations indented by `indent`; a word longer than a line
    (a path) is kept whole rather than broken."""
    if len(line) <= width:
        return [line]
    return textwrap.wrap(line, width=width, subsequent_indent=" " * indent, break_long_words=False,
                         break_on_hyphens=False) or [line]


def version_text(report: Any, width: int = 80) -> str:
    lines = [f"kvdoctor: {report.kvdoctor}",
             f"vLLM: {report.vllm or 'not installed'}",
             f"torch: {report.torch or 'not installed'}",
             f"Python: {report.python}",
             f"platform: {report.platform}"]
    if report.problem:
        lines.append(f"problem: {report.problem}")
    if report.note:
        lines.append(f"note: {report.note}")
    out = [wrapped for line in lines for wrapped in _wrapped(line, line.index(":") + 2, width)]
    if report.probes:
        held = sum(p.holds for p in report.probes)
        out.append(f"probes: {held} of {len(report.probes)} hold")
        names = max(len(p.name) for p in report.probes)
        for probe in report.probes:
            mark = "holds" if probe.holds else "FAILS"
            line = f"  {probe.name:<{names}}  {mark}  {probe.answer}"
            answer_at = min(2 + names + 2 + len(mark) + 2, width // 2)  # a hanging indent that leaves room
            out += _wrapped(line, answer_at, width)
    return "\n".join(out)


def version_markdown(report: Any) -> str:
    """The versions as a list and the probes as a table (what `vllm collect-env` would be in an issue)."""
    def cell(text: str) -> str:
        return str(text).replace("|", "\\|").replace("\n", "<br>")

    lines = [f"- kvdoctor: {report.kvdoctor}", f"- vLLM: {report.vllm or 'not installed'}",
             f"- torch: {report.torch or 'not installed'}", f"- Python: {report.python}",
             f"- platform: {report.platform}"]
    lines += [f"- {label}: {cell(value)}" for label, value in (("problem", report.problem), ("note", report.note))
              if value]
    if report.probes:
        lines += ["", f"kvdoctor's probes: {sum(p.holds for p in report.probes)} of {len(report.probes)} hold", "",
                  "| probe | holds | answer |", "|---|---|---|"]
        lines += [f"| {p.name} | {'yes' if p.holds else '**no**'} | {cell(p.answer)} |" for p in report.probes]
    return "\n".join(lines) + "\n"


def version_shown(report: Any, width: int = 80) -> Shown:
    """`kvdoctor version` in every `--format`."""
    def renderables() -> list[Any]:
        from rich.text import Text

        return [Text(version_text(report, width), no_wrap=True)]

    return Shown(renderables=renderables, document=lambda: {"schema_version": SCHEMA_VERSION, **report.as_dict()},
                 markdown=lambda: version_markdown(report))
