"""Hypothesis strategies for event sequences, and their translation into valid recipes.

A generated example is a `Geometry` plus a list of abstract events. Events
name requests by a number k (the k-th latest request, modulo the requests
added so far), resolved when the sequence is turned into recipe steps, so any
list hypothesis draws (or shrinks to) is a valid recipe: an abort, finish or
transfer rule only ever names a request that was added before it, a shared
prefix only an earlier request; events that cannot apply yet (an abort before
any add) are dropped.
Prompt lengths are kept to what a real server would admit: prompt +
max_tokens <= max_model_len, and the whole model length fits the GPU pool
(`max_model_len = (gpu_blocks - 1) * block_size`, block 0 being vLLM's null
block), so no request can starve forever for lack of blocks.

Events: add (prompt sizes in tokens, chunks, fractions of the pool, or
fill_pool; max_tokens; a prefix shared with an earlier request), schedule (1-8
engine steps; most events are also followed by a few), abort, finish by EOS,
hold / complete / fail transfers (per request or all, per kind), reset the
prefix cache (optionally preempting running requests and resetting the
connector), drain (apply the async output in flight), delay / release a request's
block hashes (its offload keys lag its blocks, as in P/D and hybrid deployments;
an example that delays any runs without GPU prefix caching, and its still-withheld
hashes are released before the settle tail). Geometry: block size,
blocks per chunk, GPU blocks (4-24: small pools force queueing and preemption),
max_num_seqs, max_num_batched_tokens, sync or async scheduling, a small CPU
tier (evictions) or a roomy one, prompt-only or prompt-and-decode offloading,
the offloading spec (vLLM's default CPUOffloadingSpec or TieringOffloadingSpec,
where the release has it), and the model's KV layout (one full-attention group,
or a shipped hybrid one: swa-full with a drawn window, mamba-hybrid, eagle-pair).
With two groups in one pool, the model length is what a request's blocks in both
groups fit.

Where the installed vLLM has the newest load machinery (synchronous loads,
probed: `search.available_features`), one more geometry byte draws it and its
neighbours, each through vLLM's own configuration path: the step's sync-load
budget (`kv_connector_extra_config.sync_load_budget_bytes`: none, one chunk's
KV, everything), `kv_load_failure_policy = "recompute"` (KVTransferConfig),
a `prefix_match_unit` finer than the block (CacheConfig; two-group layouts
only, where vLLM takes it: partial-tail hits), and the connector's deployment
(a MultiConnector, or a P/D `kv_role` of kv_consumer / kv_producer). A release
without sync loads draws none of it, so its examples (and the seeds measured on
it) stay what they were. A sync load is never held or failed: the simulated
worker, as vLLM's, completes it in the step that issued it and reports no
finished_recving for it.

Where the installed offloading connector reads per-request caps from a request's
`kv_transfer_params` (`max_load_tokens` / `max_offload_tokens`, probed), a second
extension byte and a fifth byte per event draw 0.34's remaining vocabulary, again
through vLLM's own paths: each add's caps (none, 0, a block, a chunk, one token
either side of a chunk: sent as a client sends them), `prefix_cache_retention_interval`
(CacheConfig; one or two chunks, only with a sliding-window or Mamba group, where
vLLM takes it) and the priority policy (SchedulerConfig.policy, with each add's
priority: a more urgent arrival preempts running requests while their stores or
loads are in flight), and the CPU tier's ARC eviction policy (`eviction_policy =
"arc"` in kv_connector_extra_config, where vLLM's cache policy registry has it). A
release without the caps draws none of it, so its seeds stay as they were.

Where the release has 0.34's speculative machinery in the offloading path (lookahead block hashes, the
EAGLE block drop; probed), one more byte draws speculative decoding through vLLM's own SpeculativeConfig
(`decode_speculative`; docs/explore-vocabulary.md): eagle or ngram, 1-4 drafts, the drafts each
verification accepts (kvdoctor stands in for the drafter and the rejection sampler), and, for eagle, hashes
without the lookahead.

Where the offloading scheduler counts each job's reports to world_size (`TransferJobStatus.pending_count`)
and vLLM has the executor's `KVOutputAggregator` (probed), one more byte, the last, draws several workers
(`decode_workers`): 2 or 4 (`ParallelConfig.tensor_parallel_size`), the last one reporting up to 5 steps
late, and a failed job failed by one worker alone (`fail_transfers worker = i`); the CPU tier is scaled by
the workers (vLLM holds a copy per worker) and the settle tail waits for the late worker.

Every recipe ends with a fixed *settle tail* (`schedule`, `complete_transfers`,
`schedule count = SETTLE_STEPS`): after it every transfer has been reported
and every finished request's connector state must have been released, which
the runner checks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cache
from typing import Any

from hypothesis import strategies as st

from kvdoctor.engine.kv_layout import resolve_layout
from kvdoctor.errors import InternalError
from kvdoctor.recipes.model import Recipe, Signature, Step
from kvdoctor.steps import PAUSE_MODES, REGISTRY

# Never matches a failure: the explorer classifies failures itself (see runner.py).
PLACEHOLDER_SIGNATURE = Signature(exception="(explore: any failure)", function="(explore)")
SETTLE_STEPS = 4  # engine steps after releasing every transfer (covers the async one-step lag twice)
MAX_SCHEDULE_COUNT = 8


@dataclass(frozen=True)
class Geometry:
    block_size: int
    blocks_per_chunk: int
    gpu_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    async_scheduling: bool
    cpu_bytes_to_use: int | None = None  # None: kvdoctor's default (a CPU tier nothing fills)
    offload_prompt_only: bool = True
    spec_name: str | None = None  # None: vLLM's default CPUOffloadingSpec
    layout: str | None = None  # a shipped hybrid layout (kvdoctor/models/<name>); None: one full-attention group
    sliding_window: int | None = None  # swa-full's window, in tokens
    mamba_cache_mode: str | None = None  # mamba-hybrid's CacheConfig.mamba_cache_mode
    worker: str = "simulated"  # not drawn: `explore --worker`
    # Off where the example withholds block hashes: vLLM's GPU block pool caches a full block by
    # its hash and indexes hashes that have not arrived (cache_full_blocks), so an engine whose
    # hashes arrive late runs without GPU prefix caching (as K6's recipe does).
    enable_prefix_caching: bool = True
    # The extension byte (`decode_extension`), drawn only where the release has sync loads:
    sync_load_budget_bytes: int | None = None  # kv_connector_extra_config.sync_load_budget_bytes
    kv_load_failure_policy: str | None = None  # KVTransferConfig.kv_load_failure_policy ("recompute")
    prefix_match_unit: int | None = None  # CacheConfig.prefix_match_unit (two-group layouts)
    multi_connector: bool = False  # vLLM's MultiConnector: the watched OffloadingConnector and another
    kv_role: str | None = None  # KVTransferConfig.kv_role (None: kv_both)
    # The second extension byte (`decode_second_extension`), drawn only where the connector reads caps:
    prefix_cache_retention_interval: int | None = None  # CacheConfig (sliding-window / Mamba layouts)
    scheduling_policy: str | None = None  # SchedulerConfig.policy ("priority"; None: fcfs)
    eviction_policy: str | None = None  # kv_connector_extra_config.eviction_policy ("arc"; None: vLLM's lru)
    # The speculative byte (`decode_speculative`), drawn only where `SPECULATIVE_DRAW` is a feature:
    speculative_method: str | None = None  # vLLM's SpeculativeConfig method (kvdoctor stands in for the drafter)
    num_speculative_tokens: int = 2
    draft_acceptance: str | None = None  # the stand-in rejection sampler's accepted counts, cycled
    disable_lookahead_block_hashes: bool = False  # eagle on 0.34: the trailing-block drop instead
    # The workers byte (`decode_workers`), drawn only where `WORKERS_DRAW` is a feature:
    num_workers: int = 1  # ParallelConfig.tensor_parallel_size: the scheduler waits for every worker
    late_worker_steps: int = 0  # the last worker reports this many steps after the others
    fail_worker: int | None = None  # a fail event is this worker's alone (the others complete the jobs)
    # The tier byte (`decode_tier`), drawn only where `TIER_DRAW` is a feature: the tiering spec's fs tier;
    # where `SCRIPTED_TIER_DRAW` is one too, kvdoctor's scripted tier, its script and backpressure (tier_draw.py)
    secondary_tier: str | None = None
    # The events byte (`decode_kv_events`), drawn only where `EVENTS_DRAW` is a feature: vLLM's KV events on
    # (checked by observe/kv_events.py), and the connector's self-describing payloads
    kv_events: bool = False
    self_describing_kv_events: bool = False
    tier_script: str | None = None
    backpressure_pattern: str | None = None
    object_store: str | None = None  # vLLM's object-store tier's fault script (tier_draw.objstore_fields)
    pd_decode: bool = False  # forced only (`--force pd-decode`, PD_DRAW): kvdoctor's NIXL stand-in first
    # forced only (`--force sleep-wake`, SLEEP_DRAW): the example draws sleep / wake_up and plays at --engine core;
    # not a [setup] field (the recipe's steps say it: `sleep` needs the engine's pause)
    sleep_wake: bool = False
    sleep_keeps_connector: bool = False  # the release's EngineCore.sleep takes reset_connector (a probe)

    @property
    def groups(self) -> int:
        """KV cache groups sharing the pool (the layouts kvdoctor ships make at most two)."""
        return LAYOUT_GROUPS.get(self.layout or "", 1)

    @property
    def max_model_len(self) -> int:
        # Every group of a request takes blocks from the one pool: a whole-length request must fit.
        # At least 2 tokens: a request is one prompt token and one to generate (1-token blocks, a
        # two-group layout and a 3-block pool gave 1, and no request could be drawn).
        return max(2, max(1, (self.gpu_blocks - 1) // self.groups) * self.block_size)

    @property
    def chunk_tokens(self) -> int:
        return self.block_size * self.blocks_per_chunk

    def kv_transfer_fields(self) -> dict[str, Any]:
        fields = {"kv_load_failure_policy": self.kv_load_failure_policy, "kv_role": self.kv_role}
        return {key: value for key, value in fields.items() if value is not None}

    def extra_connector_config(self) -> dict[str, Any]:
        fields = {"sync_load_budget_bytes": self.sync_load_budget_bytes or None,
                  "eviction_policy": self.eviction_policy}
        return {key: value for key, value in fields.items() if value is not None}

    def setup_dict(self) -> dict[str, Any]:
        optional = {"cpu_bytes_to_use": self.cpu_bytes_to_use, "spec_name": self.spec_name, "layout": self.layout,
                    "sliding_window": self.sliding_window, "mamba_cache_mode": self.mamba_cache_mode}
        return {
            "block_size": self.block_size, "blocks_per_chunk": self.blocks_per_chunk,
            "gpu_blocks": self.gpu_blocks, "async_scheduling": self.async_scheduling,
            "max_num_seqs": self.max_num_seqs, "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_model_len": self.max_model_len,
            **{key: value for key, value in optional.items() if value is not None},
            **({} if self.offload_prompt_only else {"offload_prompt_only": False}),
            **({} if self.enable_prefix_caching else {"enable_prefix_caching": False}),
            **({"extra_connector_config": extra} if (extra := self.extra_connector_config()) else {}),
            **({"kv_transfer_fields": fields} if (fields := self.kv_transfer_fields()) else {}),
            **({"prefix_match_unit": self.prefix_match_unit} if self.prefix_match_unit else {}),
            **({"prefix_cache_retention_interval": self.prefix_cache_retention_interval}
               if self.prefix_cache_retention_interval else {}),
            **({"scheduling_policy": self.scheduling_policy} if self.scheduling_policy else {}),
            # the second connector's tier as small as the first's: the tiering spec maps its tier whole,
            # and kvdoctor's 64 MiB default timed out in vLLM's mmap wait (measured on 0.34.0)
            **({"multi_connector": True, "second_cpu_bytes_to_use": self.cpu_bytes_to_use}
               if self.multi_connector and self.cpu_bytes_to_use else
               {"multi_connector": True} if self.multi_connector else {}),
            **({"speculative_method": self.speculative_method, "num_speculative_tokens": self.num_speculative_tokens,
                **({"draft_acceptance": self.draft_acceptance} if self.draft_acceptance else {}),
                **({"disable_lookahead_block_hashes": True} if self.disable_lookahead_block_hashes else {})}
               if self.speculative_method else {}),
            **({"num_workers": self.num_workers} if self.num_workers > 1 else {}),
            **({"late_worker_steps": self.late_worker_steps} if self.late_worker_steps else {}),
            **({"secondary_tier": self.secondary_tier} if self.secondary_tier else {}),
            **({"kv_events": True} if self.kv_events else {}),
            **({"pd_decode": True} if self.pd_decode else {}),
            **({"self_describing_kv_events": True} if self.self_describing_kv_events else {}),
            **({"tier_script": self.tier_script} if self.tier_script else {}),
            **({"backpressure_pattern": self.backpressure_pattern} if self.backpressure_pattern else {}),
            **({"object_store": self.object_store} if self.object_store is not None else {}),
            # Always named: `kvdoctor repro FILE` defaults to vLLM's worker, whose transfer timing
            # differs, and a finding must replay as it was found.
            "worker": self.worker,
        }


# What hypothesis draws is bytes: one uniform byte per field, read as the field's value scaled to
# its range (`byte * n >> 8`, so 0 reads as 0 and the mapping keeps order); 0 always decodes to the
# simplest choice (a `schedule`, the smallest sizes, no prefix, no gap), and shrinking lowers each
# byte towards 0 on its own. One bytes draw per event and one for the geometry, not one integer per
# field: every draw is a choice node in hypothesis' generation and shrinking bookkeeping, and four
# per event made that bookkeeping a larger share of explore's time than vLLM's scheduler (see
# benchmarks/bench_explore.py). Hypothesis' integers would also not do: they favour small values,
# where bytes are uniform.
EVENT_TABLE = ("schedule", "add", "abort", "schedule", "add", "abort", "schedule", "finish",
               "hold", "complete", "fail", "reset", "schedule", "add", "abort", "drain", "delay", "release")
# The step kind each event plays: the kinds' `explore` names (`kvdoctor.steps`). A kind declared drawn that
# the table never draws, or an event no kind declares, is kvdoctor's bug, at import.
EVENT_KINDS = {kind.explore: name for name, kind in REGISTRY.items() if isinstance(kind.explore, str)}
# Events drawn only where forced (`--force sleep-wake`: the reset and drain rows draw them, SLEEP_DRAW), not rows
FORCED_EVENTS = ("sleep", "wake_up")
if set(EVENT_KINDS) != set(EVENT_TABLE) | set(FORCED_EVENTS):
    raise InternalError(f"explore's EVENT_TABLE and the step kinds' declared events differ: "
                        f"{sorted(set(EVENT_KINDS) ^ (set(EVENT_TABLE) | set(FORCED_EVENTS)))}")
BLOCK_SIZES = (4, 2, 8, 16, 1)
MAX_NUM_SEQS = (16, 4, 2)
BATCHED_TOKENS = (256, 8, 16, 32, 64)
SIZE_KINDS = ("tokens", "chunks", "pool", "tokens")
TRANSFER_KINDS = (None, "store", "load")
# A small CPU tier (evictions, stores that find no room) in 4 KiB pages. Not every chunk fits one page
# (eagle-pair, 8-token blocks, 3 a chunk: 6 KiB): under the tiering spec `decode_geometry` raises the tier
# to one chunk (a zero-chunk tier fails its start-up); CPUOffloadingSpec builds with it (measured, 0.34.0).
CPU_TIERS = (None, None, None, 4096, 8192, 16384, 32768)
# TieringOffloadingSpec maps its whole CPU tier (a /dev/shm region) per scheduler: kvdoctor's roomy
# default (64 MiB) would cost every build; a roomy tiering tier is 256 KiB.
TIERING_ROOMY_TIER = 1 << 18
TIERING = "TieringOffloadingSpec"
SPECS = (None, None, TIERING)  # specs a release lacks are drawn as the default (see `decode`)
# Hybrid layouts (kvdoctor/models/): rarer than the single group most known bugs need.
LAYOUTS = (None, None, None, None, None, "swa-full", "mamba-hybrid", "eagle-pair")
# Layouts drawn only where forced (`--force layout=NAME`; a hunt forces them from the log): the mixed-granularity
# swa-full-mixed (its sliding-window block is 4x the full one) and the three-group mamba-swa-hybrid. Not in
# LAYOUTS, so a release's random draws (and its measured seeds) stay as they were.
# Forced only too: mamba-mtp-hybrid (Qwen3-Next with MTP: Mamba + attention + an MTP drafter group) and
# full-swa-mixed (the full-attention block 4x the sliding-window one: vLLM's alignment segments, DeepSeek V4's case).
# KV cache groups sharing the pool, per layout (the model length is what a request's blocks in all fit).
LAYOUT_GROUPS = {"swa-full": 2, "mamba-hybrid": 2, "swa-full-mixed": 2, "mamba-swa-hybrid": 3, "mamba-mtp-hybrid": 3,
                 "full-swa-mixed": 2}
# forced only: the pool holds the drawn blocks per group
SCALED_POOL_LAYOUTS = ("swa-full-mixed", "mamba-swa-hybrid", "mamba-mtp-hybrid", "full-swa-mixed")
# a drawn window (WINDOW_BLOCKS)
WINDOWED_LAYOUTS = ("swa-full", "swa-full-mixed", "mamba-swa-hybrid", "full-swa-mixed")
MAMBA_LAYOUTS = ("mamba-hybrid", "mamba-swa-hybrid", "mamba-mtp-hybrid")
DRAFTER_LAYOUTS = ("eagle-pair", "mamba-mtp-hybrid")  # a drafter with KV layers of its own (draft/config.json)
WINDOW_BLOCKS = (4, 3, 6, 8, 2)  # swa-full's sliding window, in GPU blocks (unaligned to chunks too)
# Only "align": in "none"/"all" the Mamba group's block is the whole model length, and the connector
# refuses groups of different block sizes at start-up (a server would not start).
MAMBA_MODES = ("align",)
GAPS = (0, 0, 1, 1, 2, 3, 5, 8)  # engine steps a server runs after an event, before the next one
MIN_GPU_BLOCKS, MAX_GPU_BLOCKS = 4, 24

# Features of the installed vLLM the extension byte draws (probed by `search.available_features`).
SYNC_LOADS = "sync_load_budget_bytes"  # the offloading scheduler's config reads it from the extra config
RECOMPUTE = "kv_load_failure_policy"  # a KVTransferConfig field
PREFIX_MATCH_UNIT = "prefix_match_unit"  # a CacheConfig field
EXTENSION_GATE = SYNC_LOADS  # the extension byte is drawn only where the release has this
LOAD_CAPS = "max_load_tokens"  # the offloading connector reads it (and max_offload_tokens) per request
RETENTION = "prefix_cache_retention_interval"  # a CacheConfig field
PRIORITY = "priority"  # SchedulerConfig.policy takes "priority" (every supported release)
ARC = "arc"  # the CPU tier's cache policy registry has vLLM's ARC (every supported release, probed)
# The second extension byte and each event's fifth byte are drawn only where the release has this:
SECOND_GATE = LOAD_CAPS
# A per-request cap (max_load_tokens / max_offload_tokens) in tokens: none, 0, a block, a chunk and
# one token either side of a chunk (a cap not on a chunk boundary).
CAPS = (None, None, None, 0, "block", "chunk-1", "chunk", "chunk+1")
PRIORITIES = (0, 1, -1, 2)  # an add's priority under the priority policy (lower is served first)
RETENTION_CHUNKS = (None, 1, 2, None)  # prefix_cache_retention_interval in chunks
# vLLM refuses a positive interval without such a group
RETAINING_LAYOUTS = ("swa-full", "mamba-hybrid", "swa-full-mixed", "mamba-swa-hybrid", "mamba-mtp-hybrid",
                     "full-swa-mixed")
# The sync-load budget: none, one chunk's KV (a hit beyond it loads asynchronously), or everything.
SYNC_BUDGETS = (None, "chunk", "all", None)
ALL_BYTES = 1 << 40
PREFIX_MATCH_DIVISORS = (None, 2, 4, None)  # prefix_match_unit = block_size / divisor
ROLES = (None, "multi", "kv_consumer", "kv_producer")


# Speculative decoding (`decode_speculative`): one more geometry byte, after the extension byte, drawn
# where the release has 0.34's speculative machinery in the offloading path (lookahead block hashes or the
# EAGLE block drop, probed by `search.available_features`) or where explore is asked to (`ExploreConfig.
# speculative`); elsewhere no byte is drawn, so a release's examples (and its measured seeds) stay as they were.
SPECULATIVE_DRAW = "speculative"
NO_LOOKAHEAD_HASHES = "disable_lookahead_block_hashes"  # a SpeculativeConfig field (0.34): bit 7 draws it
# eagle twice: it is what reaches 0.34's lookahead hashes and EAGLE block drop (ngram reaches neither)
SPECULATIVE_METHODS = (None, "eagle", "ngram", "eagle")
# Accepted drafts per verification, cycled (None: every draft accepted): rejections roll a request back.
DRAFT_ACCEPTANCE = (None, "0", "1,0", "0,2,1", "1", "2,0,0", "0,0,3", "3,1")


# Withheld block hashes on every request (`--force withheld-hashes`): each add is followed by a `delay` of that
# request's block hashes (its offload keys lag its tokens from then on: K6's mechanism, P/D decode nodes, lookahead
# hashes), so a crash whose statement compares offload keys with tokens is drawn towards; no byte of its own (the
# draws of a release, and its seeds, stay as they were where it is not forced).
WITHHELD_DRAW = "withheld_hashes"


# vLLM's sleep mode (`--force sleep-wake`; a hunt forces it where its log names sleep mode): EngineCore.sleep /
# wake_up, so the example plays at --engine core (kvdoctor's scheduler harness cannot pause the engine). No byte of
# its own: under the force the `reset` row (3 in 4 of its draws), the `drain` row (every one: at core, a drain
# under async scheduling is not playable) and the fourth `schedule` row (`SLEEP_ROWS`) draw a sleep instead, from
# that row's bytes (measured: 143 of 300 drawn examples hold a sleep): the level (1 or 2), the mode (keep /
# abort), the connector's cache kept (reset_connector = false, where the release's sleep takes it: a probe; its held
# transfers are completed first, as the sleep's drain waits for them), the steps slept through and the events
# before the wake_up (0-7: requests arrive, abort, transfers finish while asleep). Block hashes cannot be
# withheld at core, so an example with a sleep drops its delay / release events (and `sleep_geometry` its workers,
# drafts and drafter layout). Unforced, a release's draws and seeds stay as they were.
SLEEP_DRAW = "sleep_wake"
SLEEP_ROWS = (12, 15)  # EVENT_TABLE's fourth `schedule` and its `drain`: every draw a sleep where forced
if [EVENT_TABLE[row] for row in SLEEP_ROWS] != ["schedule", "drain"]:
    raise InternalError("explore's SLEEP_ROWS must name EVENT_TABLE's fourth schedule row and its drain row")
SLEEP_KEEPS_CONNECTOR = "sleep_reset_connector"  # the release's EngineCore.sleep takes reset_connector (probed)


def sleep_geometry(geometry: Geometry, features: frozenset[str]) -> Geometry:
    """The geometry of an example that drew a sleep: marked (it plays at --engine core), less what that level cannot
    run: a layout with EAGLE drafter layers is drawn as one full-attention group (the engine flags a drafter's group
    only under a draft model's config: `levels.core.setup_unexpressible`), one worker (vLLM's engine would start an
    executor per worker) and no speculative decoding (kvdoctor stands in for the drafter at the scheduler level only;
    `Setup.validate` refuses both at core). Examples without a sleep keep them, at the scheduler level."""
    changes: dict[str, Any] = {"sleep_wake": True, "sleep_keeps_connector": SLEEP_KEEPS_CONNECTOR in features,
                               "num_workers": 1, "late_worker_steps": 0, "fail_worker": None,
                               "speculative_method": None, "num_speculative_tokens": 2, "draft_acceptance": None,
                               "disable_lookahead_block_hashes": False}
    if geometry.layout in DRAFTER_LAYOUTS:
        changes["layout"] = None
    return dataclasses.replace(geometry, **changes)


# A P/D decode node (`--force pd-decode`; a hunt forces it where its log names P/D, NIXL or a MultiConnector):
# vLLM's MultiConnector with kvdoctor's NIXL stand-in first ([setup] pd_decode), every other request a remote
# prefill (do_remote_prefill; the first is), every fourth's load failing (`pd_fail`), vLLM recomputing where the
# drawn failure policy is unset. No byte of its own: a release's draws, and its seeds, stay as they were unforced.
PD_DRAW = "pd_decode"


def pd_decode_geometry(geometry: Geometry, worker: str) -> Geometry:
    """The geometry on a P/D decode node: the stand-in replaces the MultiConnector's drawn second connector and
    several workers (it reports once); vLLM's worker has no stand-in side, so it is left as drawn."""
    if worker != "simulated":
        return geometry
    return dataclasses.replace(geometry, pd_decode=True, multi_connector=False, num_workers=1, late_worker_steps=0,
                               fail_worker=None, kv_load_failure_policy=geometry.kv_load_failure_policy or "recompute")


