"""Invariants of vLLM's example secondary tier, read through kvdoctor's recording tier.

vLLM's `ExampleSecondaryTierManager` (tiering/example/manager.py) keeps the keys it stored and completes every job
at once; kvdoctor's `RecordedExampleTier` (engine/compat/example_tier.py) records what vLLM asked and what the tier
answered. Its promises, held after every step (a run without the tier checks nothing):

- what it stores a later load returns: a promotion of keys it stored succeeds, one naming a key it never stored
  fails;
- no hit without a stored chunk: a lookup answers HIT only for a key some store job carried.
"""

from __future__ import annotations

from typing import Any

from kvdoctor.observe.tier_check_table import TierCheckTable, recording_tiers, registrar, short_key

EXAMPLE_TIER_CHECKS: TierCheckTable = {}  # observe/invariants.py registers them with the others
_invariant = registrar(EXAMPLE_TIER_CHECKS)


def _tiers(ctx: Any) -> list[Any]:
    return recording_tiers(ctx, 'kvdoctor_example')


@_invariant("example-tier-load-returns-stored",
            "a load from vLLM's example tier succeeds for keys it stored and fails for a key it never stored")
def _load_returns_stored(ctx: Any) -> list[str]:
    messages = []
    for tier in _tiers(ctx):
        for job, ok, missing in tier.journal.wrong_loads:
            if ok:
                messages.append(f"example-tier load job {job} reported success for key(s) never stored: "
                                f"{', '.join(short_key(k) for k in missing)}")
            else:
                messages.append(f"example-tier load job {job} failed, though every key it named was stored")
        tier.journal.wrong_loads.clear()  # reported once
    return messages


@_invariant("example-tier-no-hit-without-store",
            "vLLM's example tier answers HIT only for a key some store job carried")
def _no_phantom_hit(ctx: Any) -> list[str]:
    messages = []
    for tier in _tiers(ctx):
        for key in tier.journal.phantom_hits:
            messages.append(f"the example tier answered HIT for key {short_key(key)}, which no store job carried")
        tier.journal.phantom_hits.clear()
    return messages


EXAMPLE_TIER_INVARIANTS = tuple(EXAMPLE_TIER_CHECKS)
