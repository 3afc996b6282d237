"""`kvdoctor hunt`'s result as text lines and as its `--json` document (formatting only)."""

from __future__ import annotations

from typing import Any

from kvdoctor import SCHEMA_VERSION, __version__


def hunt_lines(report: Any) -> list[str]:
    aim, explored = report.aim, report.explored
    out = [f"hunt for {aim.site}"]
    out.append(f"  aimed from: {aim.source}" + (f"; the log's vLLM {aim.version}" if aim.version else "")
               + f"; hunting on vLLM {report.vllm_version}")
    if aim.known:
        out.append(f"  the log matches known bug(s) {', '.join(aim.known)}: "
                   + ("their routes count too (--include-known)" if not aim.exclude else
                      "hunting for another route to the same site"))
    if aim.exclude:
        out.append(f"  excluded: routes through the triggers of {', '.join(sorted(aim.exclude))} (known bugs at this "
                   f"site; --include-known to count them)")
    out.append("  forced: " + (", ".join(sorted(aim.force)) or "nothing"))
    for line in aim.expressed:
        out.append(f"  expressed: {line}")
    for feature, why in aim.unexpressed:
        out.append(f"  not expressed: {feature}: {why}")
    if explored is not None:
        stats = explored.result.stats
        out.append(f"  searched: {stats.examples} examples (+{stats.shrink_examples} while shrinking), "
                   f"{stats.scheduler_steps:,} scheduler steps in {stats.elapsed:.1f} s; {stats.excluded} failing "
                   f"run(s) through an excluded trigger run past"
                   + (f"; {stats.invalid} example(s) refused by vLLM" if stats.invalid else ""))
        for error in explored.result.errors:
            out.append(f"  warning: {error}")
        for note in explored.notes:  # e.g. a finding left untriaged when the budget was spent
            out.append(f"  note: {note}")
    if report.reach is not None:
        out.append(f"  {aim.function}: {report.reach.line()}")
    if report.at_site:
        out.append(f"FOUND: {len(report.at_site)} route(s) to the crash site, shrunk and written:")
        for finding in report.at_site:
            out += _finding_lines(finding)
    else:
        reason = report.inconclusive_reason
        out.append("not found" + (f" (inconclusive: {reason})" if reason else
                                  f": {report.reach.examples if report.reach else 0} example(s) reached "
                                  f"{aim.function} and none failed at its crash statement"))
    if report.elsewhere:
        out.append(f"other failures in {aim.function} (not the log's statement):")
        for finding in report.elsewhere:
            out += _finding_lines(finding)
    return out


def _finding_lines(finding: Any) -> list[str]:
    out = [f"  {finding.label}" + (f" via {finding.path}'s trigger" if finding.path else ""),
           f"    {finding.steps} steps, after {finding.elapsed_s:.1f} s, {finding.examples_before} examples; "
           f"recipe: {finding.file}",
           f"    {finding.detail}"]
    if finding.triage is not None:
        out.append(f"    triage: {finding.triage.line}")
        if finding.triage.report:
            out.append(f"    report attachment: {finding.triage.report}")
    if finding.file:
        at_core = finding.engine == "core"
        out.append(f"    replay: kvdoctor repro {finding.file}"
                   + (" --engine core   (its sleep / wake_up steps are the engine's)" if at_core
                      else "   (through EngineCore: add --engine core)"))
    return out


def hunt_document(report: Any) -> dict[str, Any]:
    explored = report.explored
    stats = explored.result.stats if explored is not None else None
    return {
        "schema_version": SCHEMA_VERSION,
        "kvdoctor_version": __version__,
        "vllm_version": report.vllm_version,
        "command": report.command or None,
        "log": report.source,
        "aim": report.aim.as_dict(),
        "found": bool(report.at_site),
        "examples": stats.examples if stats else 0,
        "shrink_examples": stats.shrink_examples if stats else 0,
        "excluded_runs": stats.excluded if stats else 0,
        "invalid_examples": stats.invalid if stats else 0,  # examples vLLM refused at start-up (not searched)
        "elapsed_s": round(stats.elapsed, 3) if stats else 0.0,
        "wall_s": round(report.wall_s, 3),
        "function_reach": report.reach.as_dict() if report.reach is not None else None,
        "findings": [f.as_dict() for f in report.at_site],
        "other_findings": [f.as_dict() for f in report.elsewhere],
        "inconclusive_reason": report.inconclusive_reason or None,
        "errors": list(explored.result.errors) if explored is not None else [],
        "notes": list(explored.notes) if explored is not None else [],
        "exit_status": int(report.exit_status),
    }
