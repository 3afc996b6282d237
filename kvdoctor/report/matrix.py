"""`kvdoctor matrix` output: the release x recipe table (rich), its JSON document and its
Markdown attachment. Formatting only."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from kvdoctor.report.engine_level import report_engine_phrase
from kvdoctor.report.json_doc import SCHEMA_VERSION

if TYPE_CHECKING:  # the types only
    from kvdoctor.matrix.app import MatrixReport
    from kvdoctor.matrix.bisect import Bisection
    from kvdoctor.matrix.runner import Cell


def _cell_text(cell: Cell | None) -> str:
    if cell is None:
        return "-"  # not tested (bisect skipped it)
    if cell.outcome == "reproduced" and cell.failure_site:
        return f"reproduced: {cell.failure_site}"
    if cell.outcome == "not_applicable" and cell.unplayable:
        return f"not_applicable at this engine level (not tested): {cell.detail}" if cell.detail else \
            "not_applicable at this engine level (not tested)"
    if cell.outcome in ("not_reproduced", "not_applicable", "reproduced"):
        return cell.outcome
    return f"{cell.outcome}: {cell.detail}" if cell.detail else cell.outcome


def _bisect_line(b: Bisection) -> str:
    tested = ", ".join(f"{r} {o}" for r, o in b.tested.items())
    if b.inconclusive:
        return f"{b.recipe}: no answer, vLLM {b.inconclusive} gave {b.tested.get(b.inconclusive)} (tested: {tested})"
    if b.first_not_reproducing and b.last_reproducing:
        return (f"{b.recipe}: stops reproducing in vLLM {b.first_not_reproducing} "
                f"(last reproducing: {b.last_reproducing}; tested: {tested})")
    if b.first_not_reproducing:
        return (f"{b.recipe}: does not reproduce from the first release asked, {b.first_not_reproducing} "
                f"(tested: {tested})")
    if b.last_reproducing:
        return f"{b.recipe}: still reproduces on the last release asked, {b.last_reproducing} (tested: {tested})"
    return f"{b.recipe}: nothing tested"


def matrix_renderables(report: MatrixReport) -> list[Any]:
    from rich import box
    from rich.table import Table
    from rich.text import Text

    from kvdoctor.report.tables import OUTCOME_STYLE

    title = "kvdoctor matrix: " + ("every built-in recipe" if report.audit else ", ".join(report.recipes)) \
            + " under the installed logic" + report_engine_phrase(report)
    table = Table(title=title, box=box.SIMPLE_HEAVY, title_justify="left")
    table.add_column("vLLM", style="bold")
    recipes = report.recipes
    for name in recipes:
        table.add_column(name, overflow="fold")
    for release in (report.tested_releases if report.bisect else report.releases):
        row = []
        for name in recipes:
            cell = report.cell(release, name)
            row.append(Text(_cell_text(cell), style=OUTCOME_STYLE.get(cell.outcome, "") if cell else "dim"))
        table.add_row(release, *row)
    items: list[Any] = [table]
    for b in report.bisections:
        items.append(Text(_bisect_line(b)))
    return items


def matrix_document(report: MatrixReport) -> dict[str, Any]:
    return {
        "schema_version": SCHEMA_VERSION,
        "kvdoctor_version": report.kvdoctor_version,
        "command": report.command,
        "engine": report.engine,  # the level every cell ran at
        "releases": report.releases,
        "recipes": report.recipes,
        "environments": report.environments,
        "exit_status": int(report.exit_status),
        "cells": [cell.as_dict() for cell in (report.cell(r, n) for r in report.releases for n in report.recipes)
                  if cell is not None],
        "bisections": [
            {"recipe": b.recipe, "first_not_reproducing": b.first_not_reproducing,
             "last_reproducing": b.last_reproducing, "inconclusive": b.inconclusive,
             "tested": [{"release": r, "outcome": o} for r, o in b.tested.items()]}
            for b in report.bisections
        ],
    }


def matrix_markdown(report: MatrixReport) -> str:
    lines = [f"# kvdoctor matrix: {', '.join(report.recipes) if not report.audit else 'audit'}", "",
             f"_Generated {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())} by kvdoctor "
             f"{report.kvdoctor_version}_", "", "## Command", "", "```", report.command or "kvdoctor matrix", "```", "",
             f"## Outcome under the installed logic{report_engine_phrase(report)}", "",
             "| vLLM | " + " | ".join(report.recipes) + " |", "|---|" + "---|" * len(report.recipes)]
    for release in (report.tested_releases if report.bisect else report.releases):
        cells = [_cell_text(report.cell(release, n)).replace("|", "\\|") for n in report.recipes]
        lines.append(f"| {release} | " + " | ".join(cells) + " |")
    lines.append("")
    if report.bisections:
        lines += ["## Bisection", ""] + [f"- {_bisect_line(b)}" for b in report.bisections] + [""]
    from kvdoctor.report.markdown import _scrub

    return _scrub("\n".join(lines)) + "\n"
