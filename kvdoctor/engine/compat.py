"""The one place that knows vLLM's private names and per-release signatures.

Everything else in kvdoctor talks to vLLM through `VllmApi`. When a release
moves something, this module fails with one clear line (exit 3) instead of an
AttributeError deep inside a scenario.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import os
import re
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Iterator

from kvdoctor.errors import IncompatibleVllmError, VllmUnavailableError

from kvdoctor.releases import SUPPORTED_MAX_EXCLUSIVE, SUPPORTED_MIN, SUPPORTED_RANGE_TEXT  # noqa: F401 - one definition

OFFLOADING_SCHEDULER_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler"
OFFLOADING_COMMON_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.common"


def parse_version(text: str) -> tuple[int, int, int] | None:
    """Leading release numbers of a version string ('0.26.1.dev3+gabc' -> (0, 26, 1))."""
    match = re.match(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?", text or "")
    if not match:
        return None
    return int(match.group(1)), int(match.group(2)), int(match.group(3) or 0)


def check_supported(version_text: str) -> tuple[int, int, int]:
    """Accept only releases kvdoctor's adapter was built and tested against."""
    version = parse_version(version_text)
    if version is None:
        raise VllmUnavailableError(f"cannot read the installed vLLM version {version_text!r}")
    if not (SUPPORTED_MIN <= version < SUPPORTED_MAX_EXCLUSIVE):
        raise VllmUnavailableError(
            f"vLLM {version_text} is outside kvdoctor's supported range {SUPPORTED_RANGE_TEXT}"
        )
    return version


