"""KV layouts: config.json parsing (no vLLM), and the groups vLLM's real planner builds from them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvdoctor.engine import kv_layout
from kvdoctor.engine.overrides import Overrides
from kvdoctor.engine.setup import Setup
from kvdoctor.errors import UsageError
from tests.cli_runner import invoke
from tests.conftest import run_cli


def write_config(tmp_path: Path, config: dict) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_shipped_layouts_are_packaged() -> None:
    assert {"swa-full", "mamba-hybrid", "eagle-pair"} <= set(kv_layout.shipped_layouts())


def test_layer_types_with_sliding_window(tmp_path: Path) -> None:
    layout = kv_layout.read_layout(write_config(tmp_path, {
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"], "sliding_window": 64,
        "num_key_value_heads": 2, "head_dim": 16}))
    assert [(layer.kind, layer.sliding_window) for layer in layout.layers] == [
        ("sliding_attention", 64), ("full_attention", None), ("sliding_attention", 64)]
    assert (layout.num_kv_heads, layout.head_size) == (2, 16)
    assert layout.is_hybrid


def test_window_override_and_pattern(tmp_path: Path) -> None:
    layout = kv_layout.read_layout(write_config(tmp_path, {"hybrid_override_pattern": "M-*-M"}))
    assert [layer.kind for layer in layout.layers] == ["mamba", "full_attention", "mamba"]
    assert layout.layer_names() == ["model.layers.0.mixer", "model.layers.1.self_attn.attn", "model.layers.2.mixer"]
    swa = kv_layout.resolve_layout(None, "swa-full", sliding_window=8)
    assert {layer.sliding_window for layer in swa.layers} == {8, None}


def test_eagle_drafter_layers() -> None:
    layout = kv_layout.resolve_layout(None, "eagle-pair")
    assert [layer.draft for layer in layout.layers] == [False, True]
    assert layout.layer_names()[1].startswith("drafter.")


@pytest.mark.parametrize("config,message", [
    ({"layer_types": ["sliding_attention"]}, "need a positive sliding_window"),
    ({"layer_types": ["cross_attention"]}, "unknown kind 'cross_attention'"),
    ({"num_hidden_layers": 0}, "num_hidden_layers must be a positive integer"),
])
def test_bad_configs_are_usage_errors(tmp_path: Path, config: dict, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        kv_layout.read_layout(write_config(tmp_path, config))


def test_a_model_replaces_a_recipes_own_layout(tmp_path: Path) -> None:
    """--model over a recipe's [setup] layout: the model's layout is played (whether its groups hold the
    trigger's kinds is measured at run time: test_model_configs)."""
    model = write_config(tmp_path, {"num_hidden_layers": 3})
    assert kv_layout.resolve_layout(str(model), "swa-full") == kv_layout.read_layout(model)
    with pytest.raises(UsageError, match="unknown layout 'nope'"):
        kv_layout.resolve_layout(None, "nope")


# -- vLLM's real planner ---------------------------------------------------------------------------

@pytest.mark.vllm
@pytest.mark.parametrize("setup,kinds", [
    (Setup(), ["full_attention"]),
    (Setup(layout="swa-full"), ["sliding_window", "full_attention"]),
    (Setup(layout="mamba-hybrid", mamba_cache_mode="align"), ["mamba", "full_attention"]),
    (Setup(layout="eagle-pair"), ["full_attention"]),
])
def test_planner_groups_as_a_gpu_deployment(api, setup: Setup, kinds: list[str]) -> None:
    """The hybrid manager stays on (as on a GPU) and the connector sees every group."""
    from kvdoctor.engine.harness import Harness

    harness = Harness(api, setup)
    try:
        plan = harness.kv_plan
        assert [g.kind for g in plan.groups] == kinds
        assert all(g.block_size == setup.block_size for g in plan.groups)
        configs = api.group_configs(harness.connector_scheduler)
        assert len(configs) == len(kinds)
        windows = [c.sliding_window_size_in_chunks for c in configs]
        if setup.layout == "swa-full":
            assert windows == [128 // setup.offloaded_block_size, None]
            assert plan.groups[0].sliding_window == 128
        if setup.layout == "eagle-pair":
            assert [g.eagle for g in plan.groups] == [True]
            assert [c.is_eagle_group for c in configs] == [True]
        assert not harness.scheduler.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
    finally:
        harness.shutdown()


@pytest.mark.vllm
def test_repro_with_a_sliding_window_model_shows_two_groups(api) -> None:
    """The issue's check: `repro --model <shipped sliding-window config>` shows both groups (JSON, tables).
    In-process (the command's output is under test, not its process)."""
    model = str(kv_layout.shipped_layout_dir("swa-full"))
    done = invoke("repro", "queued-abort", "--model", model, "--json")
    assert done.returncode in (0, 1, 6), done.stderr  # 6: on 0.34 this layout's run does not reach K1's site
    doc = json.loads(done.stdout)
    groups = doc["setup"]["kv_cache"]["groups"]
    assert [(g["kind"], g["sliding_window"]) for g in groups] == [("sliding_window", 128), ("full_attention", None)]
    assert all(len(r["requests"][0]["groups"]) == 2 for r in doc["results"] if r["requests"])
    done = invoke("repro", "queued-abort", "--model", model)
    assert "group 0: sliding_window block_size=4 window=128" in done.stdout
    assert "group 1: full_attention block_size=4" in done.stdout


def test_recipe_layout_must_be_shipped(tmp_path: Path) -> None:
    from kvdoctor.errors import RecipeError
    from kvdoctor.recipes.loader import load_recipe_file as load_recipe

    source = Path(__file__).resolve().parent.parent / "repros" / "queued-abort.toml"
    text = source.read_text().replace("gpu_blocks = 8", 'gpu_blocks = 8\nlayout = "swa-ful"', 1)
    path = tmp_path / "r.toml"
    path.write_text(text)
    line = text.split("\n").index('layout = "swa-ful"') + 1
    with pytest.raises(RecipeError, match=rf"r.toml:{line}: \[setup\] layout 'swa-ful' is not a layout kvdoctor ships"):
        load_recipe(path)
    path.write_text(text.replace("swa-ful", "swa-full"))
    assert load_recipe(path).setup["layout"] == "swa-full"


# -- real models' config.json, read through transformers' config classes (issue 23) -----------------------------

CONFIGS = Path(__file__).parent / "data" / "configs"
# (layer kind, sliding window) -> layers: what the model's own config class says its layers are
REAL_LAYERS = {
    "llama-3.1-8b": {(kv_layout.FULL, None): 32},
    "qwen3-0.6b": {(kv_layout.FULL, None): 28},
    "qwen3-next-80b-a3b": {(kv_layout.MAMBA, None): 36, (kv_layout.FULL, None): 12},  # linear attention
    "gpt-oss-20b": {(kv_layout.SLIDING, 128): 12, (kv_layout.FULL, None): 12},
    "gemma-3-27b": {(kv_layout.SLIDING, 1024): 52, (kv_layout.FULL, None): 10},  # sliding_window_pattern 6
    "deepseek-v3": {(kv_layout.MLA, None): 61},
}


@pytest.mark.parametrize("name", sorted(REAL_LAYERS))
def test_real_configs_give_the_layers_their_config_class_says(name: str) -> None:
    from collections import Counter

    layout = kv_layout.read_layout(CONFIGS / name)
    assert dict(Counter((layer.kind, layer.sliding_window) for layer in layout.layers)) == REAL_LAYERS[name]
    assert "read by transformers'" in layout.source


def test_kv_page_sizes_of_real_configs() -> None:
    # Llama-3.1-8B: 32 layers x K and V x 8 heads x 128 x bf16 x 16 tokens = 2 MiB a block
    assert kv_layout.read_layout(CONFIGS / "llama-3.1-8b").page_bytes(16) == 2 << 20
    # DeepSeek-V3 MLA: one 576-dim latent (kv_lora_rank 512 + rope 64) a token, no separate V
    assert kv_layout.read_layout(CONFIGS / "deepseek-v3").page_bytes(16) == 61 * 576 * 2 * 16


def test_deepseek_mtp_draft_layers_are_named_not_silently_dropped() -> None:
    """DeepSeek-V3's config has one MTP layer (num_nextn_predict_layers); a server builds its KV only with a
    speculative config. The layout has the 61 target layers and says why the draft layer is not among them."""
    layout = kv_layout.read_layout(CONFIGS / "deepseek-v3")
    assert len(layout.layers) == 61 and not any(layer.draft for layer in layout.layers)
    assert len(layout.notes) == 1 and "1 MTP draft layer(s)" in layout.notes[0]
    assert "speculative config" in layout.notes[0]
    assert kv_layout.read_layout(CONFIGS / "llama-3.1-8b").notes == ()


def test_an_architecture_kvdoctor_cannot_map_is_one_line_exit_2(tmp_path: Path) -> None:
    import time

    write_config(tmp_path, {"model_type": "no_such_architecture", "num_hidden_layers": 4})
    start = time.perf_counter()
    done = run_cli("repro", "queued-abort", "--model", str(tmp_path), "--worker", "simulated")
    took = time.perf_counter() - start
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "no_such_architecture" in done.stderr and "cannot map" in done.stderr
    assert took < 90, f"refused after {took:.1f} s"  # transformers imports torch; vLLM is never imported
    print(f"exit 2 in {took:.1f} s")


# vLLM's planner on the real configs (block size 16): (kind, block size, layers) per group, as a GPU server
# groups them (measured on 0.26.0: Gemma 3's 52 sliding layers in groups as large as its 10 full ones).
REAL_GROUPS = {
    "llama-3.1-8b": [("full_attention", 16, 32)],
    "qwen3-0.6b": [("full_attention", 16, 28)],
    "qwen3-next-80b-a3b": [("mamba", 16, 12)] * 3 + [("full_attention", 16, 12)],
    "gpt-oss-20b": [("sliding_window", 16, 12), ("full_attention", 16, 12)],
    "gemma-3-27b": [("sliding_window", 16, 9)] * 4 + [("sliding_window", 16, 8)] * 2 + [("full_attention", 16, 10)],
    "deepseek-v3": [("MLAAttentionSpec", 16, 61)],
}


@pytest.mark.vllm
@pytest.mark.parametrize("name", sorted(REAL_GROUPS))
def test_real_configs_give_the_groups_vllm_builds(api, release, name: str) -> None:
    from kvdoctor.engine.harness import Harness

    if tuple(release) != (0, 26):
        pytest.skip(f"groups measured on vLLM 0.26.0, not {api.version_text}")
    mode = "align" if name == "qwen3-next-80b-a3b" else None  # a hybrid's prefix caching aligns Mamba blocks
    harness = Harness(api, Setup(model=str(CONFIGS / name), block_size=16, gpu_blocks=64, mamba_cache_mode=mode))
    try:
        assert [(g.kind, g.block_size, len(g.layers)) for g in harness.kv_plan.groups] == REAL_GROUPS[name]
        assert any("MTP draft layer" in note for note in harness.kv_plan.notes) == (name == "deepseek-v3")
    finally:
        harness.shutdown()


def test_a_mamba_model_runs_in_the_cache_mode_vllm_picks_with_prefix_caching() -> None:
    """Qwen3-Next (linear attention) with no Mamba cache mode given: vLLM's MambaModelConfig picks `align` with
    prefix caching (state a block); left unset, the planner's Mamba block (max_model_len) did not divide the
    hash block and the run was other_failure (exit 4). vLLM's worker gives way to the simulated one, saying why."""
    from kvdoctor.recipes.builtins import resolve
    from kvdoctor.resolution import resolve_setup

    model = str(CONFIGS / "qwen3-next-80b-a3b")
    setup = resolve_setup(resolve("queued-abort"), Overrides(model=model, block_size=16, gpu_blocks=500),
                          default_worker="vllm")
    assert setup.mamba_cache_mode == "align"
    assert any(d.startswith("mamba_cache_mode: None -> align") for d in setup.derived), setup.derived
    assert setup.worker == "simulated" and "has a Mamba layer" in setup.worker_fallback
    off = resolve_setup(resolve("queued-abort"), Overrides(model=model, block_size=16, gpu_blocks=500,
                                                  enable_prefix_caching=False), default_worker="vllm")
    assert off.mamba_cache_mode is None  # vLLM keeps `none` without prefix caching
