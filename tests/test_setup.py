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


K9 = "reused-block-unfenced-multiconnector"


def test_vllm_worker_on_a_multiconnector_recipe_is_one_usage_error():
    """repro/inspect --worker vllm of the MultiConnector recipe: exit 2, one line that says why and what to run."""
    with pytest.raises(UsageError) as info:
        resolve_setup(load_builtin(K9), {"worker": "vllm", "device": "cpu"})
    message = str(info.value)
    assert "\n" not in message and "does not drive MultiConnector" in message and "--worker simulated" in message


def test_audit_falls_back_to_the_simulated_worker_per_recipe_and_says_why():
    setup = resolve_setup(load_builtin(K9), {"worker": "vllm", "device": "cpu"}, worker_fallback=True)
    assert (setup.worker, setup.device) == ("simulated", None)
    assert "does not drive MultiConnector" in setup.worker_fallback
    assert setup.as_dict()["worker_fallback"] == setup.worker_fallback
    assert setup.worker_described().startswith("simulated (vLLM's worker does not drive MultiConnector here: ")
    # a recipe vLLM's worker can run keeps it; without the flag nothing falls back
    other = resolve_setup(load_builtin("queued-abort"), {"worker": "vllm", "device": "cpu"}, worker_fallback=True)
    assert (other.worker, other.worker_fallback) == ("vllm", None)
    plain = resolve_setup(load_builtin(K9), {}, worker_fallback=True)
    assert (plain.worker, plain.worker_fallback) == ("simulated", None)
    # a Mamba layout (K7's): the toy model writes attention KV only
    mamba = resolve_setup(load_builtin("mamba-align-midblock-hit-load"), {"worker": "vllm", "device": "cpu"},
                          worker_fallback=True)
    assert mamba.worker == "simulated" and "Mamba layer" in mamba.worker_fallback


def test_worker_fallback_is_not_a_recipe_key():
    from kvdoctor.recipes.loader import load_recipe_text

    from pathlib import Path

    text = (Path(__file__).parent.parent / "repros" / f"{K9}.toml").read_text()
    text = text.replace("[setup]\n", '[setup]\nworker_fallback = "x"\n', 1)
    from kvdoctor.errors import RecipeError

    with pytest.raises(RecipeError, match="unknown key 'worker_fallback'"):
        load_recipe_text(text, "test")


def test_audit_row_says_which_worker_ran_a_fallback_recipe():
    from types import SimpleNamespace

    from kvdoctor.observe.verdict import Outcome
    from kvdoctor.report.tables import row_next_steps

    recipe = load_builtin(K9)
    setup = resolve_setup(recipe, {"worker": "vllm", "device": "cpu"}, worker_fallback=True)
    result = SimpleNamespace(outcome=Outcome.REPRODUCED, detail="")
    row = SimpleNamespace(recipe=recipe, setup=setup, installed=result, fixed=result, release_hint=None, hint="")
    label, text = row_next_steps(row)[-1]
    assert label == "worker" and text.startswith("simulated (vLLM's worker does not drive MultiConnector here: ")
    row.setup = resolve_setup(recipe, {})
    assert all(label != "worker" for label, _ in row_next_steps(row))


def test_the_command_lines_default_worker_is_vllms_and_falls_back_visibly():
    """Without --worker, repro/inspect/audit run vLLM's worker; a recipe it cannot drive runs simulated and
    says why (no exit 2: the user asked for nothing), and --worker simulated still wins."""
    from kvdoctor.cli.options import worker_overrides

    default = worker_overrides(None, None, None)
    plain = resolve_setup(load_builtin("queued-abort"), default)
    assert (plain.worker, plain.worker_fallback) == ("vllm", None)
    k9 = resolve_setup(load_builtin(K9), default)
    assert k9.worker == "simulated" and "does not drive MultiConnector" in k9.worker_fallback
    chosen = resolve_setup(load_builtin("queued-abort"), worker_overrides("simulated", None, None))
    assert (chosen.worker, chosen.worker_fallback) == ("simulated", None)
    with pytest.raises(UsageError, match="drop --worker simulated"):
        worker_overrides("simulated", None, "cpu")
