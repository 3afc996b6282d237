"""Geometry validation and `vllm serve`-style flag parsing (no vLLM import)."""

from __future__ import annotations

import pytest

from kvdoctor.engine.overrides import Overrides
from kvdoctor.engine.serve_args import parse_kv_transfer_config
from kvdoctor.engine.setup import Setup, resolve_blocks_per_chunk
from kvdoctor.errors import UsageError
from kvdoctor.recipes.builtins import load_builtin
from kvdoctor.resolution import resolve_setup


def test_offloaded_block_size_maps_to_blocks_per_chunk():
    recipe = load_builtin("queued-abort")
    overrides = parse_kv_transfer_config('{"kv_connector":"OffloadingConnector","kv_role":"kv_both",'
                                         '"kv_connector_extra_config":{"block_size":16,"cpu_bytes_to_use":1000000,'
                                         '"offload_prompt_only":false}}')
    setup = resolve_setup(recipe, Overrides(block_size=8).merged(overrides))
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
K7 = "mamba-align-midblock-hit-load"  # a Mamba layout: the toy model writes attention KV only
K7_WHY = "layout mamba-hybrid has a Mamba layer"


def test_vllm_worker_on_a_mamba_recipe_is_one_usage_error():
    """repro/inspect --worker vllm of a recipe vLLM's worker cannot drive: exit 2, one line that says why and
    what to run."""
    with pytest.raises(UsageError) as info:
        resolve_setup(load_builtin(K7), Overrides(worker="vllm", device="cpu"))
    message = str(info.value)
    assert "\n" not in message and K7_WHY in message and "--worker simulated" in message


def test_audit_falls_back_to_the_simulated_worker_per_recipe_and_says_why():
    setup = resolve_setup(load_builtin(K7), Overrides(worker="vllm", device="cpu"), worker_fallback=True)
    assert (setup.worker, setup.device) == ("simulated", None)
    assert K7_WHY in setup.worker_fallback
    assert setup.as_dict()["worker_fallback"] == setup.worker_fallback
    assert setup.worker_described().startswith(f"simulated ({K7_WHY}")
    # a recipe vLLM's worker can run keeps it (the MultiConnector one too: vLLM's worker drives both
    # sub-connectors); without the flag nothing falls back
    for name in ("queued-abort", K9):
        other = resolve_setup(load_builtin(name), Overrides(worker="vllm", device="cpu"), worker_fallback=True)
        assert (other.worker, other.worker_fallback) == ("vllm", None), name
    plain = resolve_setup(load_builtin(K7), worker_fallback=True)
    assert (plain.worker, plain.worker_fallback) == ("simulated", None)


@pytest.mark.parametrize("key", ["worker_fallback", "device_fallback"])
def test_fallback_reasons_are_not_recipe_keys(key):
    """kvdoctor sets them when it resolves a setup; a recipe naming one is refused by the loader."""
    from pathlib import Path

    from kvdoctor.errors import RecipeError
    from kvdoctor.recipes.loader import load_recipe_text

    text = (Path(__file__).parent.parent / "repros" / f"{K9}.toml").read_text()
    text = text.replace("[setup]\n", f'[setup]\n{key} = "x"\n', 1)
    with pytest.raises(RecipeError, match=f"unknown key '{key}'"):
        load_recipe_text(text, "test")


def test_audit_row_says_which_worker_ran_a_fallback_recipe():
    from types import SimpleNamespace

    from kvdoctor.observe.verdict import Outcome
    from kvdoctor.report.tables import row_next_steps

    recipe = load_builtin(K7)
    setup = resolve_setup(recipe, Overrides(worker="vllm", device="cpu"), worker_fallback=True)
    result = SimpleNamespace(outcome=Outcome.REPRODUCED, detail="")
    row = SimpleNamespace(recipe=recipe, setup=setup, installed=result, fixed=result, fixed_in=None, hint="")
    label, text = row_next_steps(row)[-1]
    assert label == "worker" and text.startswith(f"simulated ({K7_WHY}")
    row.setup = resolve_setup(recipe)
    assert all(label != "worker" for label, _ in row_next_steps(row))


def test_the_command_lines_default_worker_is_vllms_and_falls_back_visibly():
    """Without --worker, repro/inspect/audit run vLLM's worker; a recipe it cannot drive runs simulated and
    says why (no exit 2: the user asked for nothing), and --worker simulated still wins."""
    from kvdoctor.cli.options import DEFAULT_WORKER, worker_overrides

    default = worker_overrides(None, None, None)
    assert default.given() == {}  # a typed value: no sentinel rides in the overrides
    plain = resolve_setup(load_builtin("queued-abort"), default, default_worker=DEFAULT_WORKER)
    assert (plain.worker, plain.worker_fallback) == ("vllm", None)
    k7 = resolve_setup(load_builtin(K7), default, default_worker=DEFAULT_WORKER)
    assert k7.worker == "simulated" and K7_WHY in k7.worker_fallback
    chosen = resolve_setup(load_builtin("queued-abort"), worker_overrides("simulated", None, None),
                           default_worker=DEFAULT_WORKER)
    assert (chosen.worker, chosen.worker_fallback) == ("simulated", None)
    with pytest.raises(UsageError, match="drop --worker simulated"):
        worker_overrides("simulated", None, "cpu")


