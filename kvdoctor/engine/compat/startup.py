"""vLLM's start-up path of the offloading connector, for `kvdoctor check` (its private names live here).

`build_offloading_config` (offloading/config.py) and `OffloadingSpecFactory.create_spec` are what
`OffloadingConnector.__init__` calls; a spec's constructor sizes its CPU tier (`num_blocks`,
`kv_bytes_per_chunk`) without mapping it. `SharedOffloadRegion` (cpu/shared_offload_region.py) is the
/dev/shm mapping a spec may use; `madvise(MADV_POPULATE_WRITE)` there is where a region larger than the
host fails (`OSError: [Errno 14] Bad address`). Each is found by a feature probe; None where absent.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

from kvdoctor.engine.compat.imports import _import

OFFLOADING_CONFIG_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.config"
BUILD_OFFLOADING_CONFIG = "build_offloading_config"
SPEC_FACTORY_MODULE = "vllm.v1.kv_offload.factory"
SPEC_FACTORY = "OffloadingSpecFactory"
SHARED_REGION_MODULE = "vllm.v1.kv_offload.cpu.shared_offload_region"
SHARED_REGION = "SharedOffloadRegion"
CPU_WORKER_MODULE = "vllm.v1.kv_offload.cpu.gpu_worker"
SPEC_CHUNKS = ("num_blocks", "num_chunks")  # a spec's CPU tier in chunks (0.34 renamed num_blocks)
SPEC_CHUNK_BYTES = "kv_bytes_per_chunk"


def build_offloading_spec(vllm_config: Any, kv_cache_config: Any) -> Any | None:
    """The offloading spec vLLM's connector would create at these configs (None: this vLLM has no such
    path, probed). vLLM's own refusals (asserts, ValueErrors) propagate unchanged."""
    try:
        config_mod = _import(OFFLOADING_CONFIG_MODULE)
    except Exception:
        return None
    build = getattr(config_mod, BUILD_OFFLOADING_CONFIG, None)
    factory = getattr(_import(SPEC_FACTORY_MODULE), SPEC_FACTORY, None)
    if build is None or factory is None:
        return None
    return factory.create_spec(build(vllm_config, kv_cache_config))


def spec_region_bytes(spec: Any) -> int | None:
    """The CPU tier's bytes the spec sized (`num_blocks * kv_bytes_per_chunk`); None where it does not say."""
    chunks = next((getattr(spec, name) for name in SPEC_CHUNKS if hasattr(spec, name)), None)
    per_chunk = getattr(spec, SPEC_CHUNK_BYTES, None)
    if not isinstance(chunks, int) or not isinstance(per_chunk, int):
        return None
    return chunks * per_chunk


def spec_maps_shared_region(spec: Any) -> bool:
    """Whether this spec's module maps its tier through vLLM's /dev/shm `SharedOffloadRegion`."""
    module = sys.modules.get(type(spec).__module__)
    return module is not None and hasattr(module, SHARED_REGION)


def _source_site(module: str, needle: str) -> tuple[str, int] | None:
    """(file, line) of the last line of `module`'s source holding `needle` (read, not imported)."""
    import importlib.util

    try:
        found = importlib.util.find_spec(module)
        path = found.origin if found is not None else None
        if not path:
            return None
        with open(path) as handle:
            lines = handle.read().splitlines()
    except (ImportError, OSError, ValueError):
        return None
    hits = [i for i, text in enumerate(lines, 1) if needle in text]
    return (path, hits[-1]) if path and hits else None


def manager_maps_region(spec: Any) -> bool:
    """Whether the spec's scheduler side (`get_manager`) maps the shared region itself (the tiering spec)."""
    try:
        return f"{SHARED_REGION}(" in inspect.getsource(type(spec).get_manager)
    except (TypeError, OSError, AttributeError):
        return False


def shared_region_site() -> tuple[str, int] | None:
    """Where an oversize /dev/shm region fails: its MADV_POPULATE_WRITE `madvise(` call."""
    return _source_site(SHARED_REGION_MODULE, "madvise(")


def worker_tensor_site() -> tuple[str, int] | None:
    """Where a worker allocates its pinned CPU tier tensors (`cpu_tensor = torch.zeros(`)."""
    return _source_site(CPU_WORKER_MODULE, "cpu_tensor = torch.zeros(")


def build_offloading_config_source() -> str | None:
    """The installed `build_offloading_config`'s source: a feature probe for the refusals it holds."""
    try:
        build = getattr(_import(OFFLOADING_CONFIG_MODULE), BUILD_OFFLOADING_CONFIG, None)
        return inspect.getsource(build) if build is not None else None
    except (Exception, OSError):
        return None
