"""Tiering with a secondary tier (issue 27, item 6): vLLM's TieringOffloadingSpec (every release installed here,
0.26.0 to 0.34.0) with its `fs` tier in kvdoctor's throw-away directory. The tiering manager cascades CPU-tier
chunks to the fs tier and promotes them back (fs -> CPU) on a CPU-tier miss, all in the scheduler's process (the
fs tier's own I/O threads, polled by the manager each step), so the real manager runs unchanged. Every assertion
is on vLLM's objects. Cheap: two harness runs (with and without the fs tier) and one recipe replay per module."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvdoctor.engine.setup import Setup
from kvdoctor.errors import UsageError

from .cli_runner import invoke

DATA = Path(__file__).resolve().parent / "data"
TIERING = "TieringOffloadingSpec"
# 4-token blocks and chunks; a CPU tier of two chunks (the tiering spec pads a chunk to a 4 KiB page)
GEOMETRY = dict(block_size=4, gpu_blocks=16, max_model_len=64, spec_name=TIERING, cpu_bytes_to_use=8192)


# -- no vLLM needed ---------------------------------------------------------------------------------

def test_setup_refuses_a_tier_it_cannot_run_or_without_the_tiering_spec():
    with pytest.raises(UsageError, match="secondary_tier must be one of fs"):
        Setup(spec_name=TIERING, secondary_tier="p2p").validate()
    with pytest.raises(UsageError, match="needs spec_name"):
        Setup(secondary_tier="fs").validate()
    # Regression: under --worker vllm on a CPU, kvdoctor's copy engine holds the CPU tier in its own
    # tensors while the fs tier reads and writes vLLM's /dev/shm region: tests/data/fs-tier-promotion.toml
    # with worker = "vllm" reported B reading C's bytes (a false reads-see-their-tokens violation).
    assert "copy engine" in Setup(secondary_tier="fs", **GEOMETRY).vllm_worker_unsupported()
    with pytest.raises(UsageError, match="secondary_tier"):
        Setup(secondary_tier="fs", worker="vllm", **GEOMETRY).validate()


def test_the_fs_tier_is_a_throw_away_directory_in_the_connectors_own_extra_config():
    import tempfile

    cfg = Setup(secondary_tier="fs", **GEOMETRY).validate().kv_connector_extra_config()
    (tier,) = cfg["secondary_tiers"]
    assert tier["type"] == "fs" and cfg["spec_name"] == TIERING
    assert os.path.isdir(tier["root_dir"]) and tier["root_dir"].startswith(tempfile.gettempdir())
    assert "secondary_tiers" not in Setup(**GEOMETRY).kv_connector_extra_config()


# -- on the installed vLLM ----------------------------------------------------------------------------

def _drive(api, secondary_tier: str | None) -> dict:
    """A (8 tokens, 2 chunks) stored; C's 2 chunks evict A's from the two-chunk CPU tier; the GPU prefix
    cache is reset; B = A's prompt + 1 token. Per step of B: (status, num_computed_tokens, promotions)."""
    from kvdoctor.engine.harness import Harness

    harness = Harness(api, Setup(secondary_tier=secondary_tier, **GEOMETRY).validate())
    manager = api.tiering_manager_of(harness.connector_scheduler)
    root = harness.setup.kv_connector_extra_config().get("secondary_tiers", [{}])[0].get("root_dir")
    rows, files = [], 0
    try:
        for name, base in (("A", 100), ("C", 200)):
            harness.add(name, list(range(base, base + 8)), 1)
            for _ in range(6):
                harness.step()
        if root:
            files = sum(len(names) for _, _, names in os.walk(root))
        assert harness.reset_prefix_cache(False, False)
        harness.add("B", list(range(100, 109)), 1)
        for _ in range(8):
            harness.step()
            request = harness.requests["B"]
            rows.append((request.status.name, request.num_computed_tokens, api.promotion_jobs(manager)))
            if request.status.name.startswith("FINISHED"):
                break
    finally:
        harness.shutdown()
    return {"rows": rows, "files": files, "tiers": [type(t).__name__ for t in manager.secondary_tiers]}