def _quiet_environment() -> None:
    """Keep vLLM offline and quiet: no hub look-ups, no usage stats, no INFO spam."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


@contextmanager
def _silenced_stderr() -> Iterator[None]:
    """vLLM and torch print import-time chatter (no CUDA, no Triton, no vllm._C) on fd 2.

    On a CPU-only machine all of it is expected; kvdoctor reports real import
    failures itself, in one line.
    """
    if os.environ.get("KVDOCTOR_VERBOSE_IMPORT"):
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _import(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and (exc.name == "vllm" or module.startswith(exc.name + ".") and exc.name == "vllm"):
            raise VllmUnavailableError(
                f"vLLM is not installed in this Python environment (kvdoctor needs vllm{SUPPORTED_RANGE_TEXT})"
            ) from None
        raise VllmUnavailableError(
            f"importing {module} failed: {type(exc).__name__}: {_one_line(exc)}"
        ) from None
    except Exception as exc:  # a broken environment: torchvision ops, CUDA libs, ...
        raise VllmUnavailableError(
            f"importing {module} failed: {type(exc).__name__}: {_one_line(exc)}"
        ) from None


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else ""


def _require(obj: Any, name: str, where: str) -> Any:
    try:
        return getattr(obj, name)
    except AttributeError:
        raise IncompatibleVllmError(
            f"this vLLM has no {where}.{name}; kvdoctor's adapter needs an update"
        ) from None


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
class VllmApi:
    """vLLM's classes and the per-release facts kvdoctor needs, loaded once."""

    version_text: str
    version: tuple[int, int, int]
    mods: dict[str, Any]

    # -- public classes -------------------------------------------------
    def cls(self, module_key: str, name: str) -> Any:
        return _require(self.mods[module_key], name, self.mods[module_key].__name__)

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
        bound = dict(zip(self.storable_chunks_params[1:], args))
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
        cls = self.cls("offload_common", "OffloadingWorkerMetadata")
        return "success" in inspect.signature(cls.mark_completed).parameters

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

    def model_runner_output(self, req_ids: list[str], sampled: list[list[int]], kv_output: Any) -> Any:
        """`ModelRunnerOutput`; 0.34 dropped `req_id_to_index`."""
        cls = self.cls("outputs", "ModelRunnerOutput")
        kwargs: dict[str, Any] = {"req_ids": req_ids, "sampled_token_ids": sampled,
                                  "kv_connector_output": kv_output}
        if "req_id_to_index" in {f.name for f in dataclasses.fields(cls)}:
            kwargs["req_id_to_index"] = {rid: i for i, rid in enumerate(req_ids)}
        return cls(**kwargs)

    @cached_property
    def aborted_store_counts_computed_tokens(self) -> bool:
        """Whether `_build_store_jobs` treats FINISHED_ABORTED specially (PR #49285).

        Read from the method's bytecode names (a feature probe, not a version
        check); only used to predict the next step in `inspect`, never for a verdict.
        """
        code = self.OffloadingConnectorScheduler._build_store_jobs.__code__
        return "FINISHED_ABORTED" in code.co_names

    def kv_transfer_config(self, extra_config: dict[str, Any], fields: dict[str, Any],
                           second_extra_config: dict[str, Any] | None = None) -> Any:
        """vLLM's `KVTransferConfig` for the OffloadingConnector, with the user's other fields.

        A field this release's KVTransferConfig does not have is refused (exit 2)
        rather than dropped.
        """
        from kvdoctor.errors import UsageError

        cls = self.cls("config", "KVTransferConfig")
        known = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set(
            getattr(cls, "model_fields", {}) or {})
        absent = sorted(set(fields) - known) if known else []
        if absent:
            raise UsageError(f"--kv-transfer-config: this vLLM's KVTransferConfig has no "
                             f"{', '.join(absent)}")
        values = {"kv_role": "kv_both", **fields}
        connector = "OffloadingConnector"
        if second_extra_config is not None:  # MultiConnector: the watched connector first, then the other
            role = values["kv_role"]
            extra_config = {"connectors": [
                {"kv_connector": "OffloadingConnector", "kv_role": role, "kv_connector_extra_config": extra_config},
                {"kv_connector": "OffloadingConnector", "kv_role": role,
                 "kv_connector_extra_config": second_extra_config}]}
            connector = "MultiConnector"
        try:
            return cls(kv_connector=connector, kv_connector_extra_config=extra_config, **values)
        except (ValueError, TypeError) as exc:
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
            raise UsageError(f"--kv-transfer-config: vLLM rejected it: {' · '.join(lines)}") from None

    def kv_cache_tensor(self, size: int, layer: str, page_bytes: int, num_blocks: int) -> Any:
        """`KVCacheTensor` changed shape in 0.33 (layout fields replace shared_by)."""
        cls = self.cls("kv_cache_interface", "KVCacheTensor")
        names = {f.name for f in dataclasses.fields(cls)}
        if "shared_by" in names:
            return cls(size=size, shared_by=[layer])
        if {"layers", "layer_stride", "block_stride"} <= names:
            return cls(size=size, layers=[layer], layer_stride=page_bytes * num_blocks,
                       block_stride=page_bytes)
        raise IncompatibleVllmError(f"KVCacheTensor has unknown fields {sorted(names)}")

    # -- private state the connector keeps ------------------------------
    @staticmethod
    def sub_connectors(connector: Any) -> list[Any] | None:
        """A MultiConnector's sub-connectors (0.34 `sub_connectors`, earlier `_connectors`); None otherwise."""
        for name in ("sub_connectors", "_connectors"):
            value = getattr(connector, name, None)
            if value is not None:
                return list(value)
        return None

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
        if meta is None:
            return ()
        inner = getattr(meta, "metadata", None)
        return tuple(inner) if isinstance(inner, tuple) else (meta,)

    def multi_connector_output(self, outputs: list[Any]) -> Any:
        """One KVConnectorOutput from each sub-connector's, as a MultiConnector worker reports it."""
        multi = self.cls("multi_connector", "MultiKVConnectorWorkerMetadata")
        first = outputs[0]
        first.kv_connector_worker_meta = multi(metadata=tuple(o.kv_connector_worker_meta for o in outputs))
        for other in outputs[1:]:
            for name in ("finished_recving", "failed_recving", "invalid_block_ids"):
                extra = getattr(other, name, None)
                if extra:
                    setattr(first, name, set(getattr(first, name, None) or ()) | set(extra))
        return first

    def request_states(self, connector_scheduler: Any) -> dict[str, Any]:
        return _require(connector_scheduler, "_req_status", "OffloadingConnectorScheduler")

    def jobs(self, connector_scheduler: Any) -> dict[int, Any]:
        return _require(connector_scheduler, "_jobs", "OffloadingConnectorScheduler")

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
    def group_view(group_config: Any, group_state: Any) -> "GroupView":
        """The numbers kvdoctor reads from one KV group of one request, as plain ints."""
        return GroupView(
            group_idx=int(_require(group_config, "group_idx", "GroupOffloadConfig")),
            tokens_per_chunk=int(_require(group_config, "tokens_per_chunk", "GroupOffloadConfig")),
            offload_keys=len(_require(group_state, "offload_keys", "RequestGroupState")),
            block_ids=len(_require(group_state, "block_ids", "RequestGroupState")),
            next_stored_chunk=int(_require(group_state, "next_stored_chunk_idx", "RequestGroupState")),
        )

    @staticmethod
    def request_view(request: Any) -> "RequestView":
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
        module = "vllm.v1.kv_offload.factory"
        factory = _import(module)
        cls = _require(factory, "OffloadingSpecFactory", module)
        registry = _require(cls, "_registry", "OffloadingSpecFactory")
        return name in registry

    def kv_cache_group_has_field(self, name: str) -> bool:
        cls = self.cls("kv_cache_interface", "KVCacheGroupSpec")
        return name in {f.name for f in dataclasses.fields(cls)}

    def cache_config_has_field(self, name: str) -> bool:
        """Whether vLLM's `CacheConfig` takes this field (`prefix_match_unit`: the block-hash granularity
        of hybrid groups, `cache_config.prefix_match_unit`; a feature probe, not a version check)."""
        cls = self.cls("config", "CacheConfig")
        return name in {f.name for f in dataclasses.fields(cls)}

    def cache_config_kwargs(self, setup_fields: dict[str, Any]) -> dict[str, Any]:
        """`CacheConfig` keyword arguments for the optional setup fields given (None: vLLM's default).
        A field this vLLM's CacheConfig lacks is refused in one line (recipes declare
        `cache_config_field:<field>` so that such a release reads not_applicable instead)."""
        from kvdoctor.errors import UsageError

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

    @staticmethod
    def store_and_load_jobs(scheduler_output: Any, index: int = 0) -> tuple[dict[int, Any], dict[int, Any]]:
        """The store and load jobs of (sub-)connector `index` in one step."""
        metas = VllmApi.connector_metadatas(scheduler_output)
        if len(metas) <= index:
            return {}, {}
        meta = metas[index]
        return dict(getattr(meta, "store_jobs", {}) or {}), dict(getattr(meta, "load_jobs", {}) or {})

    @staticmethod
    def block_ids_of(spec: Any) -> tuple[int, ...]:
        """Block ids of a GPULoadStoreSpec (a numpy array in vLLM)."""
        ids = getattr(spec, "block_ids", None)
        return tuple(int(b) for b in ids) if ids is not None else ()

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
        hash block size, which planner ran, the max_model_len its admission check was run with). 0.26-0.32: `kv_cache_utils.get_kv_cache_configs`;
        0.33+: the KV cache layout is resolved first, then `kv_cache_planning`'s
        `get_global_kv_cache_groups` + `get_kv_cache_configs`.
        """
        kcu = self.mods["kv_cache_utils"]
        vllm_config.cache_config.num_gpu_blocks_override = num_blocks
        memory = [1 << 40]  # the override decides the block count
        try:
            planning = importlib.import_module("vllm.v1.core.kv_cache_planning")
        except ImportError:
            planning = None
        # Releases that resolve the KV cache layout once in the engine core (0.30+: feature probe)
        # need it resolved before planning, whichever planner they have.
        backend_utils = importlib.import_module("vllm.v1.attention.backends.utils")
        resolve_kv_cache_layout = getattr(backend_utils, "resolve_kv_cache_layout", None)
        if resolve_kv_cache_layout is not None:
            from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

            wanted = OffloadingConnector.get_required_kvcache_layout(vllm_config)
            resolve_kv_cache_layout(vllm_config, [[wanted, "LBNHC"]], list(specs.values()))
        if planning is not None and hasattr(planning, "get_global_kv_cache_groups"):
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
    "offload_common": OFFLOADING_COMMON_MODULE,
    "offload_scheduler": OFFLOADING_SCHEDULER_MODULE,
    "multi_connector": "vllm.distributed.kv_transfer.kv_connector.v1.multi_connector",
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
                if "max_model_len" not in str(exc) and "KV cache" not in str(exc) or length <= 1:
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


def engine_core_facts() -> EngineCoreFacts:
    """Feature probes of `vllm.v1.engine.core` (imported here only: the scheduler never needs it)."""
    module = _import("vllm.v1.engine.core")
    core = _require(module, "EngineCore", "vllm.v1.engine.core")
    proc = getattr(module, "EngineCoreProc", None)
    reset = getattr(core, "reset_prefix_cache", None)
    params = frozenset(inspect.signature(reset).parameters) - {"self"} if reset is not None else frozenset()
    return EngineCoreFacts(reset_params=params, batch_queue=hasattr(core, "step_with_batch_queue"),
                           utilities_between_steps=proc is not None and hasattr(proc, "_process_input_queue")
                           and hasattr(proc, "run_busy_loop"))


def installed_vllm_version() -> str | None:
    """The installed vLLM's version from its metadata, without importing it."""
    from importlib import metadata

    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


