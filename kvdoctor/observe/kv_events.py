"""KV events invariants: what vLLM promises a KV events subscriber (a cache-aware router), checked each step.

A run with `kv_events` on records every batch vLLM's Scheduler publishes (the harness stands a recorder where
the ZMQ publisher would be). A `Subscriber` here plays them as a router does: a `BlockStored` of a chunk makes
it resident on its medium, a `BlockRemoved` makes it not, `AllBlocksCleared` forgets everything (vLLM's reset
publishes no per-chunk removals and relies on it, PR #41956). Only the connector's media are judged (CPU,
STORAGE): the GPU prefix cache's own events are the KV cache manager's, outside the connector.

The promises (each an invariant of `observe/invariants.py`, a no-op where events are off):
- `kv-events-store-remove-alternate`: per (medium, chunk) stores and removals alternate, and no removal
  comes before its store (a duplicate store means a removal was never published);
- `kv-events-match-tier`: after every step, what the subscriber believes is resident on the CPU tier (with
  the events the manager holds for the next publish) is the tier's ready chunks: no phantom chunk, none
  unannounced;
- `kv-events-self-describing`: a self-describing store carries its request's own block hashes, tokens and
  parent hash;
- `kv-events-removal-carries-store-hashes`: a removal names the block hashes its store announced.

A chunk the tier kept through an `AllBlocksCleared` (a reset of the GPU cache only: vLLM's clear event is not
scoped to a medium, PR #57296 closed) is forgotten by the subscriber, so it is neither a phantom nor judged
when it is later removed: vLLM promises nothing more there. Under a MultiConnector two connectors publish
their own CPU tiers' events into one stream, which no subscriber can tell apart: not judged.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

GPU_MEDIUM = "GPU"

Key = tuple[Any, Any, Any]  # (medium, group, chunk hash): KvEvent.key()


@dataclass
class Subscriber:
    """A router's view of one engine's connector tiers, built only from published events: block hashes per
    (medium, group), as a router indexes them. A chunk is its store's hashes (its key, the last one, alone in a
    placeholder payload); a removal may name several chunks' hashes at once (vLLM batches them per group)."""

    hashes: dict[Key, Key] = field(default_factory=dict)  # (medium, group, hash) -> its chunk's key
    chunks: dict[Key, tuple[Any, ...]] = field(default_factory=dict)  # chunk key -> the hashes its store named
    forgotten: set[Key] = field(default_factory=set)  # cleared by AllBlocksCleared (the tier may keep them)
    # findings of the last step, per invariant
    findings: dict[str, list[str]] = field(default_factory=dict)
    step: int = -1

    def resident_chunks(self, medium: str | None) -> set[Key]:
        return {key for key in self.chunks if key[0] == medium}

    def apply(self, events: list[Any]) -> None:
        alternate: list[str] = []
        removal: list[str] = []
        for event in events:
            if event.kind == "cleared":
                self.forgotten.update(self.hashes)
                self.hashes.clear()
                self.chunks.clear()
                continue
            if event.medium == GPU_MEDIUM or not event.block_hashes:
                continue
            named = [(event.medium, event.group_idx, h) for h in event.block_hashes]
            if event.kind == "stored":
                key = event.key()
                if any(hk in self.hashes for hk in named):
                    alternate.append(f"BlockStored({event.medium}) of chunk {_short(key[2])} (group {key[1]}) "
                                     f"while it is already resident: no BlockRemoved was published in between "
                                     f"(a subscriber counts it twice, or kept a copy the tier had dropped)")
                self.chunks[key] = tuple(event.block_hashes)
                for hk in named:
                    self.hashes[hk] = key
                    self.forgotten.discard(hk)
                continue
            unknown = [hk for hk in named if hk not in self.hashes and hk not in self.forgotten]
            if unknown:
                alternate.append(f"BlockRemoved({event.medium}) names {len(unknown)} block hash(es) no BlockStored "
                                 f"announced (group {event.group_idx}): {', '.join(_short(h[2]) for h in unknown[:6])}")
            removed = set(named)
            for chunk in sorted({self.hashes[hk] for hk in named if hk in self.hashes}, key=repr):
                stored = [(chunk[0], chunk[1], h) for h in self.chunks.get(chunk, ())]
                left = [hk for hk in stored if hk not in removed]
                if left:
                    removal.append(f"BlockRemoved({event.medium}) of chunk {_short(chunk[2])} names "
                                   f"{len(stored) - len(left)} of the {len(stored)} block hash(es) its BlockStored "
                                   f"announced (a subscriber keeps the other {len(left)})")
                if chunk in removed:
                    self.chunks.pop(chunk, None)
            for hk in named:
                self.hashes.pop(hk, None)
                self.forgotten.discard(hk)
        self.findings["kv-events-store-remove-alternate"] = alternate
        self.findings["kv-events-removal-carries-store-hashes"] = removal


_SUBSCRIBERS: weakref.WeakKeyDictionary[Any, Subscriber] = weakref.WeakKeyDictionary()


