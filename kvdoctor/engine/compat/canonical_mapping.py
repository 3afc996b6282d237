"""vLLM's canonical page mapping (`offloading/canonical_mapping.py`, 0.27.0 on), checked across TP sizes by bytes.

vLLM promises that the canonical page of a layer is "the full offloaded block without parallelism: all KV heads
... in the worker's page encoding", so a chunk stored under one TP size can be loaded under another. The vLLM
worker's `register_kv_caches` derives this worker's mapping (`derive_canonical_mappings`) at the run's own TP
size; kvdoctor runs one worker, so vLLM's function is also asked here for every rank of TP 2, 4 and 8 over the
run's attention spec (its KV heads, head size and dtype; the model's total KV heads), and the ranks' pages are
assembled: every rank's page is filled from one reference KV block (its own head shard, replicated heads where TP
exceeds the KV heads), each block's elected writers copy their runs into a canonical page, and that page must
equal the TP=1 worker's page, byte for byte, in each of the four layouts vLLM's mapping recognizes. vLLM's own
tiling self-check (`_verify_tiling`) only asserts that the writers' runs tile the page: a mapping that swaps the
head shards passes it, and is caught here (tests/test_canonical_mapping.py).

kvdoctor stands in for the ranks' KV tensors (small: 3 blocks) and the two config fields the function reads (the
parallel config and the model's total KV heads); vLLM's function runs unchanged. Deterministic, so a process
computes each (spec, TP) once (`_MEMO`). Where vLLM's function raises on kvdoctor's stand-ins (a config field a
later release reads that the stand-ins lack) that case is not judged: kvdoctor's own failure is never a finding.
Measured: every case holds on 0.27.0 to 0.34.0 (1, 2 and 4 KV heads).
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace
from typing import Any

MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping"
NUM_BLOCKS = 3
TP_SIZES = (2, 4, 8)
# (layout, physical order of a block's elements): the two layouts vLLM's mapping recognizes, NHD and HND each; and
# "mla": the MLA form of the spec (one latent of the head size a token, the same on every rank: TP replicates it)
LAYOUTS = ("split-nhd", "split-hnd", "packed-nhd", "packed-hnd", "mla")
_MEMO: dict[tuple[Any, ...], list[str]] = {}


def canonical_module() -> Any | None:
    """vLLM's canonical mapping module, None where this vLLM has none (0.26.0 here)."""
    try:
        return importlib.import_module(MODULE)
    except ImportError:
        return None


def tp_sizes_for(total_heads: int) -> tuple[int, ...]:
    """The TP sizes vLLM shards `total_heads` KV heads over: those dividing them, or that they divide."""
    return tuple(tp for tp in TP_SIZES if total_heads % tp == 0 or tp % total_heads == 0)


def _cache(layout: str, heads: int, block_size: int, head_size: int, values: Any) -> Any:
    """A worker's KV cache tensor in the logical shape vLLM's mapping reads, allocated in `layout`'s physical order
    (as a backend allocates it: a dense buffer, then a permuted view); `values` is the (num_blocks, 2, block_size,
    heads, head_size) reference content of those heads. Allocated afresh, never by `.contiguous()` of a permuted
    view: that keeps a size-1 dimension's stride, and with one head per rank the HND page would read as NHD
    (measured: the canonical page then differs from the TP=1 HND page; a real backend's buffer has no such stride)."""
    import torch

    if layout.startswith("split"):
        if layout.endswith("nhd"):
            return values.clone()
        physical = torch.empty(NUM_BLOCKS, 2, heads, block_size, head_size, dtype=values.dtype)
        physical.copy_(values.permute(0, 1, 3, 2, 4))
        return physical.permute(0, 1, 3, 2, 4)
    packed = values.permute(0, 2, 3, 1, 4).reshape(NUM_BLOCKS, block_size, heads, 2 * head_size)  # [k | v] per head
    if layout.endswith("nhd"):
        physical = torch.empty(NUM_BLOCKS, block_size, heads, 2 * head_size, dtype=values.dtype)
        physical.copy_(packed)
        return physical.permute(0, 2, 1, 3)
    physical = torch.empty(NUM_BLOCKS, heads, block_size, 2 * head_size, dtype=values.dtype)
    physical.copy_(packed.permute(0, 2, 1, 3))
    return physical


def _page(cache: Any, block: int) -> Any:
    """The block's page: its bytes in memory order (every cache here is dense, blocks outermost)."""
    import torch

    flat = cache.as_strided((cache.numel(),), (1,))
    per_block = cache.numel() // NUM_BLOCKS
    return flat[block * per_block:(block + 1) * per_block].contiguous().view(torch.uint8)


