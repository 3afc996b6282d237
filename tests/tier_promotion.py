"""The one scenario the secondary-tier tests share: A and C stored, the prefix cache reset, then B
(A's prompt and one token more) promoted from the tier, every given invariant checked after each step."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any


def play_promotion(harness: Any, invariants: Iterable[str]) -> tuple[list[tuple[str, str]], list[tuple[str, int]]]:
    """(violations as (invariant, message), B's (status, computed tokens) after each of its steps)."""
    from kvdoctor.observe.invariants import StepContext, check_all

    names = list(invariants)
    violations: list[tuple[str, str]] = []
    rows: list[tuple[str, int]] = []

    def step() -> None:
        harness.step()
        violations.extend((v.invariant, v.message) for v in check_all(names, StepContext(harness, None, [])))

    for name, base in (("A", 100), ("C", 200)):
        harness.add(name, list(range(base, base + 8)), 1)
        for _ in range(6):
            step()
    assert harness.reset_prefix_cache(False, False)
    harness.add("B", list(range(100, 109)), 1)
    for _ in range(10):
        step()
        request = harness.requests["B"]
        rows.append((request.status.name, request.num_computed_tokens))
    return violations, rows


def drive_recorded_tier(api: Any, setup: Any, invariants: Iterable[str], marker: str,
                        mutate: Callable[[Any], None] | None = None) -> dict[str, Any]:
    """`play_promotion` on a harness whose secondary tier is one of kvdoctor's recording tiers (`marker`: its
    class flag), vLLM's code patched by `mutate(monkeypatch)` for the run; the tier is kept for the asserts."""
    import pytest

    from kvdoctor.engine.harness import Harness

    with pytest.MonkeyPatch.context() as patch:
        if mutate is not None:
            mutate(patch)
        harness = Harness(api, setup)
        manager = api.tiering_manager_of(harness.connector_scheduler)
        try:
            violations, rows = play_promotion(harness, invariants)
        finally:
            tier = next(t for t in manager.secondary_tiers if getattr(t, marker, False))
            harness.shutdown()
    return {"violations": violations, "rows": rows, "tier": tier,
            "tiers": [type(t).__name__ for t in manager.secondary_tiers]}


def violated(run: dict[str, Any]) -> set[str]:
    """The names of the invariants a `drive_recorded_tier` run violated."""
    return {name for name, _ in run["violations"]}