def load() -> VllmApi:
    """Import vLLM once per process (the ~6 s floor) and check the release."""
    global _API
    if _API is not None:
        return _API
    declared = installed_vllm_version()
    if declared is None:
        raise VllmUnavailableError(
            f"vLLM is not installed in this Python environment (kvdoctor needs vllm{SUPPORTED_RANGE_TEXT})"
        )
    check_supported(declared)
    _quiet_environment()
    with _silenced_stderr():
        mods = {key: _import(name) for key, name in _MODULES.items()}
    version_text = getattr(mods["vllm"], "__version__", declared)
    version = check_supported(version_text)
    if not os.environ.get("KVDOCTOR_VERBOSE_IMPORT"):
        import logging

        vllm_logger = logging.getLogger("vllm")
        vllm_logger.setLevel(logging.ERROR)  # connector-init chatter, once per scheduler
        for handler in vllm_logger.handlers:  # keep stdout for kvdoctor's own output (--json)
            if isinstance(handler, logging.StreamHandler) and getattr(handler, "stream", None) is sys.stdout:
                handler.setStream(sys.stderr)
    api = VllmApi(version_text=version_text, version=version, mods=mods)
    api.storable_chunks_takes_group_state  # fail early on an unknown signature
    _API = api
    return api


def offloadable_tokens(connector_scheduler: Any, req_state: Any, num_tokens: int) -> int:
    """The connector's own clamp (prompt-only, max_offload_tokens) of a token count."""
    method = _require(connector_scheduler, "_calc_num_offloadable_tokens", "OffloadingConnectorScheduler")
    return int(method(req_state, num_tokens))



