"""The one scenario the secondary-tier tests share: A and C stored, the prefix cache reset, then B
(A's prompt and one token more) promoted from the tier, every given invariant checked after each step."""

from __future__ import annotations

from collections.abc import Iterable
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
