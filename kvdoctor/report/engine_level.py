"""How reports name the engine level a run played at (`--engine`; kvdoctor/levels/table.py)."""

from __future__ import annotations

from typing import Any


def engine_phrase(engine: str) -> str:
    """' through vLLM's EngineCore' / ' through `vllm serve`' after 'vLLM X.Y.Z'; '' at the default
    (scheduler) level, which stays unnamed."""
    return {"core": " through vLLM's EngineCore", "serve": " through `vllm serve`"}.get(engine, "")


def report_engine_phrase(report: Any) -> str:
    """`engine_phrase` of a report that carries its level (`engine`); '' for one that has none."""
    return engine_phrase(getattr(report, "engine", "scheduler"))


def level_note(report: Any) -> str:
    """What an audit's summary adds at an engine level: the recipes that level cannot play (no verdict there)."""
    engine = getattr(report, "engine", "scheduler")
    if engine == "scheduler":
        return ""
    unplayed = [row.recipe.name for row in report.rows if row.installed.outcome.value == "not_applicable"]
    if not unplayed:
        return ""
    return f"; {len(unplayed)} of {len(report.rows)} recipes cannot be played{engine_phrase(engine)} (not_applicable)"
