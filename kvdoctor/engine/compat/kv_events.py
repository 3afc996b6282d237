"""vLLM's KV cache events (`KVEventsConfig`), as each release spells them.

Methods of `VllmApi` (mixed in), so every adapter call reads `api.<name>(...)`. kvdoctor turns events on
through vLLM's own config (`KVEventsConfig(enable_kv_cache_events=True, publisher="null")`: the Scheduler then
collects its KV cache manager's and its connector's events each `update_from_output` and publishes them), and
replaces only the publisher (the ZMQ socket a router subscribes to) with a recorder: what the recorder holds is
exactly what vLLM would have sent.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any

import kvdoctor.engine.compat.names as names
from kvdoctor.engine.compat.imports import AdapterBase, _import

OFFLOAD_BASE_MODULE = "vllm.v1.kv_offload.base"

# Feature names (`kv_events_features`): events the connector publishes at all; its self-describing payloads
# (`kv_connector_extra_config["self_describing_kv_events"]`); removals that carry only metadata (a failed
# store's `metadata_only` OffloadingEvent, with 0.33's residency-tracked event stream).
KV_EVENTS = "kv_events"
SELF_DESCRIBING = "self_describing_kv_events"
METADATA_ONLY_REMOVALS = "metadata_only_removals"
REQUEST_DESCRIBED_STORES = "request_described_stores"
OFFLOADING_EVENTS_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.events"


@dataclass(frozen=True)
class KvEvent:
    """One published KV cache event, in kvdoctor's terms (vLLM's msgspec structs read once, here)."""

    kind: str  # "stored" | "removed" | "cleared"
    medium: str | None = None
    group_idx: int | None = None
    block_hashes: tuple[Any, ...] = ()
    parent_block_hash: Any = None
    token_ids: tuple[int, ...] = ()
    block_size: int = 0

    def key(self) -> tuple[str | None, int | None, Any]:
        """(medium, group, hash) of the chunk the event names: a chunk's last block hash is its offload key
        (a placeholder payload carries only that hash; a self-describing one every block's, the key last)."""
        return (self.medium, self.group_idx, self.block_hashes[-1] if self.block_hashes else None)

    def describe(self) -> str:
        if self.kind == "cleared":
            return "AllBlocksCleared"
        name = "BlockStored" if self.kind == "stored" else "BlockRemoved"
        return f"{name}({self.medium}, group {self.group_idx}, {len(self.block_hashes)} hash(es))"


@dataclass(frozen=True)
class TierKeys:
    """The connector's tier as a subscriber should see it (`connector_tier_keys`)."""

    medium: str | None
    ready: set[tuple[str | None, int | None, Any]]
    pending: list[KvEvent]  # events its manager holds for the next publish


class KvEventRecorder:
    """Stands where vLLM's event publisher stands (`Scheduler.kv_event_publisher`): keeps every batch the
    Scheduler publishes, in order, until `take` hands them over (one engine step's, as a subscriber gets them)."""

    def __init__(self) -> None:
        self.pending: list[KvEvent] = []
        self.batches = 0

    # vLLM's EventPublisher interface (`publish`, `shutdown`)
    def publish(self, batch: Any) -> None:
        self.batches += 1
        self.pending.extend(kv_event(event) for event in getattr(batch, "events", ()) or ())

    def shutdown(self) -> None:
        return None

    def take(self) -> list[KvEvent]:
        events, self.pending = self.pending, []
        return events


def kv_event(event: Any) -> KvEvent:
    """vLLM's BlockStored / BlockRemoved / AllBlocksCleared as a `KvEvent` (fields a release lacks read as
    their defaults)."""
    name = type(event).__name__
    if name == "AllBlocksCleared":
        return KvEvent("cleared")
    kind = "stored" if name == "BlockStored" else "removed"
    return KvEvent(kind, medium=_medium(getattr(event, "medium", None)), group_idx=getattr(event, "group_idx", None),
                   block_hashes=tuple(getattr(event, "block_hashes", ()) or ()),
                   parent_block_hash=getattr(event, "parent_block_hash", None),
                   token_ids=tuple(getattr(event, "token_ids", ()) or ()),
                   block_size=int(getattr(event, "block_size", 0) or 0))


def _medium(medium: Any) -> str | None:
    """A medium as events spell it ("CPU"): an OffloadingManager's `Medium` enum member or its string."""
    if medium is None:
        return None
    return medium.name if isinstance(medium, enum.Enum) else str(medium)


class KvEventsGlue(AdapterBase):
    """vLLM's KV events: the config that turns them on, the publisher seam, the connector tier they describe."""

    def kv_events_features(self) -> frozenset[str]:
        """What this vLLM's KV events can do, probed (never by version): `KV_EVENTS` where vllm.config has
        KVEventsConfig and the offloading connector's scheduler side has `take_events`; `SELF_DESCRIBING`
        where the connector's events config (`OffloadingKVEventsConfig`) has `self_describing_kv_events`;
        `METADATA_ONLY_REMOVALS` where an `OffloadingEvent` has `metadata_only`; `REQUEST_DESCRIBED_STORES` where
        the connector's events tracker describes a store from its request's context (`on_new_request`)."""
        features = set()
        connector = getattr(self.mods["offload_scheduler"], "OffloadingConnectorScheduler", None)
        if hasattr(self.mods["config"], "KVEventsConfig") and hasattr(connector, "take_events"):
            features.add(KV_EVENTS)
        base = _optional_import(OFFLOAD_BASE_MODULE)
        if KV_EVENTS in features and _field_names(getattr(base, "OffloadingKVEventsConfig", None)) >= {SELF_DESCRIBING}:
            features.add(SELF_DESCRIBING)
        if "metadata_only" in _field_names(getattr(base, "OffloadingEvent", None)):
            features.add(METADATA_ONLY_REMOVALS)
        tracker = getattr(_optional_import(OFFLOADING_EVENTS_MODULE), "OffloadingEventsTracker", None)
        if KV_EVENTS in features and hasattr(tracker, "on_new_request"):
            features.add(REQUEST_DESCRIBED_STORES)
        return frozenset(features)

    def kv_events_config(self) -> Any:
        """vLLM's `KVEventsConfig` with events on and the null publisher (no socket): `record_kv_events`
        then stands in for the publisher."""
        return self.cls("config", "KVEventsConfig")(enable_kv_cache_events=True, publisher="null")

    @staticmethod
    def record_kv_events(scheduler: Any) -> KvEventRecorder:
        """Put a recorder where the Scheduler publishes its KV event batches (its public
        `kv_event_publisher`), and return it."""
        recorder = KvEventRecorder()
        scheduler.kv_event_publisher = recorder
        return recorder

    def connector_tier_keys(self, connector_scheduler: Any) -> TierKeys | None:
        """The offload tier's medium, its ready chunks as (medium, group, hash) - hashes as events spell them -
        and the events its manager holds not yet taken (what the next publish will add), or None where kvdoctor
        cannot read the tier (a manager other than the CPU manager with a dict-backed cache policy)."""
        manager = getattr(connector_scheduler, "manager", None)
        policy = names.get(manager, names.CPU_CACHE_POLICY, None) if manager is not None else None
        if policy is None:
            return None
        # the policy's key -> status tables: LRU's `chunks` (`blocks` before 0.30), ARC's `t1` and `t2` (its
        # ghost lists `b1`/`b2` hold no chunk)
        tables = [table for attr in ("chunks", "blocks", "t1", "t2")
                  if isinstance(table := getattr(policy, attr, None), dict)]
        if not tables:
            return None
        entries = {key: status for table in tables for key, status in table.items()}
        medium = _medium(getattr(manager, "medium", None))
        keys = {self._tier_key(medium, key) for key, status in entries.items() if getattr(status, "is_ready", False)}
        pending = []
        for raw in list(getattr(manager, "events", None) or ()):
            kind = "removed" if getattr(raw, "removed", False) else "stored"
            for key in getattr(raw, "keys", ()):
                m, group, digest = self._tier_key(_medium(getattr(raw, "medium", medium)), key)
                pending.append(KvEvent(kind, medium=m, group_idx=group, block_hashes=(digest,)))
        return TierKeys(medium, keys, pending)

    def _tier_key(self, medium: str | None, key: Any) -> tuple[str | None, int | None, Any]:
        base = _import(OFFLOAD_BASE_MODULE)
        utils = self.mods["kv_cache_utils"]
        digest = base.get_offload_block_hash(key)
        convert = getattr(utils, "maybe_convert_block_hash", None)
        return (medium, base.get_offload_group_idx(key), convert(digest) if convert else digest)

    def external_block_hashes(self, block_hashes: Any) -> tuple[Any, ...]:
        """A request's block hashes as events spell them (vLLM's `maybe_convert_block_hash`)."""
        convert = getattr(self.mods["kv_cache_utils"], "maybe_convert_block_hash", None)
        return tuple(convert(h) if convert else h for h in block_hashes)


def _optional_import(module: str) -> Any:
    try:
        return _import(module)
    except Exception:  # a release without the module lacks the feature
        return None


def _field_names(cls: Any) -> set[str]:
    if cls is None:
        return set()
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return set(getattr(cls, "__struct_fields__", ()) or getattr(cls, "model_fields", {}) or ())