def withhold_every_request(events: tuple[tuple[Any, ...], ...]) -> tuple[tuple[Any, ...], ...]:
    """The events with a `delay` of each added request's block hashes right after its add."""
    out: list[tuple[Any, ...]] = []
    for event in events:
        out.append(event)
        if event[0] == "add":
            out.append(("delay", 0))
    return tuple(out)


def decode_speculative(geometry: Geometry, byte: int, worker: str = "simulated",
                       features: frozenset[str] = frozenset()) -> Geometry:
    """The speculative byte (bits: 0-1 the method, 2-3 num_speculative_tokens - 1, 4-6 the draft
    acceptance, 7 eagle without lookahead block hashes where the release has them: its trailing-block
    drop instead); 0 is no speculative decoding. The stand-in drafter runs beside the simulated worker
    only, so vLLM's worker draws none."""
    method = SPECULATIVE_METHODS[byte & 3]
    if method is None or worker != "simulated":
        return geometry
    if geometry.layout in DRAFTER_LAYOUTS:  # a drafter with KV layers of its own: EAGLE (MTP is use_eagle() too)
        method = "eagle"
    return dataclasses.replace(geometry, speculative_method=method, num_speculative_tokens=1 + (byte >> 2 & 3),
                               draft_acceptance=DRAFT_ACCEPTANCE[byte >> 4 & 7],
                               disable_lookahead_block_hashes=bool(byte >> 7) and method == "eagle"
                               and NO_LOOKAHEAD_HASHES in features)