@pytest.fixture(scope="module")
def driven(api):
    if not api.has_offloading_spec(TIERING) or not api.has_secondary_tier("fs"):
        pytest.skip("this vLLM's tiering spec has no fs secondary tier (vllm/v1/kv_offload/tiering/factory.py)")
    return _drive(api, "fs"), _drive(api, None)


def test_a_chunk_evicted_from_the_cpu_tier_is_promoted_from_the_fs_tier_and_loaded(driven):
    with_fs, cpu_only = driven
    assert with_fs["tiers"] == ["FileSystemTierManager"] and cpu_only["tiers"] == []
    assert with_fs["files"] >= 4, with_fs  # A's and C's chunks were cascaded to the fs tier
    rows = with_fs["rows"]
    assert any(promotions > 0 for *_, promotions in rows), rows  # a promotion job (fs -> CPU) ran
    # B waited for its load from the CPU tier with A's two chunks (8 tokens) counted as computed
    assert any(status == "WAITING_FOR_REMOTE_KVS" and computed == 8 for status, computed, _ in rows), rows
    # the promotion came first: B waited (no load yet) while its chunks were read back from the fs tier
    first_load = next(i for i, (status, *_) in enumerate(rows) if status == "WAITING_FOR_REMOTE_KVS")
    assert any(promotions > 0 for *_, promotions in rows[:first_load]), rows
    assert rows[-1][0] == "FINISHED_LENGTH_CAPPED", rows


def test_without_the_fs_tier_the_evicted_chunks_are_gone(driven):
    """The control: the same steps on the CPU tier only load nothing for B (its chunks were evicted), so
    the load above came from the fs tier."""
    _, cpu_only = driven
    rows = cpu_only["rows"]
    assert all(status != "WAITING_FOR_REMOTE_KVS" and promotions == 0 for status, _, promotions in rows), rows
    assert rows[-1][0] == "FINISHED_LENGTH_CAPPED", rows


def test_the_recipe_replays_with_kvdoctor_repro(api):
    result = invoke("repro", str(DATA / "fs-tier-promotion.toml"))
    if not api.has_secondary_tier("fs"):
        assert result.returncode == 0 and "secondary tier 'fs'" in result.stdout, result.stdout + result.stderr
        return
    assert result.returncode == 0, result.stdout + result.stderr
    assert "checks held: B ran to its max_tokens after its chunks were promoted" in result.stdout, result.stdout


# -- explore's tier byte -------------------------------------------------------------------------------

def test_the_tier_byte_is_drawn_only_where_gated_and_zero_is_no_tier():
    from hypothesis import find

    from kvdoctor.explore.generate import GEOMETRY_RANGES, TIER_DRAW, Example, Geometry, decode_tier, examples

    plain = Geometry(4, 1, 24, 16, 256, False)
    assert decode_tier(plain, 0) == plain and decode_tier(plain, 2) == plain  # bit 0 clear: no tier
    drawn = decode_tier(plain, 1)
    assert (drawn.secondary_tier, drawn.spec_name, drawn.cpu_bytes_to_use) == ("fs", TIERING, 4096)
    assert drawn.setup_dict()["secondary_tier"] == "fs"
    Setup(**{k: v for k, v in drawn.setup_dict().items() if k != "extra_connector_config"}).validate()
    assert decode_tier(Geometry(4, 1, 24, 16, 256, False, multi_connector=True), 1).secondary_tier is None
    assert decode_tier(plain, 1, worker="vllm") == plain
    assert len(find(examples(4, tier=True), lambda raw: True)[0]) == len(GEOMETRY_RANGES) + 1
    assert len(find(examples(4), lambda raw: True)[0]) == len(GEOMETRY_RANGES)  # ungated: draws stay as they were
    tiered = Example.decode((bytes([0] * len(GEOMETRY_RANGES)) + b"\x03", [b"\x00" * 4]),
                            features=frozenset({TIER_DRAW}))
    assert (tiered.geometry.secondary_tier, tiered.geometry.cpu_bytes_to_use) == ("fs", 8192)


