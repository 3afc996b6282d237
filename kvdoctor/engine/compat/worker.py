"""The worker side (`--worker vllm`): vLLM's worker-role connector, its runner glue, KV tensors.

Methods of `VllmApi` (mixed in), so every adapter call reads `api.<name>(...)`. The
worker-side modules are imported only when a run asks for vLLM's worker, so the
simulated path costs nothing more.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import importlib.util
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import kvdoctor.engine.compat.names as names
import kvdoctor.engine.compat.portable as portable
from kvdoctor.engine.compat.imports import AdapterBase, _import, _require, _silenced_stderr
from kvdoctor.errors import IncompatibleVllmError, UsageError

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

SCHEDULER_RUNNER_AGNOSTIC = "any (this release's scheduler output does not depend on the runner)"


class WorkerGlue(AdapterBase):
    """vLLM's worker-role connector and the model runners' connector calls, per release."""

    @staticmethod
    def block_ids_of(spec: Any) -> tuple[int, ...]:
        """Block ids of a GPULoadStoreSpec (a numpy array in vLLM)."""
        return tuple(portable.spec_block_ids(spec))

    def worker_mods(self) -> dict[str, Any]:
        """The worker-side modules, imported once (added to `self.mods`)."""
        if "connector_factory" not in self.mods:
            with _silenced_stderr():
                for key, name in _WORKER_MODULES.items():
                    self.mods[key] = _import(name)
                for key, name in _OPTIONAL_WORKER_MODULES.items():
                    try:
                        self.mods[key] = importlib.import_module(name)
                    except Exception:  # absent in this release: probed where used
                        self.mods[key] = None
        return self.mods

    def offloading_worker_base(self) -> Any:
        """vLLM's `OffloadingWorker` ABC (what a spec's `get_worker` must return)."""
        return _require(_import("vllm.v1.kv_offload.base"), "OffloadingWorker", "vllm.v1.kv_offload.base")

    def offloading_spec_class(self, name: str) -> Any:
        """A registered spec class by its `spec_name` (e.g. CPUOffloadingSpec, TieringOffloadingSpec)."""
        factory = _require(_import("vllm.v1.kv_offload.factory"), "OffloadingSpecFactory", "vllm.v1.kv_offload.factory")
        registry = names.get(factory, names.SPEC_REGISTRY, None) or {}
        if name not in registry:
            raise IncompatibleVllmError(f"this vLLM registers no offloading spec named {name!r}")
        return registry[name]()

    def transfer_result(self, job_id: int, success: bool, size: int, seconds: float) -> Any:
        cls = _require(_import("vllm.v1.kv_offload.base"), "TransferResult", "vllm.v1.kv_offload.base")
        return cls(job_id=job_id, success=success, transfer_size=size, transfer_time=seconds)

    def compute_sub_block_ptrs(self) -> Any:
        """vLLM's own pointer arithmetic for the direct-layout copy plan."""
        return _require(_import("vllm.v1.kv_offload.cpu.gpu_worker"), "compute_sub_block_ptrs",
                        "vllm.v1.kv_offload.cpu.gpu_worker")

    def spec_cpu_blocks(self, spec: Any) -> int:
        """CPU-tier slots of one chunk each: `num_chunks` (0.33) or `num_blocks` (0.26)."""
        for name in ("num_chunks", "num_blocks"):
            value = getattr(spec, name, None)
            if value is not None:
                return int(value)
        raise IncompatibleVllmError(f"{type(spec).__name__} has neither num_chunks nor num_blocks")

    def spec_extra_config(self, spec: Any) -> dict[str, Any]:
        return dict(_require(spec, "extra_config", type(spec).__name__) or {})

    def spec_blocks_per_chunk(self, spec: Any) -> int:
        return int(_require(spec, "blocks_per_chunk", type(spec).__name__))

    def gpu_spec_groups(self, spec: Any, num_groups: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(group_sizes, block_indices) of a GPULoadStoreSpec (one group when the field is absent)."""
        ids = self.block_ids_of(spec)
        sizes = tuple(int(s) for s in getattr(spec, "group_sizes", None) or (len(ids),) + (0,) * (num_groups - 1))
        indices = tuple(int(i) for i in getattr(spec, "block_indices", None) or (0,) * len(sizes))
        return sizes, indices

    def vllm_config_of(self, scheduler: Any) -> Any:
        return _require(scheduler, "vllm_config", type(scheduler).__name__)

    def kv_cache_config_of(self, scheduler: Any) -> Any:
        """The KVCacheConfig the scheduler was built with (the worker's KV tensors follow it)."""
        return _require(scheduler, "kv_cache_config", type(scheduler).__name__)

    def scheduler_model_runner(self, scheduler: Any) -> str:
        """Which runner the scheduler shapes its output for; 0.34 has no such switch (feature probe)."""
        if not hasattr(scheduler, "use_v2_model_runner"):
            return SCHEDULER_RUNNER_AGNOSTIC
        return "v2" if scheduler.use_v2_model_runner else "v1"

    def set_scheduler_model_runner(self, scheduler: Any, runner: str) -> None:
        """The scheduler shapes its output for the model runner it serves (V2: resumed = new).

        A release whose scheduler has no `use_v2_model_runner` shapes one output for both runners:
        nothing to set there."""
        if hasattr(scheduler, "use_v2_model_runner"):
            scheduler.use_v2_model_runner = runner == "v2"

    def gpu_default_model_runner(self, vllm_config: Any) -> str:
        """The runner a CUDA deployment of this release picks for this model: V2 where vLLM
        names the architecture a default-V2 model and reports no unsupported feature (Triton is
        assumed present, as on a GPU); V1 otherwise or where the release has no V2 runner."""
        if importlib.util.find_spec(names.RUNNER_MIXIN_MODULE) is None:
            return "v2"  # this release has no V1 runner glue: V2 is the only runner
        env_choice = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
        if env_choice is not None:
            return "v2" if env_choice.strip().lower() in ("1", "true") else "v1"
        is_default = names.get(vllm_config, names.IS_DEFAULT_V2_RUNNER_MODEL, None)  # 0.26: per architecture
        unsupported = names.get(vllm_config, names.V2_RUNNER_UNSUPPORTED, None)
        if unsupported is None:
            return "v1"
        try:
            default_model = is_default() if is_default is not None else True  # 0.33: V2 for every model
            return "v2" if default_model and not unsupported() else "v1"
        except Exception:  # a probe that cannot answer means the release's plain default
            return "v1"

    def has_v2_kv_connector(self) -> bool:
        mod = self.worker_mods().get("v2_kv_connector")
        return mod is not None and hasattr(mod, "get_kv_connector")

    def create_worker_connector(self, vllm_config: Any, kv_cache_config: Any) -> Any:
        """The WORKER-role connector, as `ensure_kv_transfer_initialized` creates it in one process."""
        mods = self.worker_mods()
        factory = _require(mods["connector_factory"], "KVConnectorFactory", "kv_connector.factory")
        role = _require(mods["connector_base"], "KVConnectorRole", "kv_connector.v1").WORKER
        return factory.create_connector(config=vllm_config, role=role, kv_cache_config=kv_cache_config)

    @contextmanager
    def active_worker_connector(self, connector: Any) -> Iterator[None]:
        """What `get_kv_transfer_group()` returns inside vLLM's runner glue, restored afterwards."""
        state = self.worker_mods()["kv_transfer_state"]
        saved = names.get(state, names.KV_CONNECTOR_AGENT)
        names.put(state, names.KV_CONNECTOR_AGENT, connector)
        try:
            yield
        finally:
            names.put(state, names.KV_CONNECTOR_AGENT, saved)

    def forward_context(self, vllm_config: Any) -> Any:
        return _require(self.worker_mods()["forward_context"], "set_forward_context", "vllm.forward_context")(
            None, vllm_config)

    def runner_mixin(self) -> Any:
        """V1 GPUModelRunner's connector lifecycle (`KVConnectorModelRunnerMixin`)."""
        mod = self.worker_mods().get("runner_mixin")
        if mod is None:
            raise UsageError("--model-runner v1: this vLLM has no V1 model runner connector glue "
                             "(KVConnectorModelRunnerMixin); use --model-runner v2")
        return _require(mod, "KVConnectorModelRunnerMixin", "kv_connector_model_runner_mixin")

    @staticmethod
    def v1_no_forward_output(mixin: Any, scheduler_output: Any, vllm_config: Any) -> Any:
        """V1 runner, a step without tokens: `kv_connector_no_forward`'s KVConnectorOutput."""
        return mixin.kv_connector_no_forward(scheduler_output, vllm_config).kv_connector_output

    @staticmethod
    def v1_forward_output(mixin: Any, scheduler_output: Any) -> Any:
        """V1 runner, around the forward: the context manager yielding the step's KVConnectorOutput
        (`KVConnectorModelRunnerMixin._get_kv_connector_output`, private to vLLM)."""
        method = names.get(mixin, names.GET_KV_CONNECTOR_OUTPUT)
        return method(scheduler_output)

    @staticmethod
    def v2_finish_forward(active_connector: Any) -> None:
        """Model Runner V2's `ActiveKVConnector.finish_forward`, where the release has it."""
        finish = getattr(active_connector, "finish_forward", None)
        if finish is not None:
            finish()

    @staticmethod
    def is_device_pointers(spec: Any) -> bool:
        """0.34+: the connector hands the worker resolved `DevicePointers` instead of a GPU block spec."""
        return hasattr(spec, "ptrs") and hasattr(spec, "group_block_counts")

    def v2_connector(self, vllm_config: Any, kv_caches: dict[str, Any]) -> Any:
        """Model Runner V2's `ActiveKVConnector` (registers the KV caches itself)."""
        return self.worker_mods()["v2_kv_connector"].get_kv_connector(vllm_config, kv_caches)

    @staticmethod
    def _worker_meta(kv_connector_output: Any, index: int) -> Any:
        """The worker metadata of (sub-)connector `index`: a MultiConnector worker reports one per sub-connector
        (`MultiKVConnectorWorkerMetadata.metadata`, in the connectors' order; its job ids overlap)."""
        meta = getattr(kv_connector_output, "kv_connector_worker_meta", None) if kv_connector_output else None
        subs = getattr(meta, "metadata", None)
        if isinstance(subs, tuple):
            return subs[index] if index < len(subs) else None
        return meta

    def completed_job_ids(self, kv_connector_output: Any, index: int = 0) -> list[int]:
        """Jobs a worker reported as done and successful (of sub-connector `index` under a MultiConnector):
        0.34's `mark_completed(success=False)` puts a failed job in `completed_jobs` and `failed_jobs` both."""
        meta = self._worker_meta(kv_connector_output, index)
        failed = set(self.failed_job_ids(kv_connector_output, index))
        return sorted(int(j) for j in (getattr(meta, "completed_jobs", None) or ()) if int(j) not in failed)

    def failed_job_ids(self, kv_connector_output: Any, index: int = 0) -> list[int]:
        """Jobs a worker reported as failed (0.34: `failed_jobs`; absent before)."""
        meta = self._worker_meta(kv_connector_output, index)
        return sorted(int(j) for j in (getattr(meta, "failed_jobs", None) or ()))

    def sub_connector_configs(self, vllm_config: Any) -> list[Any] | None:
        """Under a MultiConnector, each sub-connector's own config as `MultiConnector` builds it (a shallow copy of
        `vllm_config` with the sub-connector's KVTransferConfig; their extra configs are the very dicts of the
        `connectors` list, so a key written into one reaches that sub-connector); None for any other connector."""
        from kvdoctor.engine.connector_config import MULTI_CONNECTOR

        ktc = vllm_config.kv_transfer_config
        subs = (ktc.kv_connector_extra_config or {}).get("connectors") if ktc is not None else None
        if ktc is None or ktc.kv_connector != MULTI_CONNECTOR or not subs:
            return None
        cls = self.cls("config", "KVTransferConfig")
        configs = []
        for sub in subs:
            config = copy.copy(vllm_config)
            config.kv_transfer_config = cls(**{**sub, "engine_id": sub.get("engine_id", ktc.engine_id)})
            config.kv_transfer_config.kv_connector_extra_config = sub.setdefault("kv_connector_extra_config", {})
            configs.append(config)
        return configs

    def kv_layer_specs(self, kv_cache_config: Any) -> dict[str, tuple[int, Any]]:
        """layer name -> (group index, its KV spec), across every KV cache group."""
        out: dict[str, tuple[int, Any]] = {}
        for gid, group in enumerate(kv_cache_config.kv_cache_groups):
            per_layer = getattr(group.kv_cache_spec, "kv_cache_specs", None) or {}
            for layer in group.layer_names:
                out[layer] = (gid, per_layer.get(layer, group.kv_cache_spec))
        return out

    def attention_window(self, spec: Any) -> int | None:
        """The tokens a sliding-window layer attends to (its own and the window - 1 before it);
        None for full attention."""
        window = getattr(spec, "sliding_window", None)
        return int(window) if window else None

    def is_attention_spec(self, spec: Any) -> bool:
        return isinstance(spec, self.cls("kv_cache_interface", "AttentionSpec"))

    def kv_tensor_layers(self, kv_tensor: Any) -> list[str]:
        """The layers one KVCacheTensor backs (0.26 `shared_by`, 0.33 `layers`)."""
        for name in ("shared_by", "layers"):
            value = getattr(kv_tensor, name, None)
            if value is not None:
                return list(value)
        raise IncompatibleVllmError("KVCacheTensor has neither shared_by nor layers")

    def served_scheduler_view(self, vllm_config: Any, kv_cache_config: Any) -> Any:
        """What the vLLM worker reads of a scheduler (its configs; its connector's class, asked for a KV
        layout), for the executor of a `vllm serve` child: the engine builds its scheduler after the
        executor's KV caches, from the same configs."""
        factory = _require(self.worker_mods()["connector_factory"], "KVConnectorFactory", "kv_connector.factory")
        try:
            connector_class: Any = factory.get_connector_class(vllm_config.kv_transfer_config)
        except Exception:  # a release without the class lookup: no layout asked for
            connector_class = object
        return _SchedulerView(vllm_config, kv_cache_config, connector_class)

    def served_model_runner(self, vllm_config: Any) -> str:
        """The runner a served engine's scheduler shapes its output for: its config's (0.26-0.33:
        VllmConfig.use_v2_model_runner), else what a GPU deployment of this release runs."""
        choice = getattr(vllm_config, "use_v2_model_runner", None)
        if isinstance(choice, bool):
            return "v2" if choice else "v1"
        return self.gpu_default_model_runner(vllm_config)

    def required_kv_cache_layout(self, scheduler: Any) -> str | None:
        """The KV cache layout the scheduler's connector asks for (0.33+), None where it asks none."""
        connector = getattr(scheduler, "connector", None)
        probe = getattr(type(connector), "get_required_kvcache_layout", None)
        if probe is None:
            return None
        try:
            return probe(self.vllm_config_of(scheduler))
        except Exception:  # a connector that cannot say asks for nothing in particular
            return None

    def allocate_kv_caches(self, kv_cache_config: Any, device: Any, fill: int,
                           layout_name: str | None = None) -> dict[str, Any]:
        """Per-layer KV cache tensors as the release's GPU model runner would hand them to the
        connector, filled with `fill` bytes. Where the release has `allocate_kv_cache` (0.33) it is
        vLLM's own; otherwise one buffer per KVCacheTensor viewed (num_blocks, page) per layer,
        which is what 0.26's `register_kv_caches` rebuilds from storage."""
        import torch

        mods = self.worker_mods()
        utils = mods.get("worker_utils")
        allocate = getattr(utils, "allocate_kv_cache", None) if utils else None
        layout_mod = mods.get("kv_cache_layout")
        if allocate is not None and layout_mod is not None and hasattr(layout_mod, "KVCacheLayout"):
            layout_name = getattr(kv_cache_config, "kv_cache_layout", None) or layout_name
            members = layout_mod.KVCacheLayout.__members__
            layout = members[layout_name] if layout_name in members else next(iter(members.values()))
            allocated: dict[str, Any] = allocate(kv_cache_config, torch.device(device), layout)
            for tensor in allocated.values():
                first = tensor[0] if isinstance(tensor, list) else tensor
                torch.tensor([], dtype=torch.int8, device=first.device).set_(first.untyped_storage()).fill_(fill)
            return allocated
        n = kv_cache_config.num_blocks
        specs = self.kv_layer_specs(kv_cache_config)
        kv: dict[str, Any] = {}
        for kv_tensor in kv_cache_config.kv_cache_tensors:
            raw = torch.full((int(kv_tensor.size),), fill, dtype=torch.int8, device=device)
            for layer in self.kv_tensor_layers(kv_tensor):
                page = int(specs[layer][1].page_size_bytes)
                kv[layer] = raw[: n * page].view(n, page)
        return kv

    def fingerprint_kv_cache_config(self, kv_cache_config: Any, slot_bytes: int,
                                    layers_per_group: int = 1) -> Any:
        """The worker side's KVCacheConfig: the scheduler's groups, block sizes and block count, each group
        keeping its first `layers_per_group` layers, every page shrunk to `slot_bytes` per token slot of the
        largest block size (the toy model's fingerprint, not the model's head size). Tensors are placed as
        vLLM places a hybrid model's: layer j of every group aliases the same bytes (a block id belongs to
        one group at a time). The scheduler keeps the real config: page sizes, CPU blocks, groups."""
        groups = kv_cache_config.kv_cache_groups
        kept = [list(group.layer_names[:max(1, layers_per_group)]) for group in groups]
        specs = [self._group_layer_specs(group) for group in groups]
        page = fingerprint_page_bytes(slot_bytes, [int(group.kv_cache_spec.block_size) for group in groups])
        new_groups = []
        for group, layer_names, per_layer in zip(groups, kept, specs, strict=True):
            shrunk = {name: _shrink_spec(per_layer[name], page) for name in layer_names}
            spec = group.kv_cache_spec
            if getattr(spec, "kv_cache_specs", None) is not None:  # UniformTypeKVCacheSpecs
                spec = dataclasses.replace(spec, kv_cache_specs=shrunk)
            else:
                spec = shrunk[layer_names[0]]
            new_groups.append(dataclasses.replace(group, layer_names=layer_names, kv_cache_spec=spec))
        cls = self.cls("kv_cache_interface", "KVCacheTensor")
        tensors = portable.aliased_kv_cache_tensors(cls, kept, page, int(kv_cache_config.num_blocks))
        return dataclasses.replace(kv_cache_config, kv_cache_tensors=tensors, kv_cache_groups=new_groups)

    @staticmethod
    def _group_layer_specs(group: Any) -> dict[str, Any]:
        per_layer = getattr(group.kv_cache_spec, "kv_cache_specs", None) or {}
        return {name: per_layer.get(name, group.kv_cache_spec) for name in group.layer_names}

    def offloading_cpu_blocks(self, vllm_config: Any, kv_cache_config: Any) -> int:
        """The CPU-tier slots the connector's spec computes for this KV cache config (from its real page
        sizes and `cpu_bytes_to_use`), built as `OffloadingConnector.__init__` builds its spec."""
        module = _import("vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector")
        build = _require(module, "build_offloading_config", "offloading_connector")
        factory = _require(_import("vllm.v1.kv_offload.factory"), "OffloadingSpecFactory", "vllm.v1.kv_offload.factory")
        return self.spec_cpu_blocks(factory.create_spec(build(vllm_config, kv_cache_config)))

    def kv_pages(self, kv_tensor: Any, num_blocks: int, page_bytes: int) -> Any:
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

    def scheduled_new_tokens(self, new_request: Any) -> list[int]:
        """Tokens of a newly scheduled request (V2 sends a resumed request as new, all tokens in
        `prefill_token_ids`)."""
        tokens = getattr(new_request, "prefill_token_ids", None) or new_request.prompt_token_ids
        return list(tokens or ())

    def offloading_worker_of(self, connector: Any) -> Any:
        """The `OffloadingWorker` a worker-role connector's spec built (None before registration)."""
        worker_side = _require(connector, "connector_worker", type(connector).__name__)
        return getattr(worker_side, "worker", None) if worker_side is not None else None


def fingerprint_page_bytes(slot_bytes: int, block_sizes: list[int]) -> int:
    """One fingerprint page: `slot_bytes` for every token slot of the largest block (groups share a page
    size, as vLLM's planner makes them, so a smaller block gets wider slots)."""
    return slot_bytes * max(block_sizes)


def _shrink_spec(spec: Any, page: int) -> Any:
    """An attention spec of the same class and block size whose page is `page` bytes: one KV head, the head
    size that fills the page (padded where the page is not a multiple of one head's bytes)."""
    names = {f.name for f in dataclasses.fields(spec)}
    if not {"num_kv_heads", "head_size"} <= names:
        return spec  # not attention KV (Mamba state): the toy model refuses such a layer before this
    pad = {"page_size_padded": None} if "page_size_padded" in names else {}

    def sized(head: int) -> Any:  # V's head size (0.26+ `head_size_v`) follows K's, as a plain model's does
        value = {"head_size_v": head} if "head_size_v" in names else {}
        return dataclasses.replace(spec, num_kv_heads=1, head_size=head, **value, **pad)

    one, two = sized(1).page_size_bytes, sized(2).page_size_bytes
    per_dim, fixed = two - one, 2 * one - two
    head = max(1, (page - fixed) // per_dim) if per_dim > 0 else 1
    shrunk = sized(head)
    if shrunk.page_size_bytes != page:
        if "page_size_padded" not in names or shrunk.page_size_bytes > page:
            raise IncompatibleVllmError(f"{type(spec).__name__}: no head size gives a {page}-byte page "
                                        f"(kvdoctor's fingerprint KV)")
        shrunk = dataclasses.replace(shrunk, page_size_padded=page)
    return shrunk


class _SchedulerView:
    """A scheduler's configs and its connector's class, where no scheduler exists yet (`served_scheduler_view`)."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any, connector_class: Any) -> None:
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.connector = _class_probe(connector_class)


def _class_probe(connector_class: Any) -> Any:
    """An instance whose type answers `get_required_kvcache_layout` as the connector's class does."""
    probe = getattr(connector_class, "get_required_kvcache_layout", None)
    namespace = {"get_required_kvcache_layout": probe} if probe is not None else {}
    return type("ConnectorClassProbe", (), namespace)()
