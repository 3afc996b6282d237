"""The one table of vLLM's private names (and of names that moved between releases) kvdoctor relies on.

Every read of such a name in the adapter goes through an entry here (`get`, `has`, `setter`), so a
rename upstream is one new spelling in one row. An entry says where vLLM defines the name (module,
and the class whose attribute it is), its spellings across releases (the current one first), and,
where a release may lack every spelling, what the adapter does then (`absent`): a probe answers
"not here" and the adapter takes another path. An entry without `absent` is required: its absence
fails a feature probe (exit 3). `tests/test_vllm_private_names.py` checks the table against the
source of every installed release, and that the adapter spells no private vLLM name outside it.

Function entries are also crash-site names: a recipe naming any spelling of a function matches the
statement under whichever spelling holds it in the installed release (`function_spellings`).

`portable.py` (copied verbatim into exported scripts, which import neither kvdoctor nor this
module) spells its few names itself; the test checks those are rows of this table too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvdoctor.errors import IncompatibleVllmError

OFFLOADING_SCHEDULER_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler"
OFFLOADING_COMMON_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.common"
MULTI_CONNECTOR_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.multi_connector"
SPEC_FACTORY_MODULE = "vllm.v1.kv_offload.factory"
TIERING_PACKAGE = "vllm.v1.kv_offload.tiering"
TIER_FACTORY_MODULE = "vllm.v1.kv_offload.tiering.factory"
EXAMPLE_TIER_MODULE = "vllm.v1.kv_offload.tiering.example.manager"  # vLLM's in-memory example tier (issue 36)
TIERING_MANAGER_MODULE = "vllm.v1.kv_offload.tiering.manager"
ASYNC_LOOKUP_MODULE = "vllm.v1.kv_offload.tiering.async_lookup"
FS_TIER_MODULE = "vllm.v1.kv_offload.tiering.fs.manager"
TIER_BASE_MODULE = "vllm.v1.kv_offload.tiering.base"
TIER_BACKPRESSURE_MODULE = "vllm.v1.kv_offload.tiering.backpressure"
CPU_MANAGER_MODULE = "vllm.v1.kv_offload.cpu.manager"
KV_TRANSFER_STATE_MODULE = "vllm.distributed.kv_transfer.kv_transfer_state"
RUNNER_MIXIN_MODULE = "vllm.v1.worker.kv_connector_model_runner_mixin"
ENGINE_CORE_MODULE = "vllm.v1.engine.core"
BACKEND_UTILS_MODULE = "vllm.v1.attention.backends.utils"
VLLM_CONFIG_MODULE = "vllm.config.vllm"
CPU_MANAGER_MODULE = "vllm.v1.kv_offload.cpu.manager"


@dataclass(frozen=True)
class VllmName:
    """One name vLLM defines that kvdoctor reads, in every spelling it had across releases."""

    module: str  # the vLLM module that defines it
    owner: str | None  # the class whose attribute (method, class or instance attribute) it is; None: module-level
    spellings: tuple[str, ...]  # the current spelling first, then those of other releases
    # Where a release has no spelling: "<the adapter function that answers then>: what it does" (the function
    # is a VllmApi method, or `portable.<name>`); None: required (a release without it fails a probe, exit 3).
    absent: str | None = None
    function: bool = False  # a function or method: also a crash-site name

    @property
    def name(self) -> str:
        return self.spellings[0]

    @property
    def where(self) -> str:
        return f"{self.owner or self.module}.{self.name}"


# -- the offloading connector's scheduler side ------------------------------------------------------
REQ_STATUS = VllmName(OFFLOADING_SCHEDULER_MODULE, "OffloadingConnectorScheduler", ("_req_status",))
JOBS = VllmName(OFFLOADING_SCHEDULER_MODULE, "OffloadingConnectorScheduler", ("_jobs",))
BUILD_STORE_JOBS = VllmName(OFFLOADING_SCHEDULER_MODULE, "OffloadingConnectorScheduler", ("_build_store_jobs",),
                            function=True)
CALC_OFFLOADABLE_TOKENS = VllmName(OFFLOADING_SCHEDULER_MODULE, "OffloadingConnectorScheduler",
                                   ("_calc_num_offloadable_tokens",), function=True)
# The prefix lookup's keys assert moved: `_lookup` (0.26-0.27.1) -> `_lookup_complete_chunks` (0.28+, where a
# new `_lookup` calls it). A crash site named by either is looked for under both.
LOOKUP_COMPLETE_CHUNKS = VllmName(OFFLOADING_SCHEDULER_MODULE, "OffloadingConnectorScheduler",
                                  ("_lookup_complete_chunks", "_lookup"), function=True)
# The connector's reset of its manager's cache moved into a helper: `reset_cache` (0.26-0.32) -> `_reset_cache`
# (0.33+, called under the manager lock). A crash site named by either is looked for under both.
RESET_CACHE = VllmName(OFFLOADING_SCHEDULER_MODULE, "OffloadingConnectorScheduler", ("_reset_cache", "reset_cache"),
                       function=True)
# A MultiConnector's sub-connectors: public `sub_connectors` in newer releases, `_connectors` before.
SUB_CONNECTORS = VllmName(MULTI_CONNECTOR_MODULE, "MultiConnector", ("sub_connectors", "_connectors"))

# -- registries -------------------------------------------------------------------------------------
SPEC_REGISTRY = VllmName(SPEC_FACTORY_MODULE, "OffloadingSpecFactory", ("_registry",))
SECONDARY_TIER_REGISTRY = VllmName(TIER_FACTORY_MODULE, "SecondaryTierFactory", ("_registry",),
                                   absent="has_secondary_tier: no secondary tiers in this release")

# -- the tiering manager's in-flight state (settling a step's secondary-tier I/O) ---------------------
TIER_TRANSFER_JOBS = VllmName(TIERING_MANAGER_MODULE, "TieringOffloadingManager", ("_transfer_jobs",),
                              absent="promotion_jobs: no tiering manager, no promotions in flight")
TIER_LOOKUP_MANAGER = VllmName(FS_TIER_MODULE, "FileSystemTierManager", ("_lookup_manager",),
                               absent="settle_secondary_tiers: a tier without asynchronous lookups waits on I/O only")
LOOKUP_STATE = VllmName(ASYNC_LOOKUP_MODULE, "AsyncLookupManager", ("_lookup_state",),
                        absent="settle_secondary_tiers: a tier without asynchronous lookups waits on I/O only")
LOOKUP_BATCH = VllmName(ASYNC_LOOKUP_MODULE, "AsyncLookupManager", ("_lookup_batch",),
                        absent="settle_secondary_tiers: every lookup counts as sent")
# -- the tier invariants (observe/tier_invariants.py): the primary tier's pool, the manager's requests --------
PRIMARY_POLICY = VllmName(CPU_MANAGER_MODULE, "CPUOffloadingManager", ("_policy",),
                          absent="primary_chunk: no cache policy to read, every key absent")
PRIMARY_FREE_LIST = VllmName(CPU_MANAGER_MODULE, "CPUOffloadingManager", ("_free_list",),
                             absent="primary_free_chunks: no free list to read, none free")
TIER_REQUEST_STATE = VllmName(TIERING_MANAGER_MODULE, "TieringOffloadingManager", ("_req_state",),
                              absent="tier_tracked_requests: no per-request state to read, none tracked")

# -- the worker side and the engine core ------------------------------------------------------------
KV_CONNECTOR_AGENT = VllmName(KV_TRANSFER_STATE_MODULE, None, ("_KV_CONNECTOR_AGENT",))
GET_KV_CONNECTOR_OUTPUT = VllmName(RUNNER_MIXIN_MODULE, "KVConnectorModelRunnerMixin", ("_get_kv_connector_output",),
                                   absent="runner_mixin: no V1 runner glue (gone in 0.34), --model-runner v2 only",
                                   function=True)
PROCESS_INPUT_QUEUE = VllmName(ENGINE_CORE_MODULE, "EngineCoreProc", ("_process_input_queue",),
                               absent="engine_core_facts: no client utility calls between steps", function=True)
# How a CUDA deployment picks its model runner (VllmConfig's own helpers).
IS_DEFAULT_V2_RUNNER_MODEL = VllmName(VLLM_CONFIG_MODULE, "VllmConfig", ("_is_default_v2_model_runner_model",),
                                      absent="gpu_default_model_runner: V2 is the default for every model",
                                      function=True)
V2_RUNNER_UNSUPPORTED = VllmName(VLLM_CONFIG_MODULE, "VllmConfig", ("_get_v2_model_runner_unsupported_features",),
                                 absent="gpu_default_model_runner: no V2 default, V1", function=True)
DEFAULT_LAYOUT_PREFERENCE = VllmName(BACKEND_UTILS_MODULE, None, ("_DEFAULT_LAYOUT_PREFERENCE",),
                                     absent="portable.default_kv_cache_layouts: NHD")

# -- the CPU tier behind KV events (what a subscriber should believe is resident) ----------------------
CPU_CACHE_POLICY = VllmName(CPU_MANAGER_MODULE, "CPUOffloadingManager", ("_policy",),
                            absent="connector_tier_keys: the tier is not read, its residency not compared")

# -- the object-store tier kvdoctor records (compat/objstore_tier.py: its jobs, agent and object names) -----------
OBJ_MANAGER_MODULE = "vllm.v1.kv_offload.tiering.obj.manager"
_OBJ_ABSENT = "objstore_unavailable: no object-store tier, nothing recorded"
OBJ_AGENT = VllmName(OBJ_MANAGER_MODULE, "ObjectStoreSecondaryTierManager", ("_agent",), absent=_OBJ_ABSENT)
OBJ_FILE_MAPPER = VllmName(OBJ_MANAGER_MODULE, "ObjectStoreSecondaryTierManager", ("_file_mapper",),
                           absent=_OBJ_ABSENT)
OBJ_TRANSFERS = VllmName(OBJ_MANAGER_MODULE, "ObjectStoreSecondaryTierManager", ("_transfers",), absent=_OBJ_ABSENT)
OBJ_PENDING_RESULTS = VllmName(OBJ_MANAGER_MODULE, "ObjectStoreSecondaryTierManager", ("_pending_results",),
                               absent=_OBJ_ABSENT)
OBJ_STORE_JOBS = VllmName(OBJ_MANAGER_MODULE, "ObjectStoreSecondaryTierManager", ("_store_jobs",), absent=_OBJ_ABSENT)
OBJ_LOAD_JOB_KEYS = VllmName(OBJ_MANAGER_MODULE, "ObjectStoreSecondaryTierManager", ("_load_job_keys",),
                             absent=_OBJ_ABSENT)

# -- the P2P tier's producer: store batches parked for a fetch still to come (reaped after its unbound timeout) ----
P2P_MANAGER_MODULE = "vllm.v1.kv_offload.tiering.p2p.manager"
P2P_UNBOUND_STORES = VllmName(P2P_MANAGER_MODULE, "P2PSecondaryTierManager", ("_unbound_stores",),
                              absent="p2p_parked_stores: 0 (no parked store delays the pair's rest)")

# -- vLLM's own backpressure detector and drop policy (compat/vllm_backpressure.py records their decisions) ------
_BP_ABSENT = "has_vllm_backpressure: no EMA detector on the scripted tier, the setup is refused (exit 2)"
BP_UNDER_PRESSURE = VllmName(TIER_BACKPRESSURE_MODULE, "EMABackpressureDetector", ("_under_pressure",),
                             absent=_BP_ABSENT)
BP_COMPLETIONS = VllmName(TIER_BACKPRESSURE_MODULE, "EMABackpressureDetector", ("_completions",), absent=_BP_ABSENT)
BP_FAILURE_TRIPPED = VllmName(TIER_BACKPRESSURE_MODULE, "EMABackpressureDetector", ("_failure_tripped",),
                              absent="has_vllm_backpressure: a detector without a failure threshold never trips")
BP_WARMUP_COMPLETIONS = VllmName(TIER_BACKPRESSURE_MODULE, "EMABackpressureDetector", ("_warmup_completions",),
                                 absent=_BP_ABSENT)
BP_EMA = VllmName(TIER_BACKPRESSURE_MODULE, "EMABackpressureDetector", ("_ema",), absent=_BP_ABSENT)
BP_LAST_UPDATE = VllmName(TIER_BACKPRESSURE_MODULE, "EMABackpressureDetector", ("_last_update",), absent=_BP_ABSENT)
BP_PRESSURE_CLEARED_AT = VllmName(TIER_BACKPRESSURE_MODULE, "EMABackpressureDetector", ("_pressure_cleared_at",),
                                  absent=_BP_ABSENT)
BP_LOW = VllmName(TIER_BACKPRESSURE_MODULE, "EMABackpressureDetector", ("_low",), absent=_BP_ABSENT)
BP_HALF_LIFE = VllmName(TIER_BACKPRESSURE_MODULE, "EMABackpressureDetector", ("_decay_half_life_s",),
                        absent=_BP_ABSENT)
BP_COOLDOWN = VllmName(TIER_BACKPRESSURE_MODULE, "EMABackpressureDetector", ("_cooldown_s",), absent=_BP_ABSENT)
BP_STORES_DROPPED = VllmName(TIER_BACKPRESSURE_MODULE, "DropAccountingPolicy", ("_stores_dropped",),
                             absent=_BP_ABSENT)
BP_BLOCKS_DROPPED = VllmName(TIER_BACKPRESSURE_MODULE, "DropAccountingPolicy", ("_blocks_dropped",),
                             absent=_BP_ABSENT)

TABLE: tuple[VllmName, ...] = (
    REQ_STATUS, JOBS, BUILD_STORE_JOBS, CALC_OFFLOADABLE_TOKENS, LOOKUP_COMPLETE_CHUNKS, RESET_CACHE, SUB_CONNECTORS,
    SPEC_REGISTRY, SECONDARY_TIER_REGISTRY, TIER_TRANSFER_JOBS, TIER_LOOKUP_MANAGER, LOOKUP_STATE, LOOKUP_BATCH,
    PRIMARY_POLICY, PRIMARY_FREE_LIST, TIER_REQUEST_STATE,
    KV_CONNECTOR_AGENT, GET_KV_CONNECTOR_OUTPUT, PROCESS_INPUT_QUEUE, IS_DEFAULT_V2_RUNNER_MODEL,
    V2_RUNNER_UNSUPPORTED, DEFAULT_LAYOUT_PREFERENCE, CPU_CACHE_POLICY,
    OBJ_AGENT, OBJ_FILE_MAPPER, OBJ_TRANSFERS, OBJ_PENDING_RESULTS, OBJ_STORE_JOBS, OBJ_LOAD_JOB_KEYS,
    P2P_UNBOUND_STORES,
    BP_UNDER_PRESSURE, BP_COMPLETIONS, BP_FAILURE_TRIPPED, BP_WARMUP_COMPLETIONS, BP_EMA, BP_LAST_UPDATE,
    BP_PRESSURE_CLEARED_AT, BP_LOW, BP_HALF_LIFE, BP_COOLDOWN, BP_STORES_DROPPED, BP_BLOCKS_DROPPED,
)

_MISSING = object()


def spelling(obj: Any, entry: VllmName) -> str | None:
    """The spelling of `entry` that `obj` (a vLLM class, instance or module) has, or None."""
    return next((name for name in entry.spellings if hasattr(obj, name)), None)


def has(obj: Any, entry: VllmName) -> bool:
    return spelling(obj, entry) is not None


def get(obj: Any, entry: VllmName, default: Any = _MISSING) -> Any:
    """`obj`'s value of `entry` under whichever spelling this release has; without one, `default`, or
    (no default) an `IncompatibleVllmError` naming what is gone (exit 3)."""
    name = spelling(obj, entry)
    if name is not None:
        return getattr(obj, name)
    if default is not _MISSING:
        return default
    raise IncompatibleVllmError(f"this vLLM has no {entry.where}; kvdoctor's adapter needs an update")


def put(obj: Any, entry: VllmName, value: Any) -> None:
    """Set `entry` on `obj` under the spelling it has (IncompatibleVllmError where it has none)."""
    name = spelling(obj, entry)
    if name is None:
        raise IncompatibleVllmError(f"this vLLM has no {entry.where}; kvdoctor's adapter needs an update")
    setattr(obj, name, value)


def function_spellings(function: str) -> tuple[str, ...]:
    """`function` and its other spellings across releases (from the table's function rows), `function` first:
    the names a crash site naming it is looked for under."""
    others = [name for entry in TABLE if entry.function and function in entry.spellings
              for name in entry.spellings if name != function]
    return (function, *dict.fromkeys(others))