# Several workers (`decode_workers`): one more geometry byte, the last, drawn where the offloading scheduler
# counts each job's reports to world_size and vLLM has the executor's aggregator (probed by
# `search.available_features`); elsewhere no byte is drawn, so a release's seeds stay as they were.
WORKERS_DRAW = "num_workers"
WORKER_COUNTS = (1, 2, 4, 2)
LATENESS = (0, 0, 1, 2, 3, 0, 1, 5)  # steps the last worker reports behind the others
FAIL_WORKERS = (None, "last", "first", None)  # whose alone a fail event is (None: every worker's)


def decode_workers(geometry: Geometry, byte: int, worker: str = "simulated") -> Geometry:
    """The workers byte (bits: 0-1 the number of workers, 2-4 the last one's lateness, 5-6 which worker
    alone fails a failed job); 0 is one worker. kvdoctor stands in for several workers with the
    simulated worker only, so vLLM's worker draws none."""
    count = WORKER_COUNTS[byte & 3]
    if count == 1 or worker != "simulated" or geometry.multi_connector:  # Setup refuses the multi_connector pair
        return geometry
    fail = FAIL_WORKERS[byte >> 5 & 3]
    # vLLM's cpu_bytes_to_use holds every worker's copy of a chunk (CPUOffloadingSpec: num_copies =
    # world_size): scaled, the drawn tier holds as many chunks as with one worker. Unscaled, a small tier
    # held none, and TieringOffloadingSpec's start-up raised `ValueError: range() arg 3 must not be zero`
    # (as it does with one worker and a tier under one chunk: measured on 0.34.0), a refusal, not a finding.
    cpu = geometry.cpu_bytes_to_use * count if geometry.cpu_bytes_to_use else geometry.cpu_bytes_to_use
    return dataclasses.replace(geometry, num_workers=count, late_worker_steps=LATENESS[byte >> 2 & 7],
                               cpu_bytes_to_use=cpu,
                               fail_worker=None if fail is None else count - 1 if fail == "last" else 0)


