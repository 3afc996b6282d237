"""Geometry validation and `vllm serve`-style flag parsing (no vLLM import)."""

from __future__ import annotations

import pytest

from kvdoctor.app import resolve_setup
from kvdoctor.engine.setup import Setup, parse_kv_transfer_config, resolve_blocks_per_chunk
from kvdoctor.errors import UsageError
from kvdoctor.recipes.builtins import load_builtin


def test_offloaded_block_size_maps_to_blocks_per_chunk():
    recipe = load_builtin("queued-abort")
    overrides = parse_kv_transfer_config('{"kv_connector":"OffloadingConnector","kv_role":"kv_both",'
                                         '"kv_connector_extra_config":{"block_size":16,"cpu_bytes_to_use":1000000,'
                                         '"offload_prompt_only":false}}')
    setup = resolve_setup(recipe, {"block_size": 8, **overrides})
    assert (setup.block_size, setup.blocks_per_chunk, setup.offloaded_block_size) == (8, 2, 16)
    assert setup.cpu_bytes_to_use == 1_000_000 and setup.offload_prompt_only is False
    assert setup.kv_connector_extra_config()["block_size"] == 16


@pytest.mark.parametrize("block, offloaded", [(4, 6), (8, 4), (4, 0)])
def test_chunk_must_be_whole_blocks(block, offloaded):
    with pytest.raises(UsageError, match="whole number"):
        resolve_blocks_per_chunk(block, offloaded)


@pytest.mark.parametrize("overrides", [{"gpu_blocks": 0}, {"block_size": -4}, {"blocks_per_chunk": 0},
                                       {"max_num_seqs": 64, "max_num_batched_tokens": 8}])
def test_impossible_geometry(overrides):
    with pytest.raises(UsageError):
        Setup().with_overrides(**overrides)


def test_unknown_kv_transfer_keys_are_named():
    with pytest.raises(UsageError, match="kv_bogus"):
        parse_kv_transfer_config('{"kv_bogus": 1}')


def test_extra_connector_keys_pass_through():
    overrides = parse_kv_transfer_config('{"kv_connector_extra_config": {"eviction_policy": "arc"}}')
    setup = resolve_setup(load_builtin("queued-abort"), overrides)
    assert setup.kv_connector_extra_config()["eviction_policy"] == "arc"
