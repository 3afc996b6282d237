"""Invariants of vLLM's object-store secondary tier, read through kvdoctor's recording tier.

Each is a promise vLLM's `ObjectStoreSecondaryTierManager` makes (its docstrings in tiering/obj/manager.py and
tiering/base.py). kvdoctor's `RecordedObjTier` (engine/compat/objstore_tier.py) is vLLM's manager on a fake NIXL
agent with an in-memory bucket; it records what vLLM asked and reported (`journal`), and these checks hold that
against the bucket and the manager's own state after every step. A run without the tier checks nothing.

- what it stores is what a later load gets: a load reported successful leaves each chunk holding the bytes stored
  for its key;
- failed puts give no hit: a lookup answers HIT only for a key whose object the bucket holds;
- nothing left pending: every job the manager tracks is in flight or has its result waiting (none is dropped
  unreported, pinning its chunks for ever), and no NIXL transfer handle outlives its transfer.
"""

from __future__ import annotations

from typing import Any

from kvdoctor.observe.tier_check_table import TierCheckTable, recording_tiers, registrar, short_key

OBJSTORE_CHECKS: TierCheckTable = {}  # observe/invariants.py registers them with the others
_invariant = registrar(OBJSTORE_CHECKS)


def _tiers(ctx: Any) -> list[Any]:
    return recording_tiers(ctx, 'kvdoctor_objstore')


@_invariant("objstore-load-returns-stored-bytes",
            "a load from the object-store tier reported successful leaves each chunk holding the bytes stored for "
            "its key")
def _load_returns_stored(ctx: Any) -> list[str]:
    messages = []
    for tier in _tiers(ctx):
        for job, key, chunk in tier.journal.byte_mismatches:
            messages.append(f"object-store load job {job} reported success, but CPU chunk {chunk} does not hold the "
                            f"bytes stored for key {short_key(key)}")
        tier.journal.byte_mismatches.clear()  # reported once
    return messages


@_invariant("objstore-no-hit-without-object",
            "the object-store tier answers HIT only for a key whose object the store holds (a failed put gives no "
            "hit)")
def _no_phantom_hit(ctx: Any) -> list[str]:
    messages = []
    for tier in _tiers(ctx):
        for key, name in tier.journal.phantom_hits:
            messages.append(f"the object-store tier answered HIT for key {short_key(key)}, whose object {name!r} the "
                            f"store does not hold")
        tier.journal.phantom_hits.clear()
    return messages


@_invariant("objstore-jobs-reported",
            "every object-store job vLLM's manager tracks is in flight or has its result waiting, and no NIXL "
            "transfer handle outlives its transfer")
def _jobs_reported(ctx: Any) -> list[str]:
    messages = []
    for tier in _tiers(ctx):
        lost = [job for job in tier.kvdoctor_untracked_jobs() if job not in tier.journal.reported_lost]
        if lost:
            tier.journal.reported_lost.update(lost)
            messages.append(f"object-store job(s) {lost} are tracked by the tier but neither in flight nor reported: "
                            f"their chunks stay pinned")
        orphans = tier.kvdoctor_orphan_handles()
        if orphans > tier.journal.orphan_handles:
            tier.journal.orphan_handles = orphans
            messages.append(f"{orphans} NIXL transfer handle(s) of finished object-store transfers were never "
                            f"released")
    return messages


OBJSTORE_INVARIANTS = tuple(OBJSTORE_CHECKS)
