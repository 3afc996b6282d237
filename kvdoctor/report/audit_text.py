"""The wording of an audit row's hint and of a measured performance bug (`results.AuditRow`, `results.MetricRow`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvdoctor.report.guards import guard_lines

if TYPE_CHECKING:  # the types only
    from kvdoctor.results import AuditRow, MetricRow


def row_hint(row: AuditRow) -> str:
    """What an audit row says when it has no next steps: why the installed logic (and the fixed one) did
    what they did."""
    outcome = row.installed.outcome.value
    if outcome == "reproduced":
        fixes = [ref.split()[0] for ref in row.recipe.refs if "(fix" in ref]
        if row.fixed.outcome.value == "not_applicable":  # serve: the fixed logic is not played
            return ("fixed upstream by " + ", ".join(fixes)) if fixes else "no upstream fix named yet"
        if row.fixed.outcome.value == "not_reproduced":
            return "the PR #49146 cap (kvdoctor's fixed logic) prevents it"
        return ("the PR #49146 cap (kvdoctor's fixed logic) does not prevent it: a different bug, fixed by "
                + ", ".join(fixes) if fixes else
                "the PR #49146 cap (kvdoctor's fixed logic) does not prevent it: a different bug, "
                "no upstream fix named yet")
    if outcome == "not_reproduced":
        coverage = row.installed.coverage
        site = [row.installed.detail if coverage.gone else "crash site " + coverage.line()] if coverage else []
        return "; ".join(site + guard_lines(row.installed)) or "this vLLM handles the trigger"
    return row.installed.detail


def metric_summary(metric: MetricRow) -> str:
    """A measured performance bug in one sentence (or why it was not measured)."""
    m = metric.value
    if metric.error or m is None:
        return f"not measured: {metric.error or 'no value'}"
    where = "" if metric.level == "scheduler" else " (measured by kvdoctor's scheduler harness at every level)"
    return (f"{m.requests} requests sharing an offloaded prefix (loads take {m.load_latency_steps} steps): "
            f"{m.shared_steps} steps until all have a first token, vs {m.baseline_steps} with disjoint "
            f"prefixes ({m.extra_steps:+d}){where}")
