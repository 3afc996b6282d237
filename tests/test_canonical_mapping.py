"""vLLM's canonical page mapping (`offloading/canonical_mapping.py`, 0.27.0 on; issue 36): a property check of
`derive_canonical_mappings` across TP sizes, by bytes (kvdoctor/engine/compat/canonical_mapping.py says how). The
check is kvdoctor's invariant `canonical-page-is-tp1-page`, judged by the vLLM worker (`worker = "vllm"`) over the
run's attention spec; here it holds on the real function at every TP size and layout, and fires on a mapping with
its head shards swapped, which vLLM's own tiling self-check (`_verify_tiling`) lets through."""

from __future__ import annotations

import pytest

from kvdoctor.engine.compat import canonical_mapping as cm
from kvdoctor.engine.setup import Setup

GEOMETRY = dict(block_size=4, blocks_per_chunk=2, gpu_blocks=8, max_model_len=16, cpu_bytes_to_use=4096,
                worker="vllm")


@pytest.fixture(scope="module")
def canonical():
    module = cm.canonical_module()
    if module is None:
        pytest.skip("this vLLM has no canonical page mapping (offloading/canonical_mapping.py: 0.27.0 onward)")
    return module


def _swap_head_shards(canonical, monkeypatch) -> None:
    original = canonical._attention_byte_regions

    def swapped(kv_cache, spec, num_blocks, head_shard, num_head_shards, cp_size):
        return original(kv_cache, spec, num_blocks, num_head_shards - 1 - head_shard, num_head_shards, cp_size)
    monkeypatch.setattr(canonical, "_attention_byte_regions", swapped)


def test_tp_sizes_are_those_the_heads_shard_over():
    assert cm.tp_sizes_for(4) == (2, 4, 8)
    assert cm.tp_sizes_for(1) == (2, 4, 8)
    assert cm.tp_sizes_for(6) == (2,)


@pytest.mark.parametrize("layout", cm.LAYOUTS)
@pytest.mark.parametrize("tp, total_heads", [(2, 4), (4, 4), (4, 2), (8, 2), (2, 1)])
def test_the_canonical_page_is_the_tp1_page_at_every_tp_size(canonical, layout, tp, total_heads):
    assert cm.page_problems(canonical, layout, tp, total_heads) == []


def test_a_mapping_with_its_head_shards_swapped_tiles_yet_moves_the_wrong_heads(canonical, monkeypatch):
    _swap_head_shards(canonical, monkeypatch)
    problems = cm.page_problems(canonical, "split-nhd", 2, 4)  # vLLM's own _verify_tiling raised nothing
    assert problems and "differs from the TP=1 page" in problems[0], problems


def _first_step_violations(api) -> list[str]:
    from kvdoctor.engine.harness import Harness
    from kvdoctor.observe.invariants import StepContext, check_all

    harness = Harness(api, Setup(**GEOMETRY).validate())
    try:
        events = harness.step()
        return [v.message for v in check_all(["canonical-page-is-tp1-page"], StepContext(harness, events, []))]
    finally:
        harness.shutdown()


def test_the_vllm_worker_judges_the_runs_spec_and_reports_a_swapped_mapping(canonical, api, monkeypatch):
    assert _first_step_violations(api) == []
    cm._MEMO.clear()
    with monkeypatch.context() as patch:
        _swap_head_shards(canonical, patch)
        found = _first_step_violations(api)
    cm._MEMO.clear()
    assert found and "differs from the TP=1 page" in found[0], found
