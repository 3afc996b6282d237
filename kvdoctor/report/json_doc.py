"""JSON documents for `--json` (stable keys, `schema_version`). Formatting only."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from kvdoctor import SCHEMA_VERSION, __version__
from kvdoctor.report.audit_text import metric_summary, row_hint
from kvdoctor.report.guards import guard_lines

if TYPE_CHECKING:  # the types only: this module formats what the CLI hands it
    from kvdoctor.engine.kv_layout import KvPlan
    from kvdoctor.engine.setup import Setup
    from kvdoctor.matrix.known import FixedIn
    from kvdoctor.recipes.model import Recipe
    from kvdoctor.results import AuditReport, ReproReport, RunResult

__all__ = ["SCHEMA_VERSION", "audit_document", "dumps", "recipe_dict", "repro_document"]


def recipe_dict(recipe: Recipe) -> dict[str, Any]:
    return {
        "name": recipe.name, "bug": recipe.bug, "title": recipe.title, "summary": recipe.summary,
        "refs": list(recipe.refs), "signature": recipe.signature.describe(),
        "builtin": recipe.builtin, "requires": list(recipe.requires), "invariants": list(recipe.invariants),
        "workaround": recipe.workaround,
    }


def result_dict(result: RunResult, with_timeline: bool = False) -> dict[str, Any]:
    data = {
        "logic": result.logic,
        "outcome": result.outcome.value,
        # the run's own outcome where a measured reason the flags break was judged (None: none was)
        "played_outcome": _played(result),
        # not_applicable only because this engine level cannot play a step or the setup (exit 6)
        "unplayable": bool(getattr(result, "unplayable", False)),
        "detail": result.detail or None,
        "failure": result.failure.as_dict() if result.failure else None,
        "failure_step": result.failure_step,
        "requests": [r.as_dict() for r in result.requests],
        "checks": [c.__dict__ for c in result.checks],
        "guards": guard_lines(result),
        "violations": [v.__dict__ for v in result.violations],
        "worker": result.worker or None,
        "model_runner": result.model_runner or None,
        "coverage": result.coverage.as_dict() if result.coverage is not None else None,
        # a silent bug as its clients see it: each request's completion against the run's own reference
        "answers": result.answers.as_dict() if result.answers is not None else None,
    }
    if with_timeline:
        data["timeline"] = [entry.as_dict() for entry in result.timeline]
    return data


def _played(result: RunResult) -> str | None:
    return result.played_outcome.value if result.played_outcome is not None else None


def repro_document(report: ReproReport, with_timeline: bool = False) -> dict[str, Any]:
    return {
        "schema_version": SCHEMA_VERSION,
        "kvdoctor_version": __version__,
        "vllm_version": report.vllm_version,
        "recipe": recipe_dict(report.recipe),
        "setup": setup_dict(report.setup, report.kv_plan),
        "results": [result_dict(r, with_timeline) for r in report.results],
        "fixed_in": fixed_in_dict(report.fixed_in),
    }


def setup_dict(setup: Setup, kv_plan: KvPlan | None) -> dict[str, Any]:
    """The setup as given, plus the KV cache groups vLLM's planner built from it (None: nothing ran)."""
    return {**setup.as_dict(), "kv_cache": kv_plan.as_dict() if kv_plan is not None else None}


def fixed_in_dict(hint: FixedIn | None) -> dict[str, Any] | None:
    """kvdoctor's measurement on other releases (a hint; the verdict is `results`)."""
    if hint is None:
        return None
    return {"first_not_reproducing": hint.release, "last_reproducing": hint.last_reproducing,
            "measured_on": hint.measured_on, "kvdoctor_version": hint.kvdoctor_version}


def dumps(document: dict[str, Any]) -> str:
    return json.dumps(document, indent=2, sort_keys=False, default=str)


def audit_document(report: AuditReport) -> dict[str, Any]:
    from kvdoctor.report.tables import audit_summary  # the compact audit's one-line summary

    return {
        "schema_version": SCHEMA_VERSION,
        "kvdoctor_version": __version__,
        "vllm_version": report.vllm_version,
        "engine": report.engine,  # the level every row ran at (rows: setup.engine)
        "any_reproduced": report.any_reproduced,
        "exit_code": int(report.exit_status),
        "summary": audit_summary(report),
        "rows": [
            {
                "bug": row.bug, "recipe": row.recipe.name, "refs": list(row.recipe.refs),
                "title": row.recipe.title, "outcome": row.installed.outcome.value,
                "setup": setup_dict(row.setup, row.installed.kv_plan),
                "fixed_logic_outcome": row.fixed.outcome.value, "hint": row_hint(row),
                "played_outcome": _played(row.installed), "fixed_logic_played_outcome": _played(row.fixed),
                "unplayable": bool(getattr(row.installed, "unplayable", False)),
                "failure": row.installed.failure.as_dict() if row.installed.failure else None,
                "violations": [v.__dict__ for v in row.installed.violations],
                "coverage": row.installed.coverage.as_dict() if row.installed.coverage is not None else None,
                # a silent bug as its clients see it (the levels that compare completions; None elsewhere)
                "answers": row.installed.answers.as_dict() if row.installed.answers is not None else None,
                "fixed_in": fixed_in_dict(row.fixed_in),
            }
            for row in report.rows
        ],
        "metrics": [
            {"bug": m.bug, "title": m.title, "refs": list(m.refs), "summary": metric_summary(m),
             "outcome": m.outcome, "error": m.error, **(m.value.as_dict() if m.value is not None else {})}
            for m in report.metrics
        ],
    }
