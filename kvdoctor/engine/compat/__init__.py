"""The adapter: the one place that knows vLLM's private names and per-release signatures.

Everything else in kvdoctor talks to vLLM through `VllmApi`, in one calling style:
`api.<method>(...)` on the object `load()` returns (code that vLLM itself instantiates, or a
pure function handed vLLM's objects, takes the same cached object from `load()`). Module-level
names here are the loader only (`load`, `import_vllm`, the version helpers).

- `imports`: importing vLLM's modules quietly, failing in one line (exit 3);
- `probes`: the feature probes that decide whether this vLLM is supported (exit 3 naming the
  one that fails; a release newer than the newest measured one runs with a one-line note);
- `worker`: the worker side (`--worker vllm`): worker-role connector, runner glue, KV tensors;
- `portable`: reads that need only vLLM's objects, shared verbatim with exported scripts.

`tests/test_vllm_private_names.py` fails on a vLLM private name read anywhere else.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import os
import re
import sys
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from kvdoctor.engine.compat import names, portable, probes
from kvdoctor.engine.compat.engine import EngineGlue
from kvdoctor.engine.compat.imports import _import, _quiet_environment, _require, _silenced_stderr
from kvdoctor.engine.compat.kv_events import KvEventsGlue
from kvdoctor.engine.compat.speculative import SpeculativeGlue
from kvdoctor.engine.compat.worker import WorkerGlue
from kvdoctor.errors import IncompatibleVllmError, UsageError, VllmUnavailableError
from kvdoctor.installed import vllm_version
from kvdoctor.releases import NEWEST_MEASURED, SUPPORTED_MIN, SUPPORTED_RANGE_TEXT, release_tuple

# RequestGroupState's lists whose len() a storable_chunks guard compares: the allocated GPU blocks (the
# PR #49146 cap) and the offload keys (0.30's key cap). The logic variants hide their length.
GROUP_STATE_BLOCK_IDS = "block_ids"
GROUP_STATE_OFFLOAD_KEYS = "offload_keys"


def parse_version(text: str) -> tuple[int, int, int] | None:
    """Leading release numbers of a version string ('0.26.1.dev3+gabc' -> (0, 26, 1))."""
    match = re.match(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?", text or "")
    if not match:
        return None
    return int(match.group(1)), int(match.group(2)), int(match.group(3) or 0)


def check_supported(version_text: str) -> tuple[int, int, int]:
    """Refuse only what the version alone decides: an unreadable version, or one older than the oldest
    release the adapter knows (its earlier forms are gone from compat). A newer release is not refused
    here: whether it works is for the feature probes (`probes.require`) to say."""
    version = parse_version(version_text)
    if version is None:
        raise VllmUnavailableError(f"cannot read the installed vLLM version {version_text!r}")
    if version < SUPPORTED_MIN:
        raise VllmUnavailableError(
            f"vLLM {version_text} is outside kvdoctor's supported range {SUPPORTED_RANGE_TEXT} "
            f"(older than {'.'.join(map(str, SUPPORTED_MIN))})"
        )
    return version


NOTED_ENV = "KVDOCTOR_NEWER_VLLM_NOTED"  # set once noted: spawned workers (explore) say nothing again


def newer_release_note(version_text: str, version: tuple[int, int, int]) -> str | None:
    """The one-line note for a release newer than the newest one kvdoctor was measured on, else None."""
    if version <= release_tuple(NEWEST_MEASURED):
        return None
    return (f"vLLM {version_text} is newer than the newest release kvdoctor was measured on ({NEWEST_MEASURED}); "
            f"results are from probes that hold")


@dataclass(frozen=True)
class GroupView:
    group_idx: int
    tokens_per_chunk: int
    offload_keys: int
    block_ids: int
    next_stored_chunk: int


@dataclass(frozen=True)
class RequestView:
    req_id: str
    status: str
    num_tokens: int
    num_prompt_tokens: int
    num_computed_tokens: int


@dataclass
class VllmApi(WorkerGlue, SpeculativeGlue, EngineGlue, KvEventsGlue):
    """vLLM's classes and the per-release facts kvdoctor needs, loaded once."""

    version_text: str
    version: tuple[int, int, int]
    mods: dict[str, Any]

    # -- public classes -------------------------------------------------
    def config_class(self, name: str) -> Any:
        """A class of `vllm.config` (VllmConfig, CacheConfig, SchedulerConfig, DeviceConfig, ...)."""
        return self.cls("config", name)

    def kv_cache_spec_class(self, name: str) -> Any:
        """A per-layer KV spec class of `vllm.v1.kv_cache_interface` (FullAttentionSpec, MambaSpec, ...)."""
        return self.cls("kv_cache_interface", name)

    def block_hash_fn(self) -> Any:
        """vLLM's sha256 block hash, with the chain's NONE_HASH seeded from it (`init_none_hash`), as the
        engine core sets hashing up before building a request block hasher."""
        sha256 = _require(self.mods["hashing"], "sha256", "vllm.utils.hashing")
        _require(self.mods["kv_cache_utils"], "init_none_hash", "kv_cache_utils")(sha256)
        return sha256

    @cached_property
    def RequestOffloadState(self) -> Any:
        return self.cls("offload_scheduler", "RequestOffloadState")

    @cached_property
    def OffloadingConnectorScheduler(self) -> Any:
        return self.cls("offload_scheduler", "OffloadingConnectorScheduler")

    # -- per-release signatures -----------------------------------------
    @cached_property
    def storable_chunks_params(self) -> tuple[str, ...]:
        """Parameter names of `RequestOffloadState.storable_chunks` after `self`.

        0.26.0: (group_config, num_offloadable_tokens); 0.27.0+: (group_config,
        group_state, num_offloadable_tokens); 0.34.0 adds apply_eagle_drop.
        """
        params = list(inspect.signature(self.RequestOffloadState.storable_chunks).parameters)
        known = {"self", "group_config", "group_state", "num_offloadable_tokens", "apply_eagle_drop"}
        if params[:2] != ["self", "group_config"] or "num_offloadable_tokens" not in params \
                or not set(params) <= known:
            raise IncompatibleVllmError(
                f"RequestOffloadState.storable_chunks has an unknown signature {params}"
            )
        return tuple(params[1:])

    @cached_property
    def storable_chunks_takes_group_state(self) -> bool:
        return "group_state" in self.storable_chunks_params

    def split_storable_args(self, req_state: Any, group_config: Any, args: tuple, kwargs: dict
                            ) -> tuple[Any, int, dict[str, Any]]:
        """(group_state, num_offloadable_tokens, other arguments) of one call vLLM made."""
        bound = dict(zip(self.storable_chunks_params[1:], args, strict=False))  # the rest came as keywords
        bound.update(kwargs)
        n = int(bound.pop("num_offloadable_tokens"))
        group_state = bound.pop("group_state", None)
        if group_state is None:
            group_state = self.group_state_for(req_state, group_config)
        return group_state, n, bound

    def storable_caller(self, original: Any, extra: dict[str, Any] | None = None) -> Any:
        """`call(req_state, group_config, group_state, n)` of vLLM's method, in this release's form.

        `extra` holds the arguments a release added (0.34: apply_eagle_drop), passed
        through as vLLM passed them.
        """
        takes_group_state = self.storable_chunks_takes_group_state
        extra = dict(extra or {})

        def call(req_state: Any, group_config: Any, group_state: Any, n: int) -> int:
            if takes_group_state:
                return original(req_state, group_config, group_state=group_state, num_offloadable_tokens=n,
                                **extra)
            return original(req_state, group_config, num_offloadable_tokens=n, **extra)
        return call

    def next_store_extra_args(self, connector_scheduler: Any) -> dict[str, Any]:
        """The extra arguments the next store pass gives `storable_chunks`.

        0.34: `apply_eagle_drop = not use_lookahead_block_hashes`, as `_build_store_jobs` passes it.
        """
        if "apply_eagle_drop" not in self.storable_chunks_params:
            return {}
        lookahead = _require(connector_scheduler, "use_lookahead_block_hashes", "OffloadingConnectorScheduler")
        return {"apply_eagle_drop": not lookahead}

    # -- what the worker reports (public dataclasses whose fields moved) ----
    @cached_property
    def worker_reports_failed_jobs(self) -> bool:
        """0.34+: `mark_completed(job_id, success)` and `failed_jobs`: a transfer can fail.

        Before that the real offloading worker asserts that every transfer succeeds;
        the only way a failed load reaches the scheduler is the base scheduler's
        generic `invalid_block_ids`.
        """
        return portable.worker_reports_failed_jobs(self.cls("offload_common", "OffloadingWorkerMetadata"))

    @property
    def transfer_failure_model(self) -> str:
        if self.worker_reports_failed_jobs:
            return ("failed jobs reported as vLLM's offloading worker does: mark_completed(success=False); "
                    "a failed load's request in failed_recving")
        return ("this vLLM's offloading worker has no failure path (it asserts transfers succeed): kvdoctor "
                "reports a failed load as invalid_block_ids, the base scheduler's generic path")

    def worker_metadata(self, completed: list[int], failed: list[int]) -> Any:
        meta = self.cls("offload_common", "OffloadingWorkerMetadata")()
        for job_id in completed:
            meta.mark_completed(job_id)
        for job_id in failed:
            if self.worker_reports_failed_jobs:
                meta.mark_completed(job_id, success=False)
            else:
                meta.mark_completed(job_id)
        return meta

    def kv_connector_output(self, meta: Any, finished_recving: set[str], failed_loads: set[str],
                            invalid_block_ids: set[int]) -> Any:
        """The worker's `KVConnectorOutput`, with failed loads in the form this release takes."""
        cls = self.cls("outputs", "KVConnectorOutput")
        kwargs: dict[str, Any] = {"kv_connector_worker_meta": meta,
                                  "finished_recving": set(finished_recving) or None}
        if self.worker_reports_failed_jobs:
            if failed_loads:
                kwargs["failed_recving"] = set(failed_loads)
        else:
            kwargs["invalid_block_ids"] = set(invalid_block_ids)
        return cls(**kwargs)

    def parallel_config(self, num_workers: int) -> Any:
        """vLLM's `ParallelConfig` for `num_workers` ranks, set as `--tensor-parallel-size` sets it (its
        world_size is what the offloading scheduler counts reports against); no worker is started."""
        return self.mods["config"].ParallelConfig(tensor_parallel_size=num_workers)

    @cached_property
    def counts_worker_reports(self) -> bool:
        """Whether the offloading scheduler completes a job only once every worker reported it (its
        `TransferJobStatus.pending_count`, started at world_size) and the executor's aggregator exists:
        a feature probe, where several workers can disagree."""
        status = getattr(self.mods["offload_scheduler"], "TransferJobStatus", None)
        return (status is not None and "pending_count" in getattr(status, "__dataclass_fields__", {})
                and self.kv_output_aggregator(1) is not None)

    def kv_output_aggregator(self, num_workers: int) -> Any:
        """vLLM's `KVOutputAggregator` (what the executor combines its workers' outputs with), or None
        where this release has none."""
        try:
            from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
        except ImportError:
            return None
        return KVOutputAggregator(num_workers)

    def aggregate_kv_outputs(self, aggregator: Any, kv_outputs: list[Any]) -> Any:
        """The combined `KVConnectorOutput` the scheduler would get: each worker's output wrapped in a
        `ModelRunnerOutput` and passed through vLLM's aggregator, rank 0's taken."""
        outputs = [self.model_runner_output([], [], kv_output) for kv_output in kv_outputs]
        return aggregator.aggregate(outputs, 0).kv_connector_output

    def model_runner_output(self, req_ids: list[str], sampled: list[list[int]], kv_output: Any) -> Any:
        """`ModelRunnerOutput`; 0.34 dropped `req_id_to_index`."""
        cls = self.cls("outputs", "ModelRunnerOutput")
        kwargs: dict[str, Any] = {"req_ids": req_ids, "sampled_token_ids": sampled,
                                  "kv_connector_output": kv_output}
        if portable.runner_output_takes_req_id_to_index(cls):
            kwargs["req_id_to_index"] = {rid: i for i, rid in enumerate(req_ids)}
        return cls(**kwargs)

    @cached_property
    def aborted_store_counts_computed_tokens(self) -> bool:
        """Whether `_build_store_jobs` treats FINISHED_ABORTED specially (PR #49285).

        Read from the method's bytecode names (a feature probe, not a version
        check); only used to predict the next step in `inspect`, never for a verdict.
        """
        code = names.get(self.OffloadingConnectorScheduler, names.BUILD_STORE_JOBS).__code__
        return "FINISHED_ABORTED" in code.co_names

    def kv_transfer_config(self, extra_config: dict[str, Any], fields: dict[str, Any],
                           second_extra_config: dict[str, Any] | None = None, pd_decode: bool = False) -> Any:
        """vLLM's `KVTransferConfig` for the OffloadingConnector, with the user's other fields.

        A field this release's KVTransferConfig does not have is refused (exit 2)
        rather than dropped, as is vLLM's own backpressure detector where this vLLM cannot build it.
        """
        self._refuse_vllm_backpressure(extra_config)
        cls = self.cls("config", "KVTransferConfig")
        known = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set(
            getattr(cls, "model_fields", {}) or {})
        absent = sorted(set(fields) - known) if known else []
        if absent:
            raise UsageError(f"--kv-transfer-config: this vLLM's KVTransferConfig has no "
                             f"{', '.join(absent)}")
        values = {"kv_role": "kv_both", **fields}
        connector = "OffloadingConnector"
        from kvdoctor.engine.connector_config import MULTI_CONNECTOR, multi_offloading_extra_config

        if second_extra_config is not None:  # MultiConnector: the watched connector first, then the other

            extra_config = multi_offloading_extra_config(extra_config, second_extra_config, values["kv_role"])
            connector = MULTI_CONNECTOR
        elif pd_decode:  # a P/D decode node: kvdoctor's NIXL stand-in first, then vLLM's OffloadingConnector
            from kvdoctor.engine.compat.pd_connector import STANDIN_MODULE, STANDIN_NAME

            role = values["kv_role"]
            extra_config = {"connectors": [
                {"kv_connector": STANDIN_NAME, "kv_connector_module_path": STANDIN_MODULE, "kv_role": role},
                {"kv_connector": "OffloadingConnector", "kv_role": role, "kv_connector_extra_config": extra_config}]}
            connector = MULTI_CONNECTOR
        try:
            return cls(kv_connector=connector, kv_connector_extra_config=extra_config, **values)
        except (ValueError, TypeError) as exc:
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
            raise UsageError(f"--kv-transfer-config: vLLM rejected it: {' · '.join(lines)}") from None

    def kv_cache_tensor(self, size: int, layer: str, page_bytes: int, num_blocks: int) -> Any:
        """`KVCacheTensor` changed shape in 0.33 (layout fields replace shared_by)."""
        cls = self.cls("kv_cache_interface", "KVCacheTensor")
        try:
            return portable.kv_cache_tensor(cls, size, layer, page_bytes, num_blocks)
        except TypeError as exc:
            raise IncompatibleVllmError(str(exc)) from None

    # -- private state the connector keeps ------------------------------
    @staticmethod
    def sub_connectors(connector: Any) -> list[Any] | None:
        """A MultiConnector's sub-connectors (`names.SUB_CONNECTORS`); None for any other connector."""
        value = names.get(connector, names.SUB_CONNECTORS, None)
        return list(value) if value is not None else None

    def connector_scheduler(self, scheduler: Any, index: int = 0) -> Any:
        """The OffloadingConnector's scheduler side; under a MultiConnector, that of sub-connector `index`."""
        connector = _require(scheduler, "connector", "Scheduler")
        if connector is None:
            raise IncompatibleVllmError("the scheduler built no KV connector")
        subs = self.sub_connectors(connector)
        if subs is not None:
            connector = subs[index]
        return _require(connector, "connector_scheduler", type(connector).__name__)

    @staticmethod
    def connector_metadatas(scheduler_output: Any) -> tuple[Any, ...]:
        """The connector metadata of a step, one per (sub-)connector (a MultiConnector's in order)."""
        meta = getattr(scheduler_output, "kv_connector_metadata", None)
        return () if meta is None else portable.sub_connector_metadatas(meta)

    def pd_standin_output(self, finished_recving: set[str], failed: set[str], invalid_block_ids: set[int]) -> Any:
        """The `KVConnectorOutput` of kvdoctor's NIXL stand-in (Setup.pd_decode) for one step, its failed loads
        as this release's NIXL reports them: by request (`failed_recving`, where the output has that field)
        or by block (`invalid_block_ids`)."""
        cls = self.cls("outputs", "KVConnectorOutput")
        kwargs: dict[str, Any] = {"finished_recving": set(finished_recving) or None}
        if "failed_recving" in getattr(cls, "__dataclass_fields__", {}):
            kwargs["failed_recving"] = set(failed)
        else:
            kwargs["invalid_block_ids"] = set(invalid_block_ids)
        return cls(**kwargs)

    def multi_connector_output(self, outputs: list[Any]) -> Any:
        """One KVConnectorOutput from each sub-connector's, as a MultiConnector worker reports it."""
        first = outputs[0]
        first.kv_connector_worker_meta = portable.multi_worker_metadata([o.kv_connector_worker_meta for o in outputs])
        for other in outputs[1:]:
            for name in ("finished_recving", "failed_recving", "invalid_block_ids"):
                extra = getattr(other, name, None)
                if extra:
                    setattr(first, name, set(getattr(first, name, None) or ()) | set(extra))
        return first

    @staticmethod
    def request_states(connector_scheduler: Any) -> dict[str, Any]:
        """The connector's per-request offload state (`_req_status`), by request id."""
        try:
            return portable.request_states(connector_scheduler)
        except AttributeError:
            raise IncompatibleVllmError("this vLLM has no OffloadingConnectorScheduler._req_status; "
                                        "kvdoctor's adapter needs an update") from None

    @staticmethod
    def allocated_block_count(group_state: Any) -> int:
        """GPU blocks one KV group of a request holds (`RequestGroupState.block_ids`)."""
        try:
            return int(portable.allocated_block_count(group_state))
        except AttributeError:
            raise IncompatibleVllmError("this vLLM has no RequestGroupState.block_ids; "
                                        "kvdoctor's adapter needs an update") from None

    def jobs(self, connector_scheduler: Any) -> dict[int, Any]:
        return dict(names.get(connector_scheduler, names.JOBS))

    def offload_config(self, connector_scheduler: Any) -> Any:
        return _require(connector_scheduler, "config", "OffloadingConnectorScheduler")

    def group_configs(self, connector_scheduler: Any) -> tuple[Any, ...]:
        return tuple(_require(self.offload_config(connector_scheduler), "kv_group_configs",
                              "SchedulerOffloadConfig"))

    def blocks_per_chunk(self, connector_scheduler: Any) -> int:
        return int(_require(self.offload_config(connector_scheduler), "blocks_per_chunk",
                            "SchedulerOffloadConfig"))

    def group_state_for(self, req_state: Any, group_config: Any) -> Any:
        """The group state matching `group_config` (0.26.0 callers do not pass it)."""
        configs = req_state.config.kv_group_configs
        for idx, candidate in enumerate(configs):
            if candidate is group_config:
                return req_state.group_states[idx]
        for idx, candidate in enumerate(configs):
            if candidate == group_config:
                return req_state.group_states[idx]
        raise IncompatibleVllmError("storable_chunks got a group config the request does not hold")

    # -- read-only views of the connector's per-request state -----------
    @staticmethod
    def request_of(req_state: Any) -> Any:
        return _require(req_state, "req", "RequestOffloadState")

    @staticmethod
    def group_states(req_state: Any) -> tuple[Any, ...]:
        return tuple(_require(req_state, "group_states", "RequestOffloadState"))

    @staticmethod
    def transfer_job_ids(req_state: Any) -> tuple[int, ...]:
        return tuple(_require(req_state, "transfer_jobs", "RequestOffloadState"))

    @staticmethod
    def blocks_per_chunk_of(req_state: Any) -> int:
        config = _require(req_state, "config", "RequestOffloadState")
        return int(_require(config, "blocks_per_chunk", "SchedulerOffloadConfig"))

    @staticmethod
    def offload_prompt_only(req_state: Any) -> bool:
        config = _require(req_state, "config", "RequestOffloadState")
        return bool(getattr(config, "offload_prompt_only", True))

    @staticmethod
    def group_view(group_config: Any, group_state: Any) -> GroupView:
        """The numbers kvdoctor reads from one KV group of one request, as plain ints."""
        return GroupView(
            group_idx=int(_require(group_config, "group_idx", "GroupOffloadConfig")),
            tokens_per_chunk=int(_require(group_config, "tokens_per_chunk", "GroupOffloadConfig")),
            offload_keys=len(_require(group_state, "offload_keys", "RequestGroupState")),
            block_ids=len(_require(group_state, "block_ids", "RequestGroupState")),
            next_stored_chunk=int(_require(group_state, "next_stored_chunk_idx", "RequestGroupState")),
        )

    @staticmethod
    def request_view(request: Any) -> RequestView:
        status = request.status
        return RequestView(
            req_id=str(request.request_id),
            status=getattr(status, "name", str(status)),
            num_tokens=int(request.num_tokens),
            num_prompt_tokens=int(request.num_prompt_tokens),
            num_computed_tokens=int(request.num_computed_tokens),
        )

    @staticmethod
    def update_block_hashes(request: Any) -> None:
        """Let the request's block hasher compute every hash still missing (`Request.update_block_hashes`)."""
        _require(request, "update_block_hashes", "Request")()

    @staticmethod
    def block_hash_count(request: Any) -> int:
        return len(_require(request, "block_hashes", "Request"))

    def has_offloading_spec(self, name: str) -> bool:
        """Whether `kv_connector_extra_config.spec_name = name` resolves in this vLLM.

        Only a registry without that name means "no": a factory that fails to
        import or has moved is an adapter problem (exit 3), not "not applicable".
        """
        module = names.SPEC_REGISTRY.module
        cls = _require(_import(module), "OffloadingSpecFactory", module)
        return name in names.get(cls, names.SPEC_REGISTRY)

    def has_secondary_tier(self, tier_type: str) -> bool:
        """Whether the tiering spec's `secondary_tiers: [{"type": tier_type}]` resolves in this vLLM (0.34's
        SecondaryTierFactory registry); a release without that factory has no secondary tiers ("no")."""
        import importlib.util

        module = names.SECONDARY_TIER_REGISTRY.module
        if importlib.util.find_spec(names.TIERING_PACKAGE) is None or importlib.util.find_spec(module) is None:
            return False
        cls = getattr(_import(module), "SecondaryTierFactory", None)
        return tier_type in (names.get(cls, names.SECONDARY_TIER_REGISTRY, None) or {})

    def tiering_defers_write_release(self) -> bool:
        """Whether the tiering spec's CPU primary tier defers a failed promotion's slot release
        (`defer_write_release`, 0.34): the newest tiering machinery, which explore draws secondary tiers for."""
        import importlib.util

        module = names.TIERING_MANAGER_MODULE
        if importlib.util.find_spec(names.TIERING_PACKAGE) is None or importlib.util.find_spec(module) is None:
            return False
        primary = getattr(_import(module), "CPUPrimaryTierOffloadingManager", None)
        return hasattr(primary, "defer_write_release")

    def tiering_manager_of(self, connector_scheduler: Any) -> Any:
        """The connector's TieringOffloadingManager (None where the connector runs another manager)."""
        manager = getattr(connector_scheduler, "manager", None)
        return manager if hasattr(manager, "secondary_tiers") else None

    def settle_secondary_tiers(self, manager: Any, timeout_s: float = 10.0) -> None:
        """Wait, during the step's forward window, until every secondary tier's I/O submitted so far is done
        and its asynchronous lookups have answered, so the next step's poll sees them: a tier faster than a
        forward, the same on every run (the tiers' own threads would otherwise finish after a varying
        number of steps and a recipe would not replay). Uses the tier's `drain_jobs` (what vLLM's
        reset_cache waits with) and its lookup manager's `drain_results` (what its next lookup calls)."""
        import time

        deadline = time.monotonic() + timeout_s
        for tier in manager.secondary_tiers:
            if getattr(tier, "kvdoctor_scripted", False):  # kvdoctor's scripted tier: its script times its jobs
                continue
            tier.drain_jobs()
            lookups = names.get(tier, names.TIER_LOOKUP_MANAGER, None)
            states = names.get(lookups, names.LOOKUP_STATE, None)
            if lookups is None or states is None:
                continue
            while True:
                lookups.drain_results()
                # submitted = not in this step's unsent batch (0.26-0.29 batch (key, ctx); 0.30+ (key, ctx, gen))
                unsent = {entry[0] for entry in names.get(lookups, names.LOOKUP_BATCH, ())}
                if all(state.result is not None or key in unsent for key, state in states.items()):
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the {tier.tier_type} tier's lookups did not answer within {timeout_s} s")
                time.sleep(0.0005)

    def objstore_unavailable(self) -> str | None:
        """Why kvdoctor cannot stand in for the object-store tier's NIXL agent here, in one line (None: it can)."""
        from kvdoctor.engine.compat.objstore_agent import objstore_probe

        return objstore_probe()

    def has_scripted_tier(self) -> bool:
        """Whether vLLM's tiering spec loads an out-of-tree secondary tier from a tier spec's `module_path`
        and takes a failed promotion's `deferred_release` (what kvdoctor's scripted tier reports): the
        factory's `get_tier_class` reads `module_path`, and `JobResult` has the field."""
        import dataclasses
        import importlib.util
        import inspect

        if (importlib.util.find_spec(names.TIERING_PACKAGE) is None
                or importlib.util.find_spec(names.TIER_FACTORY_MODULE) is None):
            return False
        factory = getattr(_import(names.TIER_FACTORY_MODULE), "SecondaryTierFactory", None)
        get_class = getattr(factory, "get_tier_class", None)
        if get_class is None or "module_path" not in inspect.getsource(get_class):
            return False
        result = getattr(_import(names.TIER_BASE_MODULE), "JobResult", None)
        return result is not None and "deferred_release" in {f.name for f in dataclasses.fields(result)}

    def has_example_tier(self) -> bool:
        """Whether vLLM ships its in-memory example secondary tier and its tiering spec loads a tier through
        `module_path` (how kvdoctor's recording subclass of it is loaded)."""
        import importlib.util

        return (self.has_scripted_tier() and importlib.util.find_spec(names.EXAMPLE_TIER_MODULE) is not None
                and hasattr(_import(names.EXAMPLE_TIER_MODULE), "ExampleSecondaryTierManager"))

    def has_tier_backpressure(self) -> bool:
        """Whether a tier's `backpressure` dict builds a detector by `backpressure_cls` (the factory reads
        it) with vLLM's drop-accounting policy (what kvdoctor's scripted policy extends)."""
        import importlib.util
        import inspect

        if not self.has_scripted_tier() or importlib.util.find_spec(names.TIER_BACKPRESSURE_MODULE) is None:
            return False
        factory = getattr(_import(names.TIER_FACTORY_MODULE), "SecondaryTierFactory", None)
        create = getattr(factory, "create_secondary_tier", None)
        return (create is not None and "backpressure_cls" in inspect.getsource(create)
                and hasattr(_import(names.TIER_BACKPRESSURE_MODULE), "DropAccountingPolicy"))

    def _refuse_vllm_backpressure(self, extra_config: dict[str, Any]) -> None:
        """Exit 2 in one line where a secondary tier names vLLM's own detector (Setup.backpressure_pattern = "vllm")
        and this vLLM cannot build it on the scripted tier (`has_vllm_backpressure`)."""
        for tier in extra_config.get("secondary_tiers") or ():
            backpressure = tier.get("backpressure") if isinstance(tier, dict) else None
            named = str(backpressure.get("backpressure_cls")) if isinstance(backpressure, dict) else ""
            if not isinstance(backpressure, dict) or "vllm_backpressure." not in named:
                continue
            if not self.has_vllm_backpressure(failure_threshold="failure_threshold" in backpressure):
                raise UsageError(
                    "backpressure_pattern = \"vllm\": this vLLM cannot build its EMABackpressureDetector on kvdoctor's "
                    "scripted tier (tiering/backpressure.py's classes, a tier's `backpressure` dict, `module_path` "
                    "tiers" + (", `failure_threshold`" if "failure_threshold" in backpressure else "") + ")")

    def has_vllm_backpressure(self, failure_threshold: bool = False) -> bool:
        """Whether a tier's `backpressure` dict can build vLLM's own EMABackpressureDetector with its
        ThrottledDropPolicy / DropStorePolicy (0.31+), on a scripted tier (Setup.backpressure_pattern = "vllm");
        with `failure_threshold`, also whether the detector takes failed stores as pressure (0.33+)."""
        import inspect

        if not self.has_tier_backpressure():
            return False
        module = _import(names.TIER_BACKPRESSURE_MODULE)
        detector = getattr(module, "EMABackpressureDetector", None)
        if detector is None or not all(hasattr(module, n) for n in ("ThrottledDropPolicy", "DropStorePolicy")):
            return False
        return not failure_threshold or "failure_threshold" in inspect.signature(detector.__init__).parameters

    def scripted_tiers(self, manager: Any) -> list[Any]:
        """kvdoctor's scripted tiers among the tiering manager's secondary tiers (none without a manager)."""
        tiers = getattr(manager, "secondary_tiers", None) or []
        return [tier for tier in tiers if getattr(tier, "kvdoctor_scripted", False)]

    def primary_chunk(self, manager: Any, key: Any) -> tuple[int, bool] | None:
        """The tiering manager's CPU (primary) tier's chunk for `key`: (chunk id, ready), None if absent."""
        policy = names.get(manager.primary_tier, names.PRIMARY_POLICY, None)
        chunk = None if policy is None else policy.get(key)
        return None if chunk is None else (chunk.chunk_id, bool(chunk.is_ready))

    def primary_free_chunks(self, manager: Any) -> set[int]:
        """The CPU (primary) tier's free pool: chunk ids it may hand to the next store or promotion."""
        return set(names.get(manager.primary_tier, names.PRIMARY_FREE_LIST, None) or ())

    def tier_tracked_requests(self, manager: Any) -> set[str]:
        """The request ids the tiering manager still holds state for (finalized ones are gone)."""
        return set(names.get(manager, names.TIER_REQUEST_STATE, None) or ())

    def p2p_parked_stores(self, tier: Any) -> int:
        """Store batches a P2P producer tier parks for a fetch that has not come yet: vLLM keeps them pinned until
        a fetch binds them or its unbound-store timeout reaps them (a bounded wait, not a leak)."""
        return sum(len(batches) for batches in (names.get(tier, names.P2P_UNBOUND_STORES, None) or {}).values())

    def tier_jobs_of(self, manager: Any, tier: Any) -> int:
        """Transfer jobs the tiering manager tracks for `tier` (each pins its primary chunks)."""
        index = list(manager.secondary_tiers).index(tier)
        jobs = names.get(manager, names.TIER_TRANSFER_JOBS, None) or {}
        return sum(1 for job in jobs.values() if getattr(job, "tier_idx", None) == index)

    def promotion_jobs(self, manager: Any) -> int:
        """Secondary-tier -> CPU promotion jobs the tiering manager holds in flight now."""
        jobs = names.get(manager, names.TIER_TRANSFER_JOBS, None) or {}
        # 0.34: JobMetadata wraps a TransferJob; earlier releases' JobMetadata is the job itself
        return sum(1 for job in jobs.values() if getattr(job, "transfer_job", job).is_promotion)

    def tier_jobs(self, manager: Any) -> int:
        """Secondary-tier jobs (promotions and cascades) the tiering manager holds in flight now."""
        return len(names.get(manager, names.TIER_TRANSFER_JOBS, None) or {})

    def connector_keeps_stepping(self, connector_scheduler: Any) -> bool:
        """The connector's own answer to "must the engine keep stepping?" (`has_pending_push_work`: its
        jobs, and its manager's pending work, e.g. a tier's deferred release not yet set). An engine is
        idle only when this is False; False where the release has no such method (nothing to ask)."""
        ask = getattr(connector_scheduler, "has_pending_push_work", None)
        return bool(ask()) if callable(ask) else False

    def kv_cache_group_has_field(self, name: str) -> bool:
        cls = self.cls("kv_cache_interface", "KVCacheGroupSpec")
        return name in {f.name for f in dataclasses.fields(cls)}

    def cache_config_has_field(self, name: str) -> bool:
        """Whether vLLM's `CacheConfig` takes this field (`prefix_match_unit`: the block-hash granularity
        of hybrid groups, `cache_config.prefix_match_unit`; a feature probe, not a version check)."""
        cls = self.cls("config", "CacheConfig")
        return name in {f.name for f in dataclasses.fields(cls)}

    def offload_config_reads(self, name: str) -> bool:
        """Whether the offloading scheduler's config has this field (`sync_load_budget_bytes`: it reads
        the `kv_connector_extra_config` key of that name; 0.33+)."""
        offload_config = getattr(self.mods.get("offload_scheduler"), "SchedulerOffloadConfig", None)
        return name in getattr(offload_config, "__annotations__", {})

    def offload_request_reads(self, name: str) -> bool:
        """Whether the offloading scheduler's per-request state has this field (`max_load_tokens` /
        `max_offload_tokens`: it reads them from the request's `kv_transfer_params`; 0.34+)."""
        cls = self.RequestOffloadState
        fields = ({f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls)
                  else set(getattr(cls, "__annotations__", {})))
        return name in fields

    def kv_transfer_config_has_field(self, name: str) -> bool:
        """Whether vLLM's `KVTransferConfig` takes this field (`kv_load_failure_policy`)."""
        cls = self.cls("config", "KVTransferConfig")
        return dataclasses.is_dataclass(cls) and name in {f.name for f in dataclasses.fields(cls)}

    def scheduler_policies(self) -> tuple[str, ...]:
        """The values vLLM's `SchedulerConfig.policy` takes (its Literal type: "fcfs", "priority")."""
        import typing

        cls = self.cls("config", "SchedulerConfig")
        fields = {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
        if "policy" not in fields:
            return ()
        hints = typing.get_type_hints(cls) if isinstance(fields["policy"].type, str) else {}
        kind = hints.get("policy", fields["policy"].type)
        return tuple(str(value) for value in typing.get_args(kind)) or ("fcfs",)

    def offloading_stats(self, connector_scheduler: Any) -> Any:
        """The offloading connector's stats now (`get_stats`, what the scheduler collects each step; its
        gauges are snapshots of the state, its counters what accumulated since the last read)."""
        return connector_scheduler.get_stats()

    def offloading_stats_sections(self, stats: Any) -> tuple[dict[str, str], dict[str, Any]]:
        """(metric name -> "gauge" | "counter" | "histogram", metric name -> {label values: value}) of an
        OffloadingConnectorStats payload (`metric_sections()` where it has it, else its data's two keys)."""
        if hasattr(stats, "metric_sections"):
            types, values = stats.metric_sections()
            return types, values
        return stats.data.get("types", {}), stats.data.get("data", {})

    def offloading_prom_metrics(self, scheduler: Any, gauge: Any, counter: Any, histogram: Any) -> Any:
        """vLLM's Prometheus side of the OffloadingConnector (`build_prom_metrics`) with these metric classes
        standing in for prometheus_client's Gauge, Counter and Histogram; None under a MultiConnector (its
        metrics are the MultiConnector's, over every sub-connector)."""
        from prometheus_client import Counter, Gauge, Histogram

        connector = _require(scheduler, "connector", "Scheduler")
        if connector is None or self.sub_connectors(connector) is not None:
            return None
        return type(connector).build_prom_metrics(self.vllm_config_of(scheduler),
                                                  {Gauge: gauge, Counter: counter, Histogram: histogram},
                                                  ["model_name", "engine"], {0: ["kvdoctor", "0"]})

    def eviction_policies(self) -> frozenset[str]:
        """The CPU tier's eviction policies `kv_connector_extra_config.eviction_policy` selects ("lru", "arc"):
        those vLLM's cache policy factory resolves (0.27+), else the values the CPU offloading manager's
        `cache_policy` parameter is typed to take (0.26's Literal)."""
        import importlib.util
        import inspect
        import typing

        if importlib.util.find_spec("vllm.v1.kv_offload.cpu.policies.factory") is not None:
            factory = _import("vllm.v1.kv_offload.cpu.policies.factory").CachePolicyFactory
            found = set()
            for name in ("lru", "arc"):
                try:
                    factory.get_cache_policy_cls(name)
                except ValueError:
                    continue
                found.add(name)
            return frozenset(found)
        manager = getattr(_import("vllm.v1.kv_offload.cpu.manager"), "CPUOffloadingManager", None)
        parameter = inspect.signature(manager).parameters.get("cache_policy") if manager is not None else None
        if parameter is None:
            return frozenset()
        hints = typing.get_type_hints(vars(manager)["__init__"]) if isinstance(parameter.annotation, str) else {}
        return frozenset(str(v) for v in typing.get_args(hints.get("cache_policy", parameter.annotation)))

    def cache_config_kwargs(self, setup_fields: dict[str, Any]) -> dict[str, Any]:
        """`CacheConfig` keyword arguments for the optional setup fields given (None: vLLM's default).
        A field this vLLM's CacheConfig lacks is refused in one line (recipes declare
        `cache_config_field:<field>` so that such a release reads not_applicable instead)."""
        kwargs: dict[str, Any] = {}
        for name, value in setup_fields.items():
            if value is None:
                continue
            if not self.cache_config_has_field(name):
                raise UsageError(f"{name}: this vLLM's CacheConfig has no field {name!r}")
            kwargs[name] = value
        return kwargs

    @staticmethod
    def job_is_store(job_status: Any) -> bool:
        return bool(getattr(job_status, "is_store", False))

    # -- fields of the scheduler's output that some releases lack (feature probes) ---------
    @staticmethod
    def preempted_req_ids(scheduler_output: Any) -> tuple[str, ...]:
        """Requests this step preempted (`SchedulerOutput.preempted_req_ids`; none where the field is absent)."""
        return tuple(getattr(scheduler_output, "preempted_req_ids", None) or ())

    @staticmethod
    def jobs_to_flush(connector_metadata: Any) -> set[int]:
        """Jobs the connector asks its worker to finish now (`jobs_to_flush`; none where absent)."""
        return set(getattr(connector_metadata, "jobs_to_flush", None) or ())

    @staticmethod
    def resumed_req_ids(cached_requests: Any) -> set[str]:
        """Cached requests resumed after a preemption (`CachedRequestData.resumed_req_ids`)."""
        return portable.resumed_req_ids(cached_requests)

    @staticmethod
    def all_token_ids(cached_requests: Any) -> dict[str, list[int]]:
        """A resumed request's whole token list where the release sends it (`all_token_ids`), else {}."""
        return getattr(cached_requests, "all_token_ids", None) or {}

    @staticmethod
    def block_ids_to_zero(scheduler_output: Any) -> tuple[int, ...]:
        """GPU blocks the runner must zero before use (`new_block_ids_to_zero`; none where absent)."""
        return tuple(int(b) for b in getattr(scheduler_output, "new_block_ids_to_zero", None) or ())

    @staticmethod
    def block_copies(scheduler_output: Any) -> tuple[tuple[int, int], ...]:
        """(src, dst) GPU block copies the runner makes before the forward (`kv_cache_block_copies`)."""
        return tuple((int(c[0]), int(c[1])) for c in getattr(scheduler_output, "kv_cache_block_copies", None) or ())

    @staticmethod
    def store_and_load_jobs(scheduler_output: Any, index: int = 0) -> tuple[dict[int, Any], dict[int, Any]]:
        """The store and load jobs of (sub-)connector `index` in one step."""
        metas = VllmApi.connector_metadatas(scheduler_output)
        if len(metas) <= index:
            return {}, {}
        meta = metas[index]
        return dict(getattr(meta, "store_jobs", {}) or {}), dict(getattr(meta, "load_jobs", {}) or {})

    @staticmethod
    def load_is_sync(load_job: Any) -> bool:
        """0.33+: a load job entry's `sync` (a sync load, within the `sync_load_budget_bytes` of its step:
        vLLM's worker waits for it in that step and reports no finished_recving); before: always async."""
        return bool(getattr(load_job, "sync", False))

    @staticmethod
    def block_ids_by_group(spec: Any) -> tuple[tuple[int, ...], ...]:
        """A GPULoadStoreSpec's block ids split by KV cache group (`group_sizes`; one group without it)."""
        ids = VllmApi.block_ids_of(spec)
        sizes = getattr(spec, "group_sizes", None)
        if sizes is None:
            return (ids,)
        groups, start = [], 0
        for size in sizes:
            groups.append(ids[start:start + int(size)])
            start += int(size)
        return tuple(groups)

    @staticmethod
    def allocated_block_ids(scheduler_output: Any, group_block_sizes: tuple[int, ...]) -> tuple[set[int], ...]:
        """GPU blocks freshly allocated to scheduled requests in this step, per KV cache group.

        A new or resumed request's block list starts with its prefix-cache hits
        (shared, same content): those are not allocations; each group counts
        them in its own block size. Block 0 is the null block (sliding-window
        groups hold it for blocks outside the window).
        """
        allocated: tuple[set[int], ...] = tuple(set() for _ in group_block_sizes)

        def add(groups: Any, computed: int) -> None:
            for g, ids in enumerate(groups or ()):
                skip = computed // group_block_sizes[g] if computed else 0
                allocated[g].update(b for b in ids[skip:] if b != 0)

        for new in scheduler_output.scheduled_new_reqs:
            add(new.block_ids, int(new.num_computed_tokens))
        cached = scheduler_output.scheduled_cached_reqs
        resumed = set(getattr(cached, "resumed_req_ids", ()) or ())
        for i, req_id in enumerate(cached.req_ids):
            add(cached.new_block_ids[i], int(cached.num_computed_tokens[i]) if req_id in resumed else 0)
        return allocated

    # -- KV cache planning (vLLM's own planner, per release) --------------
    @staticmethod
    def enable_hybrid_kv_cache_manager(vllm_config: Any) -> str | None:
        """Undo VllmConfig's CPU-only switch-off of the hybrid KV cache manager.

        Without a GPU, `current_platform.support_hybrid_kv_cache()` is False and
        VllmConfig sets `disable_hybrid_kv_cache_manager = True`, which makes the
        planner merge sliding-window and Mamba layers into full attention. A GPU
        deployment with the OffloadingConnector (SupportsHMA) keeps it on.
        Returns a note when kvdoctor could not do that, else None.
        """
        scheduler_config = vllm_config.scheduler_config
        if not hasattr(scheduler_config, "disable_hybrid_kv_cache_manager"):
            return ("this vLLM's SchedulerConfig has no disable_hybrid_kv_cache_manager: "
                    "groups are as its planner made them on this CPU-only machine")
        scheduler_config.disable_hybrid_kv_cache_manager = False
        return None

    def plan_kv_cache(self, vllm_config: Any, specs: dict[str, Any], num_blocks: int,
                      draft_layers: set[str]) -> tuple[Any, Any, int, int, str, int]:
        """Group per-layer specs and place them in a pool of `num_blocks` blocks, as the engine core does.

        Returns (worker KVCacheConfig, scheduler KVCacheConfig, scheduler block size,
        hash block size, which planner ran, the max_model_len its admission check was run with).
        0.26-0.32: `kv_cache_utils.get_kv_cache_configs`;
        0.33+: the KV cache layout is resolved first, then `kv_cache_planning`'s
        `get_global_kv_cache_groups` + `get_kv_cache_configs`.
        """
        kcu = self.mods["kv_cache_utils"]
        vllm_config.cache_config.num_gpu_blocks_override = num_blocks
        memory = [1 << 40]  # the override decides the block count
        planning = self._kv_cache_planning()
        self._resolve_kv_cache_layout(vllm_config, specs)
        if planning is not None:
            def configs() -> list[Any]:
                groups = planning.get_global_kv_cache_groups(vllm_config, [specs])
                self._mark_eagle_groups(groups, draft_layers)
                planned = planning.get_kv_cache_configs(vllm_config, [specs], memory, groups)
                for config in planned:
                    config.kv_cache_layout = vllm_config.cache_config.kv_cache_layout
                return planned
            planner = "kv_cache_planning.get_global_kv_cache_groups + get_kv_cache_configs"
        else:
            def configs() -> list[Any]:
                planned = kcu.get_kv_cache_configs(vllm_config, [specs], memory)
                for config in planned:
                    self._mark_eagle_groups(config.kv_cache_groups, draft_layers)
                return planned
            planner = "kv_cache_utils.get_kv_cache_configs"
        planned, checked_len = _within_admission_check(vllm_config, configs)
        scheduler_config = kcu.generate_scheduler_kv_cache_config(planned)
        vllm_config.cache_config.num_gpu_blocks = scheduler_config.num_blocks
        block_size, hash_block_size = kcu.resolve_kv_cache_block_sizes(scheduler_config, vllm_config)
        if hasattr(kcu, "resolve_cache_hit_alignment_tokens"):
            align = kcu.resolve_cache_hit_alignment_tokens(scheduler_config, vllm_config, block_size,
                                                           hash_block_size)
            for config in (*planned, scheduler_config):
                config.hash_block_size = hash_block_size
                config.cache_hit_alignment_tokens = align
        return planned[0], scheduler_config, int(block_size), int(hash_block_size), planner, checked_len

    @staticmethod
    def _kv_cache_planning() -> Any:
        """0.33+'s `kv_cache_planning` (groups planned once for every worker), or None where the release plans
        in `kv_cache_utils` (a feature probe)."""
        try:
            planning = importlib.import_module("vllm.v1.core.kv_cache_planning")
        except ImportError:
            return None
        return planning if hasattr(planning, "get_global_kv_cache_groups") else None

    @staticmethod
    def _resolve_kv_cache_layout(vllm_config: Any, specs: dict[str, Any]) -> None:
        """Releases that resolve the KV cache layout once in the engine core (0.30+: feature probe) need it
        resolved before planning or grouping, whichever planner they have."""
        backend_utils = importlib.import_module("vllm.v1.attention.backends.utils")
        resolve_kv_cache_layout = getattr(backend_utils, "resolve_kv_cache_layout", None)
        if resolve_kv_cache_layout is not None:
            from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

            wanted = OffloadingConnector.get_required_kvcache_layout(vllm_config)
            resolve_kv_cache_layout(vllm_config, [[wanted, "LBNHC"]], list(specs.values()))

    def kv_cache_groups(self, vllm_config: Any, specs: dict[str, Any], draft_layers: set[str]) -> list[Any]:
        """vLLM's grouping of per-layer specs alone (KVCacheGroupSpecs), before any pool is placed, so before the
        block-size and hash-unit checks `plan_kv_cache` runs. 0.33+: `kv_cache_planning.get_global_kv_cache_groups`;
        earlier: `kv_cache_utils.get_kv_cache_groups` (a feature probe)."""
        planning = self._kv_cache_planning()
        self._resolve_kv_cache_layout(vllm_config, specs)
        if planning is not None:
            groups = planning.get_global_kv_cache_groups(vllm_config, [specs])
        else:
            groups = self.mods["kv_cache_utils"].get_kv_cache_groups(vllm_config, specs)
        self._mark_eagle_groups(groups, draft_layers)
        return list(groups)

    @staticmethod
    def _mark_eagle_groups(groups: list[Any], draft_layers: set[str]) -> None:
        """Flag the groups holding drafter layers, as vLLM's planner does for an EAGLE speculative config.

        kvdoctor builds no SpeculativeConfig (it would load a draft model); the
        flag is what the connector reads (`GroupOffloadConfig.is_eagle_group`).
        """
        if not draft_layers:
            return
        for group in groups:
            if not draft_layers.isdisjoint(group.layer_names):
                if not hasattr(group, "is_eagle_group"):
                    raise IncompatibleVllmError("this vLLM's KVCacheGroupSpec has no is_eagle_group")
                group.is_eagle_group = True

    @staticmethod
    def describe_group(index: int, group: Any) -> dict[str, Any]:
        """A release-neutral description of one KVCacheGroupSpec."""
        spec = group.kv_cache_spec
        name = type(spec).__name__
        kind = {"FullAttentionSpec": "full_attention", "SlidingWindowSpec": "sliding_window",
                "MambaSpec": "mamba"}.get(name, name)
        return {"index": index, "kind": kind, "block_size": int(spec.block_size),
                "layers": list(group.layer_names),
                "sliding_window": getattr(spec, "sliding_window", None),
                "mamba_cache_mode": getattr(spec, "mamba_cache_mode", None) if kind == "mamba" else None,
                "eagle": bool(getattr(group, "is_eagle_group", False))}

    def offloadable_tokens(self, connector_scheduler: Any, req_state: Any, num_tokens: int) -> int:
        """The connector's own clamp (prompt-only, max_offload_tokens) of a token count."""
        method = names.get(connector_scheduler, names.CALC_OFFLOADABLE_TOKENS)
        return int(method(req_state, num_tokens))

    def engine_core_facts(self) -> EngineCoreFacts:
        """Feature probes of `vllm.v1.engine.core` (imported here only: the scheduler never needs it)."""
        module = _import(names.ENGINE_CORE_MODULE)
        core = _require(module, "EngineCore", names.ENGINE_CORE_MODULE)
        proc = getattr(module, "EngineCoreProc", None)
        reset = getattr(core, "reset_prefix_cache", None)
        params = frozenset(inspect.signature(reset).parameters) - {"self"} if reset is not None else frozenset()
        return EngineCoreFacts(reset_params=params, batch_queue=hasattr(core, "step_with_batch_queue"),
                               utilities_between_steps=proc is not None and names.has(proc, names.PROCESS_INPUT_QUEUE)
                               and hasattr(proc, "run_busy_loop"))

    @cached_property
    def worker_side_checked(self) -> bool:
        """The worker-side probes, asked once before vLLM's worker is built (exit 3 naming a failing one)."""
        probes.require(self, worker_side=True)
        return True

    @cached_property
    def offloading_package_dir(self) -> str:
        return os.path.dirname(os.path.dirname(self.mods["vllm"].__file__))


_API: VllmApi | None = None

_MODULES = {
    "vllm": "vllm",
    "config": "vllm.config",
    "scheduler": "vllm.v1.core.sched.scheduler",
    "async_scheduler": "vllm.v1.core.sched.async_scheduler",
    "kv_cache_interface": "vllm.v1.kv_cache_interface",
    "kv_cache_utils": "vllm.v1.core.kv_cache_utils",
    "structured_output": "vllm.v1.structured_output",
    "request": "vllm.v1.request",
    "sampling_params": "vllm.sampling_params",
    "hashing": "vllm.utils.hashing",
    "outputs": "vllm.v1.outputs",
    "offload_common": names.OFFLOADING_COMMON_MODULE,
    "offload_scheduler": names.OFFLOADING_SCHEDULER_MODULE,
    "multi_connector": names.MULTI_CONNECTOR_MODULE,
}


def _within_admission_check(vllm_config: Any, plan: Any) -> tuple[list[Any], int]:
    """Run the planner; when its start-up admission check refuses the pool, plan for shorter requests.

    kvdoctor's pools are deliberately tiny (a queued request needs a full
    pool), so vLLM's check that one `max_model_len` request fits would refuse
    them. The check only decides whether a server starts; grouping and
    placement do not depend on it. The length it checks is lowered for the
    planning call only (halved until the check passes) and restored.
    """
    model_config = vllm_config.model_config
    original = model_config.max_model_len
    length = original
    try:
        while True:
            try:
                return plan(), length
            except ValueError as exc:
                if ("max_model_len" not in str(exc) and "KV cache" not in str(exc)) or length <= 1:
                    raise
                length //= 2
                model_config.max_model_len = length
    finally:
        model_config.max_model_len = original


@dataclass(frozen=True)
class EngineCoreFacts:
    """What vLLM's EngineCore lets a client do around the scheduler (read by explore's triage)."""

    reset_params: frozenset[str]  # parameters of EngineCore.reset_prefix_cache (a utility call)
    batch_queue: bool  # step_with_batch_queue: async scheduling returns with a batch still in flight
    utilities_between_steps: bool  # EngineCoreProc's busy loop handles client calls between steps


installed_vllm_version = vllm_version  # the one reader (kvdoctor.installed), under the adapter's name


def import_vllm() -> VllmApi:
    """Import vLLM once per process (the ~6 s floor) and build the adapter over it, its probes not yet
    asked (`load` asks them; `kvdoctor version` lists every probe's answer, a failing one included)."""
    declared = installed_vllm_version()
    if declared is None:
        raise VllmUnavailableError(
            f"vLLM is not installed in this Python environment (kvdoctor needs vllm{SUPPORTED_RANGE_TEXT})"
        )
    check_supported(declared)
    _quiet_environment()
    with _silenced_stderr():
        mods = {key: _import(name) for key, name in _MODULES.items()}
    # vLLM's modules live as long as the process: their ~590k objects leave the collector's generations, so
    # each full collection (the harness's gc.collect after a run on KV tensors, the automatic ones) scans only
    # what the runs create. Measured on 0.26.0: gc.collect() 0.35-0.38 s CPU after the import, 0.00 s after.
    import gc

    gc.freeze()
    version_text = getattr(mods["vllm"], "__version__", declared)
    version = check_supported(version_text)
    if not os.environ.get("KVDOCTOR_VERBOSE_IMPORT"):
        import logging

        vllm_logger = logging.getLogger("vllm")
        vllm_logger.setLevel(logging.ERROR)  # connector-init chatter, once per scheduler
        for handler in vllm_logger.handlers:  # keep stdout for kvdoctor's own output (--json)
            if isinstance(handler, logging.StreamHandler) and getattr(handler, "stream", None) is sys.stdout:
                handler.setStream(sys.stderr)
    return VllmApi(version_text=version_text, version=version, mods=mods)


def load() -> VllmApi:
    """The adapter over the installed vLLM, once per process: refused (exit 3) only by its version
    being older than kvdoctor's oldest or by a scheduler-side probe that fails, never for being new."""
    global _API
    if _API is not None:
        return _API
    api = import_vllm()

    probes.require(api, worker_side=False)  # exit 3 naming the first probe that fails
    note = newer_release_note(api.version_text, api.version)
    if note is not None and not os.environ.get(NOTED_ENV):
        print(f"kvdoctor: note: {note}", file=sys.stderr, flush=True)
        os.environ[NOTED_ENV] = "1"
    _API = api
    return api


def inline_portable(script: str, module: Any = portable) -> str:
    """A standalone script's text with its import of `portable` (or another module that imports neither
    kvdoctor nor vLLM: the serve client) replaced by that module's code.

    The exported script imports only vLLM; it gets the adapter's own definition of the reads and
    probes it shares with kvdoctor (not a copy that could drift)."""
    import ast

    lines = script.splitlines(keepends=True)
    for node in ast.parse(script).body:
        if isinstance(node, ast.ImportFrom) and node.module == module.__name__:
            source = inspect.getsource(module)
            body = ast.parse(source).body
            start = body[1].lineno - 1 if isinstance(body[0], ast.Expr) else 0  # after the docstring
            code = "".join(source.splitlines(keepends=True)[start:]).strip("\n")
            copied = f"# copied from {module.__name__} on export\n{code}\n\n"
            return "".join(lines[:node.lineno - 1]) + copied + "".join(lines[node.end_lineno:])
    raise RuntimeError(f"the standalone template lost its import of {module.__name__}")
