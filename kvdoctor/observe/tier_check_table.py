"""One way to declare a secondary tier's invariants and to find the recording tiers they read.

The scripted, object-store and example tiers each keep a table `name -> (summary, check)` that
observe/invariants.py registers with the others; this module is the decorator that fills such a
table, the lookup of kvdoctor's recording tiers among vLLM's tiering manager's secondary tiers,
and the short form of a chunk key their messages print.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

TierCheck = Callable[[Any], list[str]]  # check(StepContext) -> messages
TierCheckTable = dict[str, tuple[str, TierCheck]]


def registrar(table: TierCheckTable) -> Callable[[str, str], Callable[[TierCheck], TierCheck]]:
    """A decorator factory `@invariant(name, summary)` that records the check in `table`."""
    def invariant(name: str, summary: str) -> Callable[[TierCheck], TierCheck]:
        def register(check: TierCheck) -> TierCheck:
            table[name] = (summary, check)
            return check
        return register
    return invariant


def recording_tiers(ctx: Any, marker: str) -> list[Any]:
    """The secondary tiers carrying `marker` (a kvdoctor recording tier's class flag); none without a tier."""
    harness = ctx.harness
    if getattr(harness, "connector_scheduler", None) is None:
        return []
    manager = harness.api.tiering_manager_of(harness.connector_scheduler)
    tiers = getattr(manager, "secondary_tiers", None) or []
    return [tier for tier in tiers if getattr(tier, marker, False)]


def short_key(key: Any) -> str:
    """A chunk key as messages print it: 12 hex digits of bytes, else its repr."""
    return key.hex()[:12] if isinstance(key, (bytes, bytearray)) else repr(key)