def subscriber(ctx: Any) -> Subscriber | None:
    """The run's subscriber, fed this step's events once (whichever invariant asks first); None where the run
    records no events."""
    harness = ctx.harness
    if harness is None or getattr(harness, "kv_event_recorder", None) is None:
        return None
    if harness.setup.multi_connector:  # two connectors publish their own CPU tiers' events into one stream
        return None
    sub = _SUBSCRIBERS.get(harness)
    if sub is None:
        sub = _SUBSCRIBERS[harness] = Subscriber()
    if sub.step != harness.step_index:
        sub.step = harness.step_index
        sub.apply(list(getattr(ctx.events, "kv_events", ())))
        sub.findings["kv-events-match-tier"] = _match_tier(harness, sub)
        sub.findings["kv-events-self-describing"] = _self_describing(harness, ctx.events)
    return sub


def _match_tier(harness: Any, sub: Subscriber) -> list[str]:
    read = harness.api.connector_tier_keys(harness.connector_scheduler) if harness.connector_scheduler else None
    if read is None:
        return []
    ready, pending = read.ready, read.pending
    believed = sub.resident_chunks(read.medium)
    for event in pending:  # what the manager will publish next: a subscriber learns it then
        (believed.discard if event.kind == "removed" else believed.add)(event.key())
    phantom = sorted(believed - ready, key=repr)
    unannounced = sorted(ready - believed - sub.forgotten, key=repr)
    messages = []
    if phantom:
        messages.append(f"a subscriber believes {len(phantom)} chunk(s) resident on {phantom[0][0]} that the tier "
                        f"no longer holds (no BlockRemoved or AllBlocksCleared was published): "
                        f"{', '.join(_short(k[2]) for k in phantom[:6])}")
    if unannounced:
        messages.append(f"the {unannounced[0][0]} tier holds {len(unannounced)} ready chunk(s) no BlockStored "
                        f"announced: {', '.join(_short(k[2]) for k in unannounced[:6])}")
    return messages


def _self_describing(harness: Any, events: Any) -> list[str]:
    if not getattr(harness.setup, "self_describing_kv_events", False):
        return []
    messages = []
    for event in getattr(events, "kv_events", ()):
        if event.kind != "stored" or event.medium == GPU_MEDIUM or not event.token_ids or not event.block_size:
            continue  # placeholder payloads (windowed groups) carry no description to judge
        problem = _describes_a_request(harness, event)
        if problem:
            messages.append(problem)
    return messages


def _describes_a_request(harness: Any, event: Any) -> str | None:
    """None where some request's block hashes hold the event's hashes in a row, with the event's tokens at their
    positions and the hash before them as parent; else what is wrong. A request's hashes are computed every
    `hash_block_size` tokens (a finer `prefix_match_unit`); a block's hash is the last one inside it (vLLM's
    `BlockHashListWithBlockSize`), as the event names blocks of `block_size` tokens."""
    hashes = tuple(event.block_hashes)
    size = event.block_size
    hash_size = getattr(harness.kv_plan, "hash_block_size", size) or size
    if size % hash_size:
        return None  # not a view kvdoctor can rebuild: nothing to judge
    scale = size // hash_size
    nearest = None
    for req_id, request in harness.requests.items():
        raw = harness.api.external_block_hashes(getattr(request, "block_hashes", ()) or ())
        own = raw[scale - 1::scale]
        if hashes[0] not in own:
            continue
        start = own.index(hashes[0])
        if own[start:start + len(hashes)] != hashes:
            nearest = f"{req_id}'s block hashes from {start} differ from the store's"
            continue
        tokens = tuple(request.all_token_ids[start * size:(start + len(hashes)) * size])
        parent = own[start - 1] if start else None
        if tokens != tuple(event.token_ids):
            nearest = f"its tokens are not {req_id}'s at blocks {start}-{start + len(hashes) - 1}"
            continue
        if parent != event.parent_block_hash:
            nearest = (f"its parent hash is not {req_id}'s block {start - 1} hash" if start else
                       f"it names a parent, but it is {req_id}'s first chunk")
            continue
        return None
    return (f"self-describing BlockStored({event.medium}) of chunk {_short(hashes[-1])} does not describe a request: "
            + (nearest or "no request has its block hashes"))


def _short(value: Any) -> str:
    text = value.hex() if isinstance(value, bytes) else str(value)
    return text[:12]


def _check(name: str) -> Callable[[Any], list[str]]:
    def check(ctx: Any) -> list[str]:
        sub = subscriber(ctx)
        return list(sub.findings.get(name, ())) if sub is not None else []
    return check


# (name, summary, check): registered by observe/invariants.py with the others
CHECKS: tuple[tuple[str, str, Callable[[Any], list[str]]], ...] = (
    ("kv-events-store-remove-alternate",
     "per (medium, chunk) the connector's published BlockStored and BlockRemoved alternate, no removal before "
     "its store (K13: a reset that empties the CPU tier unannounced leads to duplicate stores)",
     _check("kv-events-store-remove-alternate")),
    ("kv-events-match-tier",
     "after every step, what a KV events subscriber believes is resident on the CPU tier is the tier's ready "
     "chunks (K13: a failed GPU reset still empties the CPU tier, and no event says so)",
     _check("kv-events-match-tier")),
    ("kv-events-self-describing",
     "a self-describing BlockStored carries its request's own block hashes, tokens and parent hash",
     _check("kv-events-self-describing")),
    ("kv-events-removal-carries-store-hashes",
     "a BlockRemoved names the block hashes its BlockStored announced",
     _check("kv-events-removal-carries-store-hashes")),
)
