"""What vLLM's worker holds under kvdoctor: fingerprints of KV, sized by what the content checks need.

A GPU holds each layer's keys and values, a page of `2 x heads x head_size x dtype` bytes a token. The
content checks only need to tell which tokens a slot holds (`toy_model.py`: word 0 the prefix's key, word
1 the layer), so vLLM's worker-role connector here runs over a KV cache config of the same groups, block
sizes and block count as the scheduler's, one layer a group, `FINGERPRINT_SLOT_BYTES` a token slot. The
scheduler keeps the model's real config: its page sizes, groups and the CPU blocks vLLM computes from them.
The CPU tier keeps the scheduler's slot count, each slot fingerprint-sized. Memory is then bounded by the
block counts, never by the model's size (Llama-3.1-8B's 2 MiB pages at 20,000 blocks were 39 GiB).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvdoctor.engine.kv_layout import MAMBA, MLA
from kvdoctor.engine.memory import available_memory_bytes, total_memory_bytes
from kvdoctor.errors import UsageError

FINGERPRINT_SLOT_BYTES = 16  # word 0: the prefix's 64-bit key, word 1: the layer's tag (toy_model)
LAYERS_PER_GROUP = 1  # every layer of a group holds the same block ids: one shows what the others would


@dataclass(frozen=True)
class FingerprintPlan:
    config: Any  # the worker's KVCacheConfig (None for a pre-import estimate)
    page_bytes: int  # one fingerprint page (every kept layer, every group: vLLM unifies page sizes)
    num_blocks: int
    columns: int  # fingerprint tensors (layer j of every group aliases the same bytes)
    cpu_slots: int  # the scheduler's CPU-tier slot count (one chunk each)
    blocks_per_chunk: int
    cpu_tensors: int  # CPU-tier tensors the copy engine allocates (one per canonical GPU tensor, at most)
    real_layers: int
    kept_layers: int
    real_page_bytes: int  # the real KV of one block over the layers (what a CPU chunk holds a block)
    tier_bytes: int  # the CPU tier the user asked for (cpu_bytes_to_use)
    layer_page_bytes: int  # the real page of one block of one layer (the largest)

    @property
    def gpu_bytes(self) -> int:
        return self.page_bytes * self.num_blocks * self.columns

    @property
    def cpu_bytes(self) -> int:
        return self.cpu_slots * self.blocks_per_chunk * self.page_bytes * self.cpu_tensors

    def refusal(self) -> str | None:
        """Why this machine cannot hold the fingerprints (None: it can). The GPU-side tensors are written
        whole (poison first); the CPU tier is mapped lazily, costing only the slots stored into, but a mapping
        larger than the machine's memory and swap is refused by the kernel."""
        available = available_memory_bytes()
        if available is not None and self.gpu_bytes > available:
            return (f"its fingerprint KV pages need {self.gpu_bytes / 2**30:,.1f} GiB ({self.num_blocks:,} blocks x "
                    f"{self.page_bytes:,} bytes x {self.columns}; --num-gpu-blocks-override, --block-size) and "
                    f"{available / 2**30:.1f} GiB are available")
        total = total_memory_bytes()
        if total is not None and self.cpu_bytes > total:
            return (f"a CPU tier of {self.tier_bytes / 2**30:,.1f} GiB (--kv-offloading-size / "
                    f"kv_connector_extra_config.cpu_bytes_to_use) is {self.cpu_slots:,} slots of "
                    f"{self.real_page_bytes * self.blocks_per_chunk:,}-byte chunks, {self.cpu_bytes / 2**30:,.1f} GiB "
                    f"even as fingerprints, and this machine has {total / 2**30:.1f} GiB of memory and swap")
        return None

    def refuse_beyond_memory(self) -> None:
        refusal = self.refusal()
        if refusal:
            raise UsageError(f"--worker vllm: {refusal}")

    def describe(self) -> str:
        return (f"KV bytes are fingerprints ({self.page_bytes:,}-byte pages, "
                f"{FINGERPRINT_SLOT_BYTES}+ bytes a token slot, {self.kept_layers} of the model's "
                f"{self.real_layers} layers: one a KV cache group) where a GPU holds {self.layer_page_bytes:,} bytes "
                f"a block a layer; the scheduler plans with the real pages ({self.cpu_slots:,} CPU slots)")


def fingerprint_plan(api: Any, vllm_config: Any, kv_cache_config: Any) -> FingerprintPlan:
    """The worker's fingerprint config for the scheduler's `kv_cache_config`, and what it will cost."""
    config = api.fingerprint_kv_cache_config(kv_cache_config, FINGERPRINT_SLOT_BYTES, LAYERS_PER_GROUP)
    specs = api.kv_layer_specs(config)
    page = max(int(spec.page_size_bytes) for _, spec in specs.values())
    columns = max(len(group.layer_names) for group in config.kv_cache_groups)
    real = api.kv_layer_specs(kv_cache_config)
    real_pages = [int(spec.page_size_bytes) for _, spec in real.values()]
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config
    block_size = int(kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size)
    blocks_per_chunk = max(1, int(extra.get("block_size") or block_size) // block_size)
    return FingerprintPlan(config, page, int(kv_cache_config.num_blocks), columns,
                           api.offloading_cpu_blocks(vllm_config, kv_cache_config), blocks_per_chunk,
                           len(specs), len(real), len(specs), sum(real_pages) // len(kv_cache_config.kv_cache_groups),
                           int(extra.get("cpu_bytes_to_use") or 0), max(real_pages))


def estimate(layout: Any, block_size: int, blocks_per_chunk: int, gpu_blocks: int,
             cpu_bytes_to_use: int) -> FingerprintPlan:
    """The same costs from the model's layout before vLLM is imported (one group per kind of layer; a
    group's page is unified with the widest layer's, as vLLM's planner does)."""
    attention = [layer for layer in layout.layers if layer.kind != MAMBA]
    per_token = [(1 if layer.kind == MLA else 2) * (layer.num_kv_heads or layout.num_kv_heads)
                 * (layer.head_size or layout.head_size) for layer in attention] or [1]
    widest_block = block_size * max(1, -(-max(per_token) // min(per_token)))
    kinds = {(layer.kind, layer.sliding_window, layer.draft, layer.num_kv_heads, layer.head_size)
             for layer in layout.layers}
    real_page = layout.page_bytes(block_size)
    # a hybrid's groups alias their pages, so vLLM counts fewer bytes a block (more slots): checked exactly again
    # once vLLM has planned the groups (fingerprint_plan)
    cpu_slots = cpu_bytes_to_use // max(1, real_page * blocks_per_chunk)
    layer_page = real_page // len(layout.layers)
    return FingerprintPlan(None, FINGERPRINT_SLOT_BYTES * widest_block, gpu_blocks, 1, cpu_slots, blocks_per_chunk,
                           len(kinds), len(layout.layers), len(kinds), real_page, cpu_bytes_to_use, layer_page)

