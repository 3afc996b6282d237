"""Adapter reads that need nothing but vLLM's own objects (no kvdoctor import, no vLLM import).

The one definition of these reads and probes: `VllmApi` calls them, and an exported
standalone script (which imports only vLLM) gets this module's functions copied in
verbatim by `inline_portable`, so the two can never drift apart.
"""

import dataclasses
import inspect
from typing import Any


def request_states(connector_scheduler: Any) -> dict[str, Any]:
    """The OffloadingConnector scheduler's per-request offload state, by request id (a private dict)."""
    return connector_scheduler._req_status


def allocated_block_count(group_state: Any) -> int:
    """GPU blocks a request's KV group holds (`RequestGroupState.block_ids`): what PR #49146 caps by."""
    return len(group_state.block_ids)


def worker_reports_failed_jobs(worker_metadata_cls: Any) -> bool:
    """Feature probe: `OffloadingWorkerMetadata.mark_completed(job_id, success)` (0.34+) lets a
    worker report a failed transfer; before, the offloading worker asserts every transfer succeeds."""
    return "success" in inspect.signature(worker_metadata_cls.mark_completed).parameters


def runner_output_takes_req_id_to_index(model_runner_output_cls: Any) -> bool:
    """Feature probe: `ModelRunnerOutput.req_id_to_index` (a field until 0.33, gone in 0.34)."""
    return "req_id_to_index" in {f.name for f in dataclasses.fields(model_runner_output_cls)}


def kv_cache_tensor(kv_cache_tensor_cls: Any, size: int, layer: str, page_bytes: int, num_blocks: int) -> Any:
    """One layer's `KVCacheTensor`: `shared_by` until 0.32, layout fields (`layers`, strides) from 0.33."""
    names = {f.name for f in dataclasses.fields(kv_cache_tensor_cls)}
    if "shared_by" in names:
        return kv_cache_tensor_cls(size=size, shared_by=[layer])
    if {"layers", "layer_stride", "block_stride"} <= names:
        return kv_cache_tensor_cls(size=size, layers=[layer], layer_stride=page_bytes * num_blocks,
                                   block_stride=page_bytes)
    raise TypeError(f"KVCacheTensor has unknown fields {sorted(names)}")


def default_kv_cache_layouts() -> list[str]:
    """0.33+ asks each worker for its KV cache layouts, most preferred first: vLLM's own default
    preference (a private constant), or NHD where this release has none."""
    try:
        from vllm.v1.attention.backends.utils import _DEFAULT_LAYOUT_PREFERENCE
    except ImportError:
        return ["NHD"]
    return [layout.name for layout in _DEFAULT_LAYOUT_PREFERENCE]


def aliased_kv_cache_tensors(kv_cache_tensor_cls: Any, group_layers: list[list[str]], page_bytes: int,
                             num_blocks: int) -> list[Any]:
    """KVCacheTensors for `group_layers` (per group, its layers), placed as vLLM places a hybrid model's:
    layer j of every group aliases the same bytes. Until 0.32 one tensor per j (`shared_by`); from 0.33 one
    tensor per group over a single backing allocation (`layers`, strides), the groups overlaid."""
    names = {f.name for f in dataclasses.fields(kv_cache_tensor_cls)}
    columns = max(len(layers) for layers in group_layers)
    region = page_bytes * num_blocks
    if "shared_by" in names:
        return [kv_cache_tensor_cls(size=region, shared_by=[layers[j] for layers in group_layers if j < len(layers)])
                for j in range(columns)]
    if {"layers", "layer_stride", "block_stride"} <= names:
        return [kv_cache_tensor_cls(size=region * columns, layers=list(layers), layer_stride=region,
                                    block_stride=page_bytes) for layers in group_layers]
    raise TypeError(f"KVCacheTensor has unknown fields {sorted(names)}")


def resumed_req_ids(cached_requests: Any) -> set[str]:
    """Cached requests resumed after a preemption (`CachedRequestData.resumed_req_ids`; a release without it
    sends a resumed request among the new ones): their `new_block_ids` replace the request's blocks."""
    return set(getattr(cached_requests, "resumed_req_ids", ()) or ())


def spec_block_ids(spec: Any) -> list[int]:
    """Block ids of a Load/StoreSpec (GPU block ids, or the CPU tier's chunk ids; a numpy array in vLLM)."""
    ids = getattr(spec, "block_ids", None)
    return [int(b) for b in ids] if ids is not None else []


def sub_connector_metadatas(connector_metadata: Any) -> tuple[Any, ...]:
    """A step's connector metadata, one per (sub-)connector: a MultiConnector's `MultiKVConnectorMetadata`
    holds its sub-connectors' in order (`metadata`, a tuple); any other connector's is its own."""
    inner = getattr(connector_metadata, "metadata", None)
    return tuple(inner) if isinstance(inner, tuple) else (connector_metadata,)


def multi_worker_metadata(parts: list[Any]) -> Any:
    """The worker metadata a MultiConnector worker reports: its sub-connectors' in order
    (`MultiKVConnectorWorkerMetadata.metadata`, which the scheduler's MultiConnector hands back to each)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiKVConnectorWorkerMetadata

    return MultiKVConnectorWorkerMetadata(metadata=tuple(parts))