# -- the worker side (--worker vllm): vLLM's worker-role connector and its glue --------------
# Imported only when a run asks for vLLM's worker, so the simulated path costs nothing more.

_WORKER_MODULES = {
    "connector_factory": "vllm.distributed.kv_transfer.kv_connector.factory",
    "connector_base": "vllm.distributed.kv_transfer.kv_connector.v1",
    "kv_transfer_state": "vllm.distributed.kv_transfer.kv_transfer_state",
    "forward_context": "vllm.forward_context",
    "kv_offload_base": "vllm.v1.kv_offload.base",
    "cpu_gpu_worker": "vllm.v1.kv_offload.cpu.gpu_worker",
    "offload_factory": "vllm.v1.kv_offload.factory",
}
_OPTIONAL_WORKER_MODULES = {
    "v2_kv_connector": "vllm.v1.worker.gpu.kv_connector",  # Model Runner V2's connector glue
    "runner_mixin": "vllm.v1.worker.kv_connector_model_runner_mixin",  # V1's glue (gone in 0.34)
    "worker_utils": "vllm.v1.worker.utils",
    "kv_cache_layout": "vllm.v1.kv_cache_layout",
}


def worker_mods(api: VllmApi) -> dict[str, Any]:
    """The worker-side modules, imported once (added to `api.mods`)."""
    if "connector_factory" not in api.mods:
        with _silenced_stderr():
            for key, name in _WORKER_MODULES.items():
                api.mods[key] = _import(name)
            for key, name in _OPTIONAL_WORKER_MODULES.items():
                try:
                    api.mods[key] = importlib.import_module(name)
                except Exception:  # noqa: BLE001 - absent in this release: probed where used
                    api.mods[key] = None
    return api.mods