# A secondary tier (`decode_tier`): one more geometry byte, the last (after the workers byte), drawn where the
# release's tiering spec has an fs secondary tier and 0.34's deferred write release (probed by
# `search.available_features`): where the promotion / cascade bugs would be new; elsewhere no byte is
# drawn, so a release's examples (and its measured seeds) stay as they were.
TIER_DRAW = "secondary_tier"
# The CPU tier under a secondary tier, in chunks (each padded to whole 4 KiB pages, as the tiering spec
# pads them): small, so chunks are evicted from it and promoted back from the fs tier; None keeps the
# geometry's own. Never below one chunk: vLLM 0.34's tiering spec fails at start-up on a zero-chunk tier
# (shared_offload_region.py:144, "range() arg 3 must not be zero"; found by explore with a 4 KiB tier
# and 6 KiB chunks, with or without the secondary tier).
TIER_CPU_CHUNKS = (1, 2, 4, None)


def decode_tier(geometry: Geometry, byte: int, worker: str = "simulated",
                features: frozenset[str] = frozenset()) -> Geometry:
    """The tier byte (bit 0: an fs secondary tier under TieringOffloadingSpec; bits 1-2 its CPU tier,
    `TIER_CPU_CHUNKS`); 0 is no secondary tier. Not under MultiConnector (its second connector would
    share the first's tier directory), nor with vLLM's worker on a CPU (`Setup.vllm_worker_unsupported`)."""
    if not byte & 1 or geometry.multi_connector or worker != "simulated":
        return geometry
    chunks = TIER_CPU_CHUNKS[byte >> 1 & 3]
    chunk_bytes = tier_chunk_bytes(geometry)
    if chunks is not None:
        cpu = chunks * chunk_bytes
    else:
        own = geometry.cpu_bytes_to_use if geometry.spec_name == TIERING else None
        cpu = max(own or TIERING_ROOMY_TIER, chunk_bytes)
    from kvdoctor.explore.tier_draw import example_tier_kind, objstore_fields, scripted_tier_fields  # bits 3-7

    tiers, script, pattern = scripted_tier_fields(byte, features)
    tiers = example_tier_kind(byte, features, tiers)
    return dataclasses.replace(geometry, spec_name=TIERING, cpu_bytes_to_use=cpu, secondary_tier=tiers,
                               tier_script=script, backpressure_pattern=pattern,
                               object_store=objstore_fields(byte, features))