def test_a_tiered_draw_replays_from_its_file(api, tmp_path):
    """A generated draw with the fs tier (A stored, B and C fill the CPU tier, D with A's prompt) is
    written as explore writes it and replayed with `kvdoctor repro FILE`: it runs through."""
    if not api.has_offloading_spec(TIERING) or not api.has_secondary_tier("fs"):
        pytest.skip("this vLLM's tiering spec has no fs secondary tier")
    from kvdoctor.explore.generate import Example, Geometry, decode_tier, to_recipe
    from kvdoctor.recipes.writer import recipe_to_toml

    geometry = decode_tier(Geometry(4, 1, 24, 16, 256, False), 1)  # fs tier, a one-chunk CPU tier
    events = (("add", ("tokens", 8), 1, None), ("schedule", 4), ("add", ("tokens", 8), 1, None), ("schedule", 4),
              ("add", ("tokens", 9), 1, (0, None)), ("schedule", 6))
    path = tmp_path / "draw.toml"
    path.write_text(recipe_to_toml(to_recipe(Example(geometry, events))))
    assert 'secondary_tier = "fs"' in path.read_text()
    result = invoke("repro", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "installed" in result.stdout and "not_reproduced" in result.stdout, result.stdout


def test_a_tiered_draw_never_has_a_cpu_tier_below_one_chunk(api):
    """Regression: explore (0.34.0, seed 1) drew the fs tier with a 4 KiB CPU tier under 6 KiB chunks
    (swa-full, 16-token blocks, 3 blocks a chunk); vLLM's tiering spec then fails at start-up with
    "range() arg 3 must not be zero" (a zero-chunk tier), with or without the secondary tier. The tier
    byte now sizes the CPU tier in chunks: this geometry builds."""
    if not api.has_offloading_spec(TIERING) or not api.has_secondary_tier("fs"):
        pytest.skip("this vLLM's tiering spec has no fs secondary tier")
    from kvdoctor.engine.harness import Harness
    from kvdoctor.explore.generate import Geometry, decode_tier

    geometry = decode_tier(Geometry(16, 3, 4, 16, 256, False, layout="swa-full", sliding_window=64), 1)
    assert geometry.cpu_bytes_to_use > 4096
    Harness(api, Setup(**geometry.setup_dict()).validate()).shutdown()


def test_the_base_draw_never_gives_the_tiering_spec_a_cpu_tier_below_one_chunk(api):
    """Regression: `explore --seed 1` (0.34.0, 600 s and 420 s with --coverage) reported "ValueError in
    __init__" (vllm/v1/kv_offload/cpu/shared_offload_region.py:144, "range() arg 3 must not be zero"): the
    base geometry drew TieringOffloadingSpec with its 4 KiB CPU tier under eagle-pair's 6 KiB chunks (8-token
    blocks, 3 a chunk), a zero-chunk tier vLLM refuses at start-up (EngineCore too), never a finding.
    The base draw now sizes such a tier to one chunk: the drawn example builds and runs."""
    if not api.has_offloading_spec(TIERING):
        pytest.skip("this vLLM has no TieringOffloadingSpec")
    from kvdoctor.explore.generate import (
        BLOCK_SIZES,
        CPU_TIERS,
        LAYOUTS,
        SPECS,
        Example,
        decode_geometry,
        tier_chunk_bytes,
        to_recipe,
    )
    from kvdoctor.explore.runner import observe

    fields = (BLOCK_SIZES.index(8), 2, 0, 0, 0, 0, CPU_TIERS.index(4096), 0, SPECS.index(TIERING),
              LAYOUTS.index("eagle-pair"), 0)
    geometry = decode_geometry(fields)
    assert (geometry.layout, geometry.block_size, geometry.blocks_per_chunk) == ("eagle-pair", 8, 3)
    assert 4096 < tier_chunk_bytes(geometry) == geometry.cpu_bytes_to_use
    obs = observe(api, to_recipe(Example(geometry, (("schedule", 2),))), "installed")
    assert obs.signature is None, obs.detail