def offloading_worker_base() -> Any:
    """vLLM's `OffloadingWorker` ABC (what a spec's `get_worker` must return)."""
    return _require(_import("vllm.v1.kv_offload.base"), "OffloadingWorker", "vllm.v1.kv_offload.base")


def offloading_spec_class(name: str) -> Any:
    """A registered spec class by its `spec_name` (e.g. CPUOffloadingSpec, TieringOffloadingSpec)."""
    factory = _require(_import("vllm.v1.kv_offload.factory"), "OffloadingSpecFactory", "vllm.v1.kv_offload.factory")
    registry = getattr(factory, "_registry", {}) or {}
    if name not in registry:
        raise IncompatibleVllmError(f"this vLLM registers no offloading spec named {name!r}")
    return registry[name]()


def transfer_result(job_id: int, success: bool, size: int, seconds: float) -> Any:
    cls = _require(_import("vllm.v1.kv_offload.base"), "TransferResult", "vllm.v1.kv_offload.base")
    return cls(job_id=job_id, success=success, transfer_size=size, transfer_time=seconds)


def compute_sub_block_ptrs() -> Any:
    """vLLM's own pointer arithmetic for the direct-layout copy plan."""
    return _require(_import("vllm.v1.kv_offload.cpu.gpu_worker"), "compute_sub_block_ptrs",
                    "vllm.v1.kv_offload.cpu.gpu_worker")


def spec_cpu_blocks(spec: Any) -> int:
    """CPU-tier slots of one chunk each: `num_chunks` (0.33) or `num_blocks` (0.26)."""
    for name in ("num_chunks", "num_blocks"):
        value = getattr(spec, name, None)
        if value is not None:
            return int(value)
    raise IncompatibleVllmError(f"{type(spec).__name__} has neither num_chunks nor num_blocks")


def spec_extra_config(spec: Any) -> dict[str, Any]:
    return dict(_require(spec, "extra_config", type(spec).__name__) or {})


def spec_blocks_per_chunk(spec: Any) -> int:
    return int(_require(spec, "blocks_per_chunk", type(spec).__name__))