# KV events (`decode_kv_events`): one more geometry byte, the last (after the tier byte), drawn where the connector
# describes a store from its request's context (0.34's events tracker, `on_new_request`; probed by
# `search.available_features`); elsewhere no byte is drawn, so a release's seeds stay as they were.
EVENTS_DRAW = "kv_events"
SELF_DESCRIBING_DRAW = "self_describing_kv_events"  # the connector's events config takes it (probed)


def decode_kv_events(geometry: Geometry, byte: int, features: frozenset[str]) -> Geometry:
    """The events byte's bit 0: vLLM's KV events on (`KVEventsConfig`); bit 1: with self-describing payloads where
    the release has them; 0 is no events. Not under MultiConnector (two connectors' CPU events share one stream)."""
    if not byte & 1 or EVENTS_DRAW not in features or geometry.multi_connector:
        return geometry
    return dataclasses.replace(geometry, kv_events=True,
                               self_describing_kv_events=bool(byte >> 1 & 1) and SELF_DESCRIBING_DRAW in features)


def tier_chunk_bytes(geometry: Geometry) -> int:
    """One chunk of the geometry's KV in the tiering spec's CPU tier: padded to whole 4 KiB pages, as the
    spec pads it."""
    return -(-kv_bytes_per_token(geometry) * geometry.chunk_tokens // 4096) * 4096


def kv_bytes_per_token(geometry: Geometry) -> int:
    """KV bytes one token takes in the geometry's layout (the sync-load budget is counted in them, as
    the offloading scheduler counts its loads: tokens x kv_bytes_per_token)."""
    layout = resolve_layout(None, geometry.layout, geometry.sliding_window)
    return max(1, layout.page_bytes(geometry.block_size) // geometry.block_size)


def decode_extension(geometry: Geometry, byte: int, features: frozenset[str], worker: str = "simulated"
                     ) -> Geometry:
    """The extension byte (bits: 0-1 the sync-load budget, 2 the recompute policy, 3-4 the
    prefix_match_unit divisor, 5-6 the connector's deployment); 0 is the plain geometry, and a
    feature the release lacks (or the geometry cannot take) is drawn as its default."""
    changes: dict[str, Any] = {}
    budget = SYNC_BUDGETS[byte & 3]
    if budget is not None and SYNC_LOADS in features:
        changes["sync_load_budget_bytes"] = (ALL_BYTES if budget == "all"
                                             else geometry.chunk_tokens * kv_bytes_per_token(geometry))
    if byte >> 2 & 1 and RECOMPUTE in features:
        changes["kv_load_failure_policy"] = "recompute"
    divisor = PREFIX_MATCH_DIVISORS[byte >> 3 & 3]
    # vLLM takes a prefix_match_unit only with several KV cache groups, dividing every group's block
    # size (a single group's hits land on its block: it refuses any other unit at start-up); swa-full's
    # groups share the block size, Mamba's align mode grows its own block (not drawn).
    if (divisor and PREFIX_MATCH_UNIT in features and geometry.layout == "swa-full"
            and geometry.block_size % divisor == 0):
        changes["prefix_match_unit"] = geometry.block_size // divisor
    role = ROLES[byte >> 5 & 3]
    if role == "multi" and worker == "simulated":  # vLLM's worker does not drive kvdoctor's second connector
        changes["multi_connector"] = True
    elif role in ("kv_consumer", "kv_producer"):
        changes["kv_role"] = role
    return dataclasses.replace(geometry, **changes) if changes else geometry


def decode_second_extension(geometry: Geometry, byte: int, features: frozenset[str]) -> Geometry:
    """The second extension byte (bits: 0-1 the retention interval in chunks, 2 the priority policy, 3 the
    CPU tier's ARC eviction policy); 0 is the geometry as it was, and a feature the release lacks (or the
    layout cannot take) its default. ARC is in this byte (drawn where the connector reads per-request caps)
    although every supported release has it: a byte of its own would have changed every release's seeds."""
    changes: dict[str, Any] = {}
    chunks = RETENTION_CHUNKS[byte & 3]
    if chunks and RETENTION in features and geometry.layout in RETAINING_LAYOUTS:
        changes["prefix_cache_retention_interval"] = chunks * geometry.chunk_tokens
    if byte >> 2 & 1 and PRIORITY in features:
        changes["scheduling_policy"] = "priority"
    if byte >> 3 & 1 and ARC in features:
        changes["eviction_policy"] = ARC
    return dataclasses.replace(geometry, **changes) if changes else geometry


def cap_tokens(geometry: Geometry, choice: str | int | None) -> int | None:
    """A CAPS entry in tokens at this geometry."""
    if choice is None or isinstance(choice, int):
        return choice
    chunk = geometry.chunk_tokens
    return {"block": geometry.block_size, "chunk-1": max(1, chunk - 1), "chunk": chunk,
            "chunk+1": chunk + 1}[choice]


def pool_blocks(drawn: int, layout: str | None) -> int:
    """The GPU pool of a drawn size: the forced-only layouts' hold the drawn usable blocks for each of their groups
    (as `--model` pools are planned), so their requests are as long, against the pool, as a one-group layout's.
    Three groups in 4-24 blocks left requests of at most 7 blocks, no longer than most drawn sliding windows (0
    of 7,788 examples reached K7's diverged hit in a 600 s hunt); swa-full-mixed's prompts stayed under two of
    its sliding-window chunks, so no hit could end inside a stored sliding-window chunk past the first (K3's and
    K12's case; measured: 19 of 6,120 examples reached prepare_load). The other layouts keep the drawn pool
    (their examples, as measured, stay as they were)."""
    if layout not in SCALED_POOL_LAYOUTS:
        return drawn
    return (drawn - 1) * LAYOUT_GROUPS[layout] + 1


def decode_geometry(fields: tuple[int, ...], specs: frozenset[str] | None = None,
                    layouts: tuple[str | None, ...] = ()) -> Geometry:
    """`specs`: the offloading specs the installed vLLM has (None: every one drawn is taken); `layouts`: the
    forced layouts (`--force layout=NAME`; the layout field then picks one of them), () the random draw."""
    (block_size, blocks_per_chunk, gpu_blocks, seqs, batched, is_async, cpu_tier, decode_offload,
     spec, layout, layout_arg) = fields
    max_num_seqs = MAX_NUM_SEQS[seqs]
    spec_name = SPECS[spec]
    if spec_name is not None and specs is not None and spec_name not in specs:
        spec_name = None
    cpu = CPU_TIERS[cpu_tier]
    if spec_name == TIERING and cpu is None:
        cpu = TIERING_ROOMY_TIER
    layout_name = layouts[layout % len(layouts)] if layouts else LAYOUTS[layout]
    bs = BLOCK_SIZES[block_size]
    geometry = Geometry(block_size=bs, blocks_per_chunk=1 + blocks_per_chunk,
                        gpu_blocks=pool_blocks(MIN_GPU_BLOCKS + gpu_blocks, layout_name), max_num_seqs=max_num_seqs,
                        max_num_batched_tokens=max(BATCHED_TOKENS[batched], max_num_seqs),
                        async_scheduling=bool(is_async), cpu_bytes_to_use=cpu,
                        offload_prompt_only=not decode_offload, spec_name=spec_name, layout=layout_name,
                        sliding_window=bs * WINDOW_BLOCKS[layout_arg % len(WINDOW_BLOCKS)]
                        if layout_name in WINDOWED_LAYOUTS else None,
                        mamba_cache_mode=MAMBA_MODES[layout_arg % len(MAMBA_MODES)]
                        if layout_name in MAMBA_LAYOUTS else None)
    if spec_name == TIERING and cpu is not None and cpu < tier_chunk_bytes(geometry):
        # vLLM 0.34's tiering spec fails at start-up on a tier below one chunk (`TIER_CPU_CHUNKS`): a
        # refusal, never a finding; the smallest tier it takes is one chunk
        geometry = dataclasses.replace(geometry, cpu_bytes_to_use=tier_chunk_bytes(geometry))
    return geometry


def decode_event(row: int, a: int, b: int, c: int, d: int = 0, *, sleep: bool = False) -> tuple[tuple[Any, ...], ...]:
    """One abstract event (as `event_steps` reads it), then the engine steps that run before
    the next event, from a row of EVENT_TABLE and three bytes:

    - schedule: count = 1 + a % MAX_SCHEDULE_COUNT
    - add: a = prompt size (a // 64: tokens, chunks, pool, tokens; a >= 224: fill_pool;
      tokens = 1 + a % 64, chunks = 1 + a % 8, pool = (1 + a % 8) eighths of the longest
      admissible prompt); b = max_tokens - 1 (b % 16) and the gap (b // 32); c = the shared
      prefix (c < 128: none; else with request (c // 8) % 16, for 1-7 chunks (c % 8 < 7) or
      that request's whole prompt); d (drawn only where the connector reads per-request caps) =
      max_load_tokens (CAPS[d & 7]), max_offload_tokens (CAPS[d >> 3 & 7]), the priority
      (PRIORITIES[d >> 6], played only under the priority policy)
    - abort, finish: a = the request (a % 16); b = the gap
    - hold / complete / fail transfers: a = the request (a % 6: 0 every request, else
      request a % 6 - 1); b = the kind (any, store, load); c = the gap
    - reset_prefix_cache: a & 1 reset_running_requests, b & 1 reset_connector; c = the gap
    - drain (apply the async output in flight, as an engine going idle does): a = the gap
    - sleep (`sleep`: `--force sleep-wake` only; SLEEP_ROWS, and the reset row where a >> 1 & 3): a >> 3 & 1 =
      level 2 (else 1), b >> 1 & 1 mode abort (else keep), b >> 2 & 1 the connector's cache kept, c = the gap,
      c >> 3 & 7 the events (and gaps) played asleep before the wake_up
    - delay / release block hashes (a request's block hashes, so its offload keys, arrive
      later than its blocks, as in P/D, hybrid models, lookahead hashes): a = the request
      (a % 16); b = the gap
    A request number k names the k-th latest request added so far (0: the latest), modulo
    how many there are.
    """
    action = EVENT_TABLE[row]
    gap = 0
    if sleep and (row in SLEEP_ROWS or (action == "reset" and a >> 1 & 3)):
        event: tuple[Any, ...] = ("sleep", 1 + (a >> 3 & 1), PAUSE_MODES[b >> 1 & 1], bool(b >> 2 & 1), c >> 3 & 7)
        gap = GAPS[c % 8]
    elif action == "schedule":
        event = ("schedule", 1 + a % MAX_SCHEDULE_COUNT)
    elif action == "add":
        kind = SIZE_KINDS[a // 64] if a < 224 else "fill"  # fill_pool: one add in eight
        size = ("fill",) if kind == "fill" else (kind, 1 + (a % 64 if kind == "tokens" else a % 8))
        prefix = None if c < 128 else ((c // 8) % 16, None if c % 8 == 7 else c % 8 + 1)
        event, gap = ("add", size, 1 + b % 16, prefix), GAPS[b // 32]
        if d:
            event += ((CAPS[d & 7], CAPS[d >> 3 & 7], PRIORITIES[d >> 6]),)
    elif action in ("abort", "finish", "delay", "release"):
        event, gap = (action, a % 16), GAPS[b % 8]
    elif action in ("hold", "complete", "fail"):
        target = a % 6
        event, gap = (action, None if target == 0 else target - 1, TRANSFER_KINDS[b % 3]), GAPS[c % 8]
    elif action == "reset":
        event, gap = ("reset", bool(a & 1), bool(b & 1)), GAPS[c % 8]
    else:
        event, gap = ("drain",), GAPS[a % 8]
    return (event, ("schedule", gap)) if gap else (event,)


# How many values each geometry field takes, in `decode_geometry`'s order.
GEOMETRY_RANGES = (len(BLOCK_SIZES), 4, MAX_GPU_BLOCKS - MIN_GPU_BLOCKS + 1, len(MAX_NUM_SEQS),
                   len(BATCHED_TOKENS), 2, len(CPU_TIERS), 2, len(SPECS), len(LAYOUTS), 8)
EVENT_BYTES = 4  # the row of EVENT_TABLE, then a, b, c


def scaled(byte: int, n: int) -> int:
    """A uniform byte as one of n values, order kept (0 stays 0)."""
    return byte * n >> 8


def geometry_fields(raw: bytes) -> tuple[int, ...]:
    return tuple(scaled(byte, n) for byte, n in zip(raw, GEOMETRY_RANGES, strict=False))


def event_fields(raw: bytes) -> tuple[int, ...]:
    """(row, a, b, c), and d where the event has a fifth byte (`raw_examples(second=True)`)."""
    return (scaled(raw[0], len(EVENT_TABLE)), *raw[1:])


@cache
def raw_examples(max_events: int, extended: bool = False, second: bool = False,
                 speculative: bool = False, workers: bool = False, tier: bool = False,
                 events: bool = False) -> st.SearchStrategy[Any]:
    """(geometry bytes, [event bytes, ...]): decoded by `Example.decode`. `extended`: one more
    geometry byte, the extension (`decode_extension`), after the others; `second` (with `extended`):
    the second extension byte after it (`decode_second_extension`) and a fifth byte per event;
    `speculative`: one more geometry byte (`decode_speculative`); `workers`: one more
    (`decode_workers`); `tier`: one more (`decode_tier`); `events`: one more, last (`decode_kv_events`)."""
    second = extended and second
    size = len(GEOMETRY_RANGES) + sum(map(bool, (extended, second, speculative, workers, tier, events)))
    event_size = EVENT_BYTES + (1 if second else 0)
    return st.tuples(st.binary(min_size=size, max_size=size),
                     st.lists(st.binary(min_size=event_size, max_size=event_size),
                              min_size=1, max_size=max_events))


@dataclass(frozen=True)
class Example:
    geometry: Geometry
    events: tuple[tuple[Any, ...], ...]

    @classmethod
    def decode(cls, raw: Any, specs: frozenset[str] | None = None, worker: str = "simulated",
               features: frozenset[str] = frozenset(), layouts: tuple[str | None, ...] = ()) -> Example:
        """The example hypothesis drew (`raw_examples`; an extension byte after the geometry's where
        `features` holds the gate)."""
        geometry, events = raw
        extra = list(geometry[len(GEOMETRY_RANGES):])
        events_byte = extra.pop() if EVENTS_DRAW in features and extra else 0
        tier = extra.pop() if TIER_DRAW in features and extra else 0
        workers = extra.pop() if WORKERS_DRAW in features and extra else 0
        speculative = extra.pop() if SPECULATIVE_DRAW in features and extra else 0
        extension = extra[0] if extra else 0
        second = extra[1] if len(extra) > 1 else 0
        return cls.from_fields(geometry_fields(geometry), [event_fields(event) for event in events], specs, worker,
                               features, extension, second, speculative, workers, tier, events_byte, layouts)

    @classmethod
    def from_fields(cls, geometry: tuple[int, ...], events: list[tuple[int, ...]],
                    specs: frozenset[str] | None = None, worker: str = "simulated",
                    features: frozenset[str] = frozenset(), extension: int = 0, second: int = 0,
                    speculative: int = 0, workers: int = 0, tier: int = 0, events_byte: int = 0,
                    layouts: tuple[str | None, ...] = ()) -> Example:
        """The example of these field values (`decode_geometry`'s, `decode_extension`'s,
        `decode_second_extension`'s, `decode_speculative`'s and `decode_event`'s)."""
        decoded_geometry = decode_geometry(geometry, specs, layouts)
        if worker != "simulated":
            decoded_geometry = dataclasses.replace(decoded_geometry, worker=worker)
        if extension:
            decoded_geometry = decode_extension(decoded_geometry, extension, features, worker)
        if second:
            decoded_geometry = decode_second_extension(decoded_geometry, second, features)
        if speculative:
            decoded_geometry = decode_speculative(decoded_geometry, speculative, worker, features)
        # the tier before the workers: decode_workers scales the CPU tier the tier byte sized (vLLM's
        # cpu_bytes_to_use holds a copy per worker; unscaled, a one-chunk tier held none with 2 workers)
        if tier:
            decoded_geometry = decode_tier(decoded_geometry, tier, worker, features)
        if events_byte:
            decoded_geometry = decode_kv_events(decoded_geometry, events_byte, features)
        if workers:
            decoded_geometry = decode_workers(decoded_geometry, workers, worker)
        if PD_DRAW in features:
            decoded_geometry = pd_decode_geometry(decoded_geometry, worker)
        sleep = SLEEP_DRAW in features
        decoded = tuple(event for fields in events for event in decode_event(*fields, sleep=sleep))
        if sleep and any(event[0] == "sleep" for event in decoded):
            decoded_geometry = sleep_geometry(decoded_geometry, features)
        if WITHHELD_DRAW in features:
            decoded = withhold_every_request(decoded)
        if not decoded_geometry.sleep_wake and any(event[0] == "delay" for event in decoded):  # a sleep drops them
            decoded_geometry = dataclasses.replace(decoded_geometry, enable_prefix_caching=False)
        return cls(decoded_geometry, decoded)


def examples(max_events: int, extended: bool = False, second: bool = False,
             speculative: bool = False, workers: bool = False, tier: bool = False,
             events: bool = False) -> st.SearchStrategy[Any]:
    """What hypothesis draws: raw bytes, cheap to draw and to shrink (no `.map`/`builds` layers,
    each of which costs a Python call per draw); `Example.decode` reads them."""
    return raw_examples(max_events, extended, second, speculative, workers, tier, events)


def mode_variants(example: Example, both: bool) -> list[Example]:
    """The example under its drawn scheduling mode, then (if `both`) under the other one: the
    same events cost one hypothesis draw and cover sync and async scheduling."""
    if not both:
        return [example]
    other = dataclasses.replace(example.geometry, async_scheduling=not example.geometry.async_scheduling)
    return [example, dataclasses.replace(example, geometry=other)]


def request_name(index: int) -> str:
    return chr(ord("A") + index) if index < 26 else f"R{index}"


def event_steps(example: Example) -> list[Step]:
    """The recipe steps of an example's events (without the settle tail)."""
    g = example.geometry
    mml = g.max_model_len
    names: list[str] = []
    lengths: dict[str, int] = {}
    steps: list[Step] = []
    withheld: set[str] = set()  # requests whose block hashes are delayed now
    asleep_for: int | None = None  # a sleep's events left before its wake_up (None: awake)

    def pick(k: int) -> str:
        """Counted back from the latest request (0: the latest), so that deleting an earlier
        `add` while shrinking leaves later references pointing at the same request."""
        return names[-1 - k % len(names)]

    def schedule(count: int) -> None:
        if steps and steps[-1].action == "schedule":
            count += steps[-1].args.get("count", 1)
            steps.pop()
        steps.append(Step(EVENT_KINDS["schedule"], {"count": count} if count > 1 else {}, 0))

    for event in example.events:
        action = event[0]
        if asleep_for is not None:
            if asleep_for == 0:
                steps.append(Step(EVENT_KINDS["wake_up"], {}, 0))
                asleep_for = None
            else:
                asleep_for -= 1
        if action == "sleep":
            if asleep_for is None:  # a sleep drawn while asleep is dropped
                _, level, mode, keep, asleep_for = event
                sleep_args: dict[str, Any] = {"level": level, "mode": mode}
                if keep and g.sleep_keeps_connector:  # the sleep's drain waits for the connector's transfers
                    steps.append(Step(EVENT_KINDS["complete"], {}, 0))
                    sleep_args["reset_connector"] = False
                steps.append(Step(EVENT_KINDS["sleep"], sleep_args, 0))
        elif action == "schedule":
            schedule(event[1])
        elif action == "add":
            _, size, max_tokens, prefix, *caps = event
            rid = request_name(len(names))
            args: dict[str, Any] = {"request": rid}
            if size[0] == "fill" and g.gpu_blocks >= 3 and g.groups == 1:  # plan_fill plans one group
                args["fill_pool"] = True
                length = (g.gpu_blocks - 2) * g.block_size
            elif size[0] == "chunks" and size[1] * g.chunk_tokens <= mml - 1:
                args["prompt_chunks"] = size[1]
                length = size[1] * g.chunk_tokens
            else:
                n = size[1] if len(size) > 1 else 0
                wanted = {"tokens": n, "chunks": n * g.chunk_tokens,
                          "pool": -(-n * (mml - 1) // 8), "fill": mml - 1}[size[0]]
                length = max(1, min(wanted, mml - 1))
                args["prompt_tokens"] = length
            args["max_tokens"] = max(1, min(max_tokens, mml - length))
            if prefix is not None and names:
                other = pick(prefix[0])
                chunks = prefix[1]  # None: the other request's whole prompt
                shared = lengths[other] if chunks is None else chunks * g.chunk_tokens
                shared = min(shared, length, lengths[other])
                if shared >= 1:
                    args["shared_prefix_with"] = other
                    args["shared_prefix_tokens"] = shared
            if caps:  # (max_load_tokens, max_offload_tokens, priority): the fifth byte's
                load_cap, offload_cap, priority = caps[0]
                params = {key: value for key, value in (("max_load_tokens", cap_tokens(g, load_cap)),
                                                        ("max_offload_tokens", cap_tokens(g, offload_cap)))
                          if value is not None}
                if params:
                    args["kv_transfer_params"] = params
                if priority and g.scheduling_policy == "priority":  # vLLM ignores it under fcfs
                    args["priority"] = priority
            if g.pd_decode and len(names) % 2 == 0:  # a remote prefill: the stand-in loads its prompt
                args["kv_transfer_params"] = {**args.get("kv_transfer_params", {}), "do_remote_prefill": True}
            names.append(rid)
            lengths[rid] = length
            steps.append(Step(EVENT_KINDS[action], args, 0))
            if g.pd_decode and len(names) % 4 == 3:  # every fourth request's remote load fails
                steps.append(Step("pd_fail", {"request": rid}, 0))
        elif action in ("abort", "finish"):
            if names:
                steps.append(Step(EVENT_KINDS[action], {"request": pick(event[1])}, 0))
        elif action in ("delay", "release"):
            if names and not g.sleep_wake:  # at --engine core vLLM's engine hashes blocks itself
                rid = pick(event[1])
                if (rid in withheld) == (action == "release"):  # only a change: delay once, release once
                    (withheld.add if action == "delay" else withheld.discard)(rid)
                    steps.append(Step(EVENT_KINDS[action], {"request": rid}, 0))
        elif action in ("hold", "complete", "fail"):
            _, target, kind = event
            args = {}
            if target is not None:
                if not names:
                    continue
                args["request"] = pick(target)
            if kind is not None:
                args["kind"] = kind
            if action == "fail" and g.fail_worker is not None:
                args["worker"] = g.fail_worker
            steps.append(Step(EVENT_KINDS[action], args, 0))
        elif action == "reset":
            _, running, connector = event
            args = {}
            if running:
                args["reset_running_requests"] = True
            if connector:
                args["reset_connector"] = True
            steps.append(Step(EVENT_KINDS[action], args, 0))
        elif action == "drain":
            steps.append(Step(EVENT_KINDS[action], {}, 0))
        else:  # pragma: no cover - the strategy draws only the events above
            raise ValueError(f"unknown event {event!r}")
    if asleep_for is not None:  # the engine wakes before the settle tail
        steps.append(Step(EVENT_KINDS["wake_up"], {}, 0))
    # Late hashes arrive in the end: the settle tail then judges a request whose keys all exist.
    steps.extend(Step(EVENT_KINDS["release"], {"request": rid}, 0) for rid in names if rid in withheld)
    return steps


def settle_tail(steps: list[Step], late_steps: int = 0) -> list[Step]:
    """`schedule`, release every transfer, then SETTLE_STEPS more steps (and `late_steps` more: a late
    worker's reports arrive that much later, and vLLM completes a job only with the last one)."""
    steps = list(steps)
    if steps and steps[-1].action == "schedule":
        last = steps.pop()
        count = last.args.get("count", 1) + 1
    else:
        count = 1
    steps.append(Step("schedule", {"count": count} if count > 1 else {}, 0))
    steps.append(Step("complete_transfers", {}, 0))
    steps.append(Step("schedule", {"count": SETTLE_STEPS + late_steps}, 0))
    return steps


def to_recipe(example: Example, name: str = "explore", summary: str = "generated by kvdoctor explore") -> Recipe:
    steps = settle_tail(event_steps(example), example.geometry.late_worker_steps)
    return Recipe(name=name, summary=summary, signature=PLACEHOLDER_SIGNATURE, steps=tuple(steps),
                  setup=example.geometry.setup_dict())