def rank_mappings(module: Any, layout: str, tp: int, total_heads: int, block_size: int, head_size: int,
                  reference: Any) -> list[tuple[Any, Any]]:
    """(rank's mapping, rank's cache) for every rank of a TP group, by vLLM's derive_canonical_mappings."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec

    mla = layout == "mla"
    per_rank = 1 if mla else max(1, total_heads // tp)
    replication = tp if mla else max(1, tp // total_heads)
    spec = (MLAAttentionSpec if mla else FullAttentionSpec)(block_size=block_size, num_kv_heads=per_rank,
                                                            head_size=head_size, dtype=reference.dtype)
    config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
    out = []
    for rank in range(tp):
        shard = rank // replication
        cache = reference.clone() if mla else _cache(layout, per_rank, block_size, head_size,
                                                     reference[:, :, :, shard * per_rank:(shard + 1) * per_rank])
        parallel = SimpleNamespace(tensor_parallel_size=tp, prefill_context_parallel_size=1, world_size=tp,
                                   decode_context_parallel_size=1, cp_kv_cache_interleave_size=1, rank=rank)
        vllm_config = SimpleNamespace(parallel_config=parallel,
                                      model_config=SimpleNamespace(get_total_num_kv_heads=lambda: total_heads))
        mapping = module.derive_canonical_mappings(vllm_config, config, {"layer.0": cache})
        out.append((mapping["layer.0"], cache))
    return out


def _assemble(ranks: list[tuple[Any, Any]], block: int, writer: int) -> Any | None:
    """The canonical page of block `block` as stored by the ranks elected by block id `writer` (None where the
    writers do not write every canonical byte exactly once)."""
    import torch

    size = ranks[0][0].canonical_page_size_bytes
    canonical = torch.zeros(size, dtype=torch.uint8)
    written = torch.zeros(size, dtype=torch.int32)
    for mapping, cache in ranks:
        if not mapping.is_writer(writer):
            continue
        local = _page(cache, block)
        for run in mapping.runs:
            for i in range(run.num_fragments):
                lo, co = run.local_offset + i * run.local_stride, run.canonical_offset + i * run.canonical_stride
                canonical[co:co + run.fragment_size] = local[lo:lo + run.fragment_size]
                written[co:co + run.fragment_size] += 1
    return canonical if bool((written == 1).all()) else None


def reference_block(total_heads: int, block_size: int, head_size: int, dtype: Any) -> Any:
    """One KV block's content for every head: distinct values within a block (fp16 holds integers < 2048)."""
    import torch

    n = NUM_BLOCKS * 2 * block_size * total_heads * head_size
    values = (torch.arange(n, dtype=torch.int32) % 2039).to(dtype)
    return values.reshape(NUM_BLOCKS, 2, block_size, total_heads, head_size)


def page_problems(module: Any, layout: str, tp: int, total_heads: int, block_size: int = 4, head_size: int = 8,
                  dtype: Any = None) -> list[str]:
    """Where TP `tp`'s canonical page differs from the TP=1 page (empty when vLLM keeps its promise)."""
    import torch

    reference = reference_block(total_heads, block_size, head_size, dtype or torch.float16)
    if layout == "mla":  # one latent a token: (num_blocks, block_size, head_size)
        reference = reference[:, 0, :, 0, :].contiguous()
    ((_, single_cache),) = rank_mappings(module, layout, 1, total_heads, block_size, head_size, reference)
    ranks = rank_mappings(module, layout, tp, total_heads, block_size, head_size, reference)
    where = f"{layout} TP={tp} ({total_heads} KV heads)"
    if not all(m.parallelism_agnostic for m, _ in ranks):
        return [f"{where}: vLLM falls back to an opaque (parallelism-specific) mapping for a plain attention layer"]
    for block in range(NUM_BLOCKS):
        expected = _page(single_cache, block)
        for writer_block in range(ranks[0][0].num_writers):
            got = _assemble(ranks, block, writer_block)
            if got is None:
                return [f"{where}: the writers of block id {writer_block} do not write every canonical byte once"]
            if got.numel() != expected.numel() or not torch.equal(got, expected):
                return [f"{where}: the canonical page of block {block} (writers of {writer_block}) differs from "
                        f"the TP=1 page"]
    return []


def check_run(vllm_config: Any, kv_cache_config: Any) -> list[str]:
    """Every layout at every TP size the run's KV heads shard over, for the run's attention spec (its first KV
    cache group's head size and element size, the model's total KV heads); [] where vLLM has no canonical mapping
    or the run's spec is not a plain attention spec."""
    import torch

    module = canonical_module()
    if module is None or not kv_cache_config.kv_cache_groups:
        return []
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    head_size = getattr(spec, "head_size", None)
    total_heads = vllm_config.model_config.get_total_num_kv_heads()
    if not isinstance(head_size, int) or not isinstance(total_heads, int) or total_heads < 1:
        return []
    # Same element size as the run's KV, in a dtype that holds the reference's integers exactly
    itemsize = torch.empty((), dtype=getattr(spec, "dtype", torch.float16)).element_size()
    dtype = {4: torch.float32, 8: torch.float64}.get(itemsize, torch.float16)
    key = (id(module.derive_canonical_mappings), total_heads, head_size, str(dtype))
    if key not in _MEMO:
        problems: list[str] = []
        for tp in tp_sizes_for(total_heads):
            for layout in LAYOUTS:
                try:
                    problems += page_problems(module, layout, tp, total_heads, head_size=head_size, dtype=dtype)
                except Exception:  # the stand-ins, not vLLM's promise: this case is not judged
                    continue
        _MEMO[key] = problems
    return list(_MEMO[key])
