"""vLLM's canonical page mapping (0.34's `offloading/canonical_mapping.py`, issue 36): a property check of
`derive_canonical_mappings` across TP sizes. vLLM promises that the canonical page of a layer is "the full offloaded
block without parallelism: all KV heads ... in the worker's page encoding", so a chunk stored under one TP size
can be loaded under another. Checked here by bytes, not by vLLM's own tiling self-check (`_verify_tiling`, which
only asserts that the writers' runs tile the page): every rank's page is filled from one reference KV block (its
own head shard, replicated heads where TP exceeds the KV heads), each block's elected writers copy their runs into
a canonical page, and that page must equal the TP=1 worker's page, byte for byte. A mutation that swaps the head
shards still tiles (vLLM's check passes) and is caught here.

kvdoctor stands in for the worker's KV tensors and the two config fields the function reads (its parallel config
and the model's total KV heads); vLLM's function runs unchanged."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping"
NUM_BLOCKS, BLOCK_SIZE, HEAD_SIZE = 3, 4, 8
# (layout, physical order of a block's elements): the two layouts vLLM's mapping recognizes, NHD and HND each
LAYOUTS = ("split-nhd", "split-hnd", "packed-nhd", "packed-hnd")


@pytest.fixture(scope="module")
def canonical():
    try:
        import importlib

        module = importlib.import_module(MODULE)
    except ImportError:
        pytest.skip("this vLLM has no canonical page mapping (offloading/canonical_mapping.py: 0.34.0 here)")
    return module


def _cache(layout: str, heads: int, values: Any) -> Any:
    """A worker's KV cache tensor in the logical shape vLLM's mapping reads, allocated in `layout`'s physical order
    (as a backend allocates it: a dense buffer, then a permuted view); `values` is the (num_blocks, 2, block_size,
    heads, head_size) reference content of those heads. Allocated afresh, never by `.contiguous()` of a permuted
    view: that keeps a size-1 dimension's stride, and with one head per rank the HND page would read as NHD
    (measured: the canonical page then differs from the TP=1 HND page; a real backend's buffer has no such stride)."""
    import torch

    if layout.startswith("split"):
        if layout.endswith("nhd"):
            return values.clone()
        physical = torch.empty(NUM_BLOCKS, 2, heads, BLOCK_SIZE, HEAD_SIZE, dtype=values.dtype)
        physical.copy_(values.permute(0, 1, 3, 2, 4))
        return physical.permute(0, 1, 3, 2, 4)
    packed = values.permute(0, 2, 3, 1, 4).reshape(NUM_BLOCKS, BLOCK_SIZE, heads, 2 * HEAD_SIZE)  # [k | v] per head
    if layout.endswith("nhd"):
        physical = torch.empty(NUM_BLOCKS, BLOCK_SIZE, heads, 2 * HEAD_SIZE, dtype=values.dtype)
        physical.copy_(packed)
        return physical.permute(0, 2, 1, 3)
    physical = torch.empty(NUM_BLOCKS, heads, BLOCK_SIZE, 2 * HEAD_SIZE, dtype=values.dtype)
    physical.copy_(packed.permute(0, 2, 1, 3))
    return physical


def _page(cache: Any, block: int) -> Any:
    """The block's page: its bytes in memory order (every cache here is dense, blocks outermost)."""
    import torch

    flat = cache.as_strided((cache.numel(),), (1,))
    per_block = cache.numel() // NUM_BLOCKS
    return flat[block * per_block:(block + 1) * per_block].contiguous().view(torch.uint8)


def _mappings(canonical: Any, layout: str, tp: int, total_heads: int, reference: Any) -> list[tuple[Any, Any]]:
    """(rank's mapping, rank's cache) for every rank of a TP group, by vLLM's derive_canonical_mappings."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    per_rank = max(1, total_heads // tp)
    replication = max(1, tp // total_heads)
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=per_rank, head_size=HEAD_SIZE, dtype=torch.float16)
    config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
    out = []
    for rank in range(tp):
        shard = rank // replication
        cache = _cache(layout, per_rank, reference[:, :, :, shard * per_rank:(shard + 1) * per_rank])
        parallel = SimpleNamespace(tensor_parallel_size=tp, prefill_context_parallel_size=1, world_size=tp,
                                   decode_context_parallel_size=1, cp_kv_cache_interleave_size=1, rank=rank)
        vllm_config = SimpleNamespace(parallel_config=parallel,
                                      model_config=SimpleNamespace(get_total_num_kv_heads=lambda: total_heads))
        mapping = canonical.derive_canonical_mappings(vllm_config, config, {"layer.0": cache})
        out.append((mapping["layer.0"], cache))
    return out


def _assemble(ranks: list[tuple[Any, Any]], block: int, writer: int) -> Any:
    """The canonical page of block `block` as stored by the ranks elected by block id `writer`."""
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
    assert bool((written == 1).all()), "the writers do not write every canonical byte exactly once"
    return canonical


def _reference(total_heads: int) -> Any:
    """One KV block's content for every head: distinct values within a block (fp16 holds integers < 2048)."""
    import torch

    n = NUM_BLOCKS * 2 * BLOCK_SIZE * total_heads * HEAD_SIZE
    values = (torch.arange(n, dtype=torch.int32) % 2039).to(torch.float16)
    return values.reshape(NUM_BLOCKS, 2, BLOCK_SIZE, total_heads, HEAD_SIZE)


def _check(canonical: Any, layout: str, tp: int, total_heads: int) -> list[str]:
    import torch

    reference = _reference(total_heads)
    ((_, single_cache),) = _mappings(canonical, layout, 1, total_heads, reference)
    ranks = _mappings(canonical, layout, tp, total_heads, reference)
    problems = []
    for block in range(NUM_BLOCKS):
        expected = _page(single_cache, block)
        for writer_block in range(ranks[0][0].num_writers):
            got = _assemble(ranks, block, writer_block)
            if got.numel() != expected.numel() or not torch.equal(got, expected):
                problems.append(f"{layout} TP={tp} heads={total_heads}: the canonical page of block {block} "
                                f"(writers of {writer_block}) differs from the TP=1 page")
                break
    return problems


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("tp, total_heads", [(2, 4), (4, 4), (4, 2), (8, 2), (2, 1)])
def test_the_canonical_page_is_the_tp1_page_at_every_tp_size(canonical, layout, tp, total_heads):
    ranks = _mappings(canonical, layout, tp, total_heads, _reference(total_heads))
    assert all(m.parallelism_agnostic for m, _ in ranks)  # a certified mapping, not the opaque fallback
    assert _check(canonical, layout, tp, total_heads) == []


def test_a_mapping_with_its_head_shards_swapped_tiles_yet_moves_the_wrong_heads(canonical, monkeypatch):
    original = canonical._attention_byte_regions

    def swapped(kv_cache, spec, num_blocks, head_shard, num_head_shards, cp_size):
        return original(kv_cache, spec, num_blocks, num_head_shards - 1 - head_shard, num_head_shards, cp_size)
    monkeypatch.setattr(canonical, "_attention_byte_regions", swapped)
    problems = _check(canonical, "split-nhd", 2, 4)  # vLLM's own _verify_tiling raised nothing
    assert problems and "differs from the TP=1 page" in problems[0], problems