def gpu_spec_groups(spec: Any, num_groups: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(group_sizes, block_indices) of a GPULoadStoreSpec (one group when the field is absent)."""
    ids = VllmApi.block_ids_of(spec)
    sizes = tuple(int(s) for s in getattr(spec, "group_sizes", None) or (len(ids),) + (0,) * (num_groups - 1))
    indices = tuple(int(i) for i in getattr(spec, "block_indices", None) or (0,) * len(sizes))
    return sizes, indices


def vllm_config_of(scheduler: Any) -> Any:
    return _require(scheduler, "vllm_config", type(scheduler).__name__)


def kv_cache_config_of(scheduler: Any) -> Any:
    """The KVCacheConfig the scheduler was built with (the worker's KV tensors follow it)."""
    return _require(scheduler, "kv_cache_config", type(scheduler).__name__)


SCHEDULER_RUNNER_AGNOSTIC = "any (this release's scheduler output does not depend on the runner)"


def scheduler_model_runner(scheduler: Any) -> str:
    """Which runner the scheduler shapes its output for; 0.34 has no such switch (feature probe)."""
    if not hasattr(scheduler, "use_v2_model_runner"):
        return SCHEDULER_RUNNER_AGNOSTIC
    return "v2" if scheduler.use_v2_model_runner else "v1"


def set_scheduler_model_runner(scheduler: Any, runner: str) -> None:
    """The scheduler shapes its output for the model runner it serves (V2: resumed = new).

    A release whose scheduler has no `use_v2_model_runner` shapes one output for both runners:
    nothing to set there."""
    if hasattr(scheduler, "use_v2_model_runner"):
        scheduler.use_v2_model_runner = runner == "v2"


def gpu_default_model_runner(vllm_config: Any) -> str:
    """The runner a CUDA deployment of this release picks for this model: V2 where vLLM
    names the architecture a default-V2 model and reports no unsupported feature (Triton is
    assumed present, as on a GPU); V1 otherwise or where the release has no V2 runner."""
    if importlib.util.find_spec("vllm.v1.worker.kv_connector_model_runner_mixin") is None:
        return "v2"  # this release has no V1 runner glue: V2 is the only runner
    env_choice = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    if env_choice is not None:
        return "v2" if env_choice.strip().lower() in ("1", "true") else "v1"
    is_default = getattr(vllm_config, "_is_default_v2_model_runner_model", None)  # 0.26: per architecture
    unsupported = getattr(vllm_config, "_get_v2_model_runner_unsupported_features", None)
    if unsupported is None:
        return "v1"
    try:
        default_model = is_default() if is_default is not None else True  # 0.33: V2 for every model
        return "v2" if default_model and not unsupported() else "v1"
    except Exception:  # noqa: BLE001 - a probe that cannot answer means the release's plain default
        return "v1"


def has_v2_kv_connector(api: VllmApi) -> bool:
    mod = worker_mods(api).get("v2_kv_connector")
    return mod is not None and hasattr(mod, "get_kv_connector")


def create_worker_connector(api: VllmApi, vllm_config: Any, kv_cache_config: Any) -> Any:
    """The WORKER-role connector, as `ensure_kv_transfer_initialized` creates it in one process."""
    mods = worker_mods(api)
    factory = _require(mods["connector_factory"], "KVConnectorFactory", "kv_connector.factory")
    role = _require(mods["connector_base"], "KVConnectorRole", "kv_connector.v1").WORKER
    return factory.create_connector(config=vllm_config, role=role, kv_cache_config=kv_cache_config)


@contextmanager
def active_worker_connector(api: VllmApi, connector: Any) -> Iterator[None]:
    """What `get_kv_transfer_group()` returns inside vLLM's runner glue, restored afterwards."""
    state = worker_mods(api)["kv_transfer_state"]
    _require(state, "_KV_CONNECTOR_AGENT", "kv_transfer_state")
    saved = state._KV_CONNECTOR_AGENT
    state._KV_CONNECTOR_AGENT = connector
    try:
        yield
    finally:
        state._KV_CONNECTOR_AGENT = saved


def forward_context(api: VllmApi, vllm_config: Any) -> Any:
    return _require(worker_mods(api)["forward_context"], "set_forward_context", "vllm.forward_context")(
        None, vllm_config)


def runner_mixin(api: VllmApi) -> Any:
    """V1 GPUModelRunner's connector lifecycle (`KVConnectorModelRunnerMixin`)."""
    mod = worker_mods(api).get("runner_mixin")
    if mod is None:
        from kvdoctor.errors import UsageError

        raise UsageError("--model-runner v1: this vLLM has no V1 model runner connector glue "
                         "(KVConnectorModelRunnerMixin); use --model-runner v2")
    return _require(mod, "KVConnectorModelRunnerMixin", "kv_connector_model_runner_mixin")


def v2_connector(api: VllmApi, vllm_config: Any, kv_caches: dict[str, Any]) -> Any:
    """Model Runner V2's `ActiveKVConnector` (registers the KV caches itself)."""
    return worker_mods(api)["v2_kv_connector"].get_kv_connector(vllm_config, kv_caches)


def completed_job_ids(kv_connector_output: Any) -> list[int]:
    """Jobs a worker reported as done and successful: 0.34's `mark_completed(success=False)` puts a
    failed job in `completed_jobs` and `failed_jobs` both."""
    meta = getattr(kv_connector_output, "kv_connector_worker_meta", None) if kv_connector_output else None
    failed = set(failed_job_ids(kv_connector_output))
    return sorted(int(j) for j in (getattr(meta, "completed_jobs", None) or ()) if int(j) not in failed)


def failed_job_ids(kv_connector_output: Any) -> list[int]:
    """Jobs a worker reported as failed (0.34: `failed_jobs`; absent before)."""
    meta = getattr(kv_connector_output, "kv_connector_worker_meta", None) if kv_connector_output else None
    return sorted(int(j) for j in (getattr(meta, "failed_jobs", None) or ()))


def kv_layer_specs(kv_cache_config: Any) -> dict[str, tuple[int, Any]]:
    """layer name -> (group index, its KV spec), across every KV cache group."""
    out: dict[str, tuple[int, Any]] = {}
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        per_layer = getattr(group.kv_cache_spec, "kv_cache_specs", None) or {}
        for layer in group.layer_names:
            out[layer] = (gid, per_layer.get(layer, group.kv_cache_spec))
    return out


def attention_window(spec: Any) -> int | None:
    """The tokens a sliding-window layer attends to (its own and the window - 1 before it);
    None for full attention."""
    window = getattr(spec, "sliding_window", None)
    return int(window) if window else None


def is_attention_spec(api: VllmApi, spec: Any) -> bool:
    return isinstance(spec, api.cls("kv_cache_interface", "AttentionSpec"))


def kv_tensor_layers(kv_tensor: Any) -> list[str]:
    """The layers one KVCacheTensor backs (0.26 `shared_by`, 0.33 `layers`)."""
    for name in ("shared_by", "layers"):
        value = getattr(kv_tensor, name, None)
        if value is not None:
            return list(value)
    raise IncompatibleVllmError("KVCacheTensor has neither shared_by nor layers")


def required_kv_cache_layout(scheduler: Any) -> str | None:
    """The KV cache layout the scheduler's connector asks for (0.33+), None where it asks none."""
    connector = getattr(scheduler, "connector", None)
    probe = getattr(type(connector), "get_required_kvcache_layout", None)
    if probe is None:
        return None
    try:
        return probe(vllm_config_of(scheduler))
    except Exception:  # noqa: BLE001 - a connector that cannot say asks for nothing in particular
        return None


def allocate_kv_caches(api: VllmApi, kv_cache_config: Any, device: Any, fill: int,
                       layout_name: str | None = None) -> dict[str, Any]:
    """Per-layer KV cache tensors as the release's GPU model runner would hand them to the
    connector, filled with `fill` bytes. Where the release has `allocate_kv_cache` (0.33) it is
    vLLM's own; otherwise one buffer per KVCacheTensor viewed (num_blocks, page) per layer,
    which is what 0.26's `register_kv_caches` rebuilds from storage."""
    import torch

    mods = worker_mods(api)
    utils = mods.get("worker_utils")
    allocate = getattr(utils, "allocate_kv_cache", None) if utils else None
    layout_mod = mods.get("kv_cache_layout")
    if allocate is not None and layout_mod is not None and hasattr(layout_mod, "KVCacheLayout"):
        layout_name = getattr(kv_cache_config, "kv_cache_layout", None) or layout_name
        members = layout_mod.KVCacheLayout.__members__
        layout = members[layout_name] if layout_name in members else next(iter(members.values()))
        kv = allocate(kv_cache_config, torch.device(device), layout)
        for tensor in kv.values():
            first = tensor[0] if isinstance(tensor, list) else tensor
            torch.tensor([], dtype=torch.int8, device=first.device).set_(first.untyped_storage()).fill_(fill)
        return kv
    n = kv_cache_config.num_blocks
    specs = kv_layer_specs(kv_cache_config)
    kv: dict[str, Any] = {}
    for kv_tensor in kv_cache_config.kv_cache_tensors:
        raw = torch.full((int(kv_tensor.size),), fill, dtype=torch.int8, device=device)
        for layer in kv_tensor_layers(kv_tensor):
            page = int(specs[layer][1].page_size_bytes)
            kv[layer] = raw[: n * page].view(n, page)
    return kv


def kv_pages(kv_tensor: Any, num_blocks: int, page_bytes: int) -> Any:
    """An int8 (num_blocks, page) view of one layer's KV: block b's page is row b.

    The same reading of storage, offset and block stride that the connector's
    `register_kv_caches` makes (dim 0 of the layer tensor, or of its (2, blocks, ...) halves,
    is the block index and a page is stride(0) bytes)."""
    import torch

    t = kv_tensor[0] if isinstance(kv_tensor, list) else kv_tensor
    elem = t.element_size()
    offset = t.storage_offset() * elem
    stride = page_bytes
    if t.ndim >= 1 and t.shape[0] == num_blocks and t.stride(0) * elem >= page_bytes:
        stride = t.stride(0) * elem
    raw = torch.tensor([], dtype=torch.int8, device=t.device).set_(t.untyped_storage())
    return torch.as_strided(raw, (num_blocks, page_bytes), (stride, 1), offset)


def scheduled_new_tokens(new_request: Any) -> list[int]:
    """Tokens of a newly scheduled request (V2 sends a resumed request as new, all tokens in
    `prefill_token_ids`)."""
    tokens = getattr(new_request, "prefill_token_ids", None) or new_request.prompt_token_ids
    return list(tokens or ())


def offloading_worker_of(connector: Any) -> Any:
    """The `OffloadingWorker` a worker-role connector's spec built (None before registration)."""
    worker_side = _require(connector, "connector_worker", type(connector).__name__)
    return getattr(worker_side, "worker", None) if worker_side is not None else None


# -- the engine level (`--engine core`): vLLM's EngineCore and Executor -----------------------
# Imported only for engine-level runs; the scheduler level never touches these modules.

def engine_core_class() -> Any:
    return _require(_import("vllm.v1.engine.core"), "EngineCore", "vllm.v1.engine.core")


def executor_base_class() -> Any:
    return _require(_import("vllm.v1.executor.abstract"), "Executor", "vllm.v1.executor.abstract")


def resolve_executor_class(vllm_config: Any) -> Any:
    """The executor class vLLM itself resolves from `distributed_executor_backend` (a qualified name)."""
    return executor_base_class().get_class(vllm_config)


def engine_core_request(request_id: str, prompt: list[int], sampling_params: Any) -> Any:
    """An `EngineCoreRequest` as an in-process client sends it (token ids, no multimodal input).

    Only the fields this release's struct declares are passed (feature probe: 0.26-0.34 share the
    required ones; later optional fields keep their defaults)."""
    import time

    cls = _require(_import("vllm.v1.engine"), "EngineCoreRequest", "vllm.v1.engine")
    wanted: dict[str, Any] = dict(request_id=request_id, prompt_token_ids=list(prompt), mm_features=None,
                                  sampling_params=sampling_params, pooling_params=None, arrival_time=time.time(),
                                  lora_request=None, cache_salt=None, data_parallel_rank=None)
    fields = set(getattr(cls, "__struct_fields__", ()) or wanted)
    return cls(**{k: v for k, v in wanted.items() if k in fields})


def engine_step_fn_name(core: Any) -> str:
    """`step` or `step_with_batch_queue` (async scheduling / pipeline parallelism): the one the engine uses."""
    return getattr(getattr(core, "step_fn", None), "__name__", "step")


def engine_batch_queue_len(core: Any) -> int:
    return len(getattr(core, "batch_queue", None) or ())


@contextmanager
def lean_engine_core_lifecycle() -> Iterator[None]:
    """EngineCore's start-up `freeze_gc_heap` and its shutdown's `cleanup_dist_env_and_memory` run full
    garbage collections (measured on 0.26.0: four, ~1 s each on a heap holding vLLM, 4 of the 4.2 s an
    in-process queued-abort takes). An engine that runs no model and joins no process group has nothing
    for them to freeze or clean, so inside this scope only they are no-ops; the originals come back on
    exit, also when the engine raised. Names probed: a release without them runs unchanged."""
    module = _import("vllm.v1.engine.core")
    saved = {name: getattr(module, name) for name in ("freeze_gc_heap", "cleanup_dist_env_and_memory")
             if hasattr(module, name)}
    for name in saved:
        setattr(module, name, lambda *args, **kwargs: None)
    try:
        yield
    finally:
        for name, original in saved.items():
            setattr(module, name, original)
