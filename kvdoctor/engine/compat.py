"""The one place that knows vLLM's private names and per-release signatures.

Everything else in kvdoctor talks to vLLM through `VllmApi`. When a release
moves something, this module fails with one clear line (exit 3) instead of an
AttributeError deep inside a scenario.
"""

from __future__ import annotations

import dataclasses
import importlib
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
    def storable_chunks_takes_group_state(self) -> bool:
        """0.26.0: storable_chunks(group_config, n); 0.27.0+: (group_config, group_state, n)."""
        params = list(inspect.signature(self.RequestOffloadState.storable_chunks).parameters)
        if params[:2] != ["self", "group_config"] or len(params) not in (3, 4):
            raise IncompatibleVllmError(
                f"RequestOffloadState.storable_chunks has an unknown signature {params}"
            )
        return len(params) == 4

    @cached_property
    def aborted_store_counts_computed_tokens(self) -> bool:
        """Whether `_build_store_jobs` treats FINISHED_ABORTED specially (PR #49285).

        Read from the method's bytecode names (a feature probe, not a version
        check); only used to predict the next step in `inspect`, never for a verdict.
        """
        code = self.OffloadingConnectorScheduler._build_store_jobs.__code__
        return "FINISHED_ABORTED" in code.co_names

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
    def connector_scheduler(self, scheduler: Any) -> Any:
        connector = _require(scheduler, "connector", "Scheduler")
        if connector is None:
            raise IncompatibleVllmError("the scheduler built no KV connector")
        return _require(connector, "connector_scheduler", type(connector).__name__)

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

    def has_offloading_spec(self, name: str) -> bool:
        """Whether `kv_connector_extra_config.spec_name = name` resolves in this vLLM."""
        try:
            factory = importlib.import_module("vllm.v1.kv_offload.factory")
        except Exception:  # noqa: BLE001 - absent means not applicable, not an error
            return False
        registry = getattr(getattr(factory, "OffloadingSpecFactory", None), "_registry", {}) or {}
        return name in registry

    def kv_cache_group_has_field(self, name: str) -> bool:
        cls = self.cls("kv_cache_interface", "KVCacheGroupSpec")
        return name in {f.name for f in dataclasses.fields(cls)}

    @staticmethod
    def job_is_store(job_status: Any) -> bool:
        return bool(getattr(job_status, "is_store", False))

    @staticmethod
    def store_and_load_jobs(scheduler_output: Any) -> tuple[dict[int, Any], dict[int, Any]]:
        meta = getattr(scheduler_output, "kv_connector_metadata", None)
        if meta is None:
            return {}, {}
        return dict(getattr(meta, "store_jobs", {}) or {}), dict(getattr(meta, "load_jobs", {}) or {})

    @staticmethod
    def block_ids_of(spec: Any) -> tuple[int, ...]:
        """Block ids of a GPULoadStoreSpec (a numpy array in vLLM)."""
        ids = getattr(spec, "block_ids", None)
        return tuple(int(b) for b in ids) if ids is not None else ()

    @staticmethod
    def allocated_block_ids(scheduler_output: Any, block_size: int) -> set[int]:
        """GPU blocks freshly allocated to scheduled requests in this step.

        A new or resumed request's block list starts with its prefix-cache hits
        (shared, same content): those are not allocations. Block 0 is the null block.
        """
        allocated: set[int] = set()
        for new in scheduler_output.scheduled_new_reqs:
            skip = int(new.num_computed_tokens) // block_size
            allocated.update(b for group in new.block_ids or () for b in group[skip:] if b != 0)
        cached = scheduler_output.scheduled_cached_reqs
        resumed = set(getattr(cached, "resumed_req_ids", ()) or ())
        for i, req_id in enumerate(cached.req_ids):
            groups = cached.new_block_ids[i]
            skip = int(cached.num_computed_tokens[i]) // block_size if req_id in resumed else 0
            allocated.update(b for group in groups or () for b in group[skip:] if b != 0)
        return allocated

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
}


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