def test_a_recipe_that_holds_transfers_keeps_vllms_worker_on_the_cpu_where_a_gpu_is_seen(monkeypatch):
    """Measured on an H200 (2026-12-04): vLLM's own CUDA worker completes each transfer when the GPU does,
    so `hold_transfers`/`fail_transfers` recipes (K1 preemption/prefetch, K2, K11) exited 2 there with the
    default device, and `kvdoctor audit` on a GPU machine exited 2 as a whole. Now: no --device on a GPU
    machine -> the CPU copy engine, saying why; audit --device cuda -> the same per recipe; an explicit
    repro --device cuda on such a recipe -> one usage error before vLLM is imported."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # resolution only: nothing runs on it
    from kvdoctor.cli.options import DEFAULT_WORKER, worker_overrides
    from kvdoctor.report.tables import setup_line

    held = load_builtin("preemption")
    assert any(step.action == "hold_transfers" for step in held.steps)
    default = resolve_setup(held, worker_overrides(None, None, None), default_worker=DEFAULT_WORKER)
    assert (default.worker, default.device) == ("vllm", "cpu")
    assert "hold_transfers need kvdoctor's copy engine" in default.device_fallback
    assert "device=cpu (hold_transfers need kvdoctor's copy engine" in setup_line(default)
    plain = resolve_setup(load_builtin("queued-abort"), worker_overrides(None, None, None),
                          default_worker=DEFAULT_WORKER)
    assert (plain.device, plain.device_fallback) == ("cuda", None)  # nothing held: the GPU it is
    audit = resolve_setup(held, worker_overrides("vllm", None, "cuda"), worker_fallback=True)
    assert audit.device == "cpu" and audit.device_fallback == default.device_fallback
    with pytest.raises(UsageError) as info:
        resolve_setup(held, worker_overrides("vllm", None, "cuda"))
    assert "\n" not in str(info.value) and "preemption" in str(info.value) and "--device cpu" in str(info.value)
    asked_cpu = resolve_setup(held, worker_overrides("vllm", None, "cpu"))
    assert (asked_cpu.device, asked_cpu.device_fallback) == ("cpu", None)



# -- the one serve-flag table, the typed overrides, the split of Setup (issue 33) ----------------------

def test_the_serve_flag_table_is_what_the_cli_the_serve_command_and_the_script_read():
    """Each reader of a serve flag reads it from `SERVE_FLAGS`: the CLI's options (their names and help), the
    `vllm serve` command line of the serve level, the exported script's setup and a log's serve arguments."""
    from typer.main import get_command

    from kvdoctor.cli.app import app
    from kvdoctor.engine.serve_args import CLI_FLAGS, SERVE_FLAGS, exported_setup, serve_command_flags

    params = {p.name: p for p in get_command(app).commands["repro"].params}
    for row in CLI_FLAGS:
        assert params[row.name].help == row.help
        assert row.flag in params[row.name].opts
    setup = Setup(block_size=8, gpu_blocks=32, async_scheduling=True, enable_prefix_caching=False,
                  scheduling_policy="priority")
    words = serve_command_flags(setup)
    assert words[words.index("--block-size") + 1] == "8"
    assert words[words.index("--num-gpu-blocks-override") + 1] == "32"
    assert "--async-scheduling" in words and "--no-enable-prefix-caching" in words
    assert words[words.index("--scheduling-policy") + 1] == "priority"
    assert "--prefix-cache-retention-interval" not in words  # unset: vLLM's default
    exported = exported_setup(setup)
    assert exported["gpu_blocks"] == 32 and exported["scheduling_policy"] == "priority"
    assert set(exported) == {row.field for row in SERVE_FLAGS.values() if row.exported}
    assert "scheduling_policy" not in exported_setup(Setup())


def test_overrides_are_a_typed_value_with_no_magic_key():
    from kvdoctor.engine.overrides import Overrides
    from kvdoctor.engine.serve_args import parse_kv_transfer_config

    given = parse_kv_transfer_config('{"kv_connector_extra_config": {"block_size": 32, "cpu_bytes_to_use": 4096}}')
    assert given.offloaded_block_size == 32 and given.cpu_bytes_to_use == 4096
    assert "offloaded_block_size" not in given.given()  # not a Setup field: resolved against block_size
    with pytest.raises(TypeError):
        Overrides(**{"_offloaded_block_size": 32})  # type: ignore[arg-type]
    setup = resolve_setup(load_builtin("queued-abort"), Overrides(block_size=8).merged(given))
    assert (setup.block_size, setup.blocks_per_chunk) == (8, 4)


def test_setup_validates_without_reading_the_machine(monkeypatch):
    """`Setup.validate` is the recipe's pure geometry: no /proc/meminfo, no config.json. The machine's checks
    are `resolution.check_on_this_machine`'s (a model directory kvdoctor cannot read is refused there)."""
    import builtins

    from kvdoctor.resolution import check_on_this_machine

    real_open = builtins.open

    def guarded(path, *args, **kwargs):
        assert not str(path).startswith("/proc") and not str(path).endswith("config.json"), path
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", guarded)
    setup = Setup(model="/nonexistent-model-dir", gpu_blocks=3_000_000).validate()
    monkeypatch.setattr(builtins, "open", real_open)
    with pytest.raises(UsageError):
        check_on_this_machine(setup)


def test_recipe_setup_types_come_from_the_annotations():
    from kvdoctor.recipes.loader import _SETUP_TYPES, _value_types

    assert _SETUP_TYPES["sliding_window"] == (int,) and _SETUP_TYPES["spec_name"] == (str,)
    assert _SETUP_TYPES["async_scheduling"] == (bool,)
    with pytest.raises(TypeError, match="no TOML reading"):
        _value_types("ratio", float | None)
