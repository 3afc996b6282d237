"""A P/D decode node (issue 35, vllm#52170): vLLM's real MultiConnector with kvdoctor's stand-in for NIXL first and
vLLM's real OffloadingConnector second ([setup] pd_decode = true). Remote-prefill loads end or fail on the recipe's
schedule; what vLLM's scheduler and the OffloadingConnector do then is measured on the installed release."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvdoctor import app as application
from kvdoctor.engine.overrides import Overrides
from kvdoctor.errors import RecipeError
from kvdoctor.observe.verdict import Outcome

RECIPE = Path(__file__).parent / "data" / "pd-decode-remote-prefill.toml"
REMOTE = {"do_remote_prefill": True}


def _play(api, fail_b: bool) -> tuple[list[dict[str, int]], list[dict[int, str]], object]:
    from kvdoctor.engine.harness import Harness
    from kvdoctor.engine.setup import Setup

    harness = Harness(api, Setup(block_size=4, gpu_blocks=64, max_model_len=128, worker="simulated", pd_decode=True,
                                 kv_transfer_fields={"kv_load_failure_policy": "recompute"}))
    try:
        harness.add("A", list(range(10, 34)), 4, dict(REMOTE))
        harness.add("B", list(range(40, 60)), 4, dict(REMOTE))
        if fail_b:
            harness.pd_fail("B", None)
        events = [harness.step() for _ in range(7)]
        assert harness.pd_loads is not None
        return [e.scheduled_tokens for e in events], [e.new_store_jobs for e in events], harness.pd_loads
    finally:
        harness.shutdown()


def test_a_failed_remote_load_is_recomputed_and_both_requests_are_stored(api):
    """Measured on 0.26.0 (the failure as invalid_block_ids) and 0.34.0 (as failed_recving): both requests wait
    for their loads (nothing scheduled); then A, whose load ended, computes only its last token, and B, whose load
    failed, recomputes its 20 prompt tokens; the OffloadingConnector stores each once, as the tokens it computed."""
    scheduled, stores, loads = _play(api, fail_b=True)
    assert scheduled[0] == {} and scheduled[1] == {}, scheduled
    assert scheduled[2] == {"A": 1, "B": 20}, scheduled
    assert sorted(req for step in stores for req in step.values()) == ["A", "B"], stores
    assert loads.finished == ["A"] and loads.failed == ["B"] and loads.issued == 2


def test_without_the_failure_b_is_loaded_not_recomputed(api):
    """The mutation of the schedule: with B's load left to end, B computes only its last token, as A does (the
    failure above is what made vLLM recompute B)."""
    scheduled, _, loads = _play(api, fail_b=False)
    assert scheduled[2] == {"A": 1, "B": 1}, scheduled
    assert loads.failed == [] and loads.finished == ["A", "B"]


def test_the_recipe_crashes_only_without_the_allocated_chunk_cap():
    """C, a remote prefill aborted while its load is in flight, has offload keys and no blocks in the
    OffloadingConnector (K1's mechanism, through a remote prefill). Measured: with PR #49146's cap (kvdoctor's
    fixed logic; the installed logic of 0.34.0) nothing fires; with the cap removed (unpatched) `_build_store_jobs`'s
    assert fires on 0.26.0 and 0.34.0 alike. The installed logic of 0.26.0 crashes there too."""
    results = {r.logic: r for r in application.repro(str(RECIPE), Overrides(), "all").results}
    assert results["fixed"].outcome is Outcome.NOT_REPRODUCED and results["fixed"].failure is None
    unpatched = results["unpatched"]
    assert unpatched.outcome is Outcome.REPRODUCED and unpatched.failure is not None
    assert unpatched.failure.function == "_build_store_jobs", unpatched.failure


def test_pd_fail_without_the_stand_in_is_one_line(tmp_path):
    text = RECIPE.read_text().replace("pd_decode = true\n", "")
    path = tmp_path / "bare.toml"
    path.write_text(text)
    from kvdoctor.recipes.loader import load_recipe_file

    with pytest.raises(RecipeError, match=r"bare.toml:\d+: `pd_fail` .* needs \[setup\] pd_decode = true"):
        load_recipe_file(path)


def test_force_pd_decode_draws_remote_prefills_and_failures_and_leaves_unforced_draws_alone():
    """`--force pd-decode` (no byte of its own): the same raw example, forced, is a P/D decode node whose first,
    third, ... requests are remote prefills and whose third's load fails; unforced it is as before."""
    from kvdoctor.explore.generate import PD_DRAW, Example, event_steps

    geometry = (0,) * 11
    events = [(1, 5, 2, 0)] * 4  # four adds of 6-token prompts
    plain = Example.from_fields(geometry, events)
    forced = Example.from_fields(geometry, events, features=frozenset({PD_DRAW}))
    assert not plain.geometry.pd_decode and "pd_decode" not in plain.geometry.setup_dict()
    assert forced.geometry.setup_dict()["pd_decode"] is True
    assert dataclasses.replace(forced.geometry, pd_decode=False, kv_load_failure_policy=None) == dataclasses.replace(
        plain.geometry, kv_load_failure_policy=None)
    steps = event_steps(forced)
    adds = [s for s in steps if s.action == "add"]
    remote = [s.args["request"] for s in adds if s.args.get("kv_transfer_params", {}).get("do_remote_prefill")]
    assert remote == [a.args["request"] for a in adds][::2]
    assert [s.args["request"] for s in steps if s.action == "pd_fail"] == [adds[2].args["request"]]
    assert not any(s.action == "pd_fail" or "kv_transfer_params" in s.args for s in event_steps(plain))


def test_force_names_parse():
    from kvdoctor.explore.aim import parse_aim

    assert parse_aim(None, ["pd-decode"], None)["force"] == frozenset({"pd-decode"})


def test_a_mamba_model_under_a_speculative_config_sizes_the_fill_with_its_speculative_blocks(api):
    """Issue 35 (item 3): `--model` Qwen3-Next (linear attention, align) with ngram speculation (3 tokens): vLLM
    gives each Mamba spec num_speculative_blocks = 3, and MambaManager allocates them with the running state, so a
    request filling the pool holds 2 + 3 blocks in each Mamba group; the pool is sized by it (before: 2, and the
    fill left blocks over). The run then plays to a verdict."""
    from kvdoctor.engine.kv_layout import MAMBA_ALIGN_BLOCKS_PER_REQUEST
    from kvdoctor.levels.runners import runner
    from kvdoctor.recipes.builtins import resolve
    from kvdoctor.resolution import resolve_setup

    config = Path(__file__).parent / "data" / "configs" / "qwen3-next-80b-a3b"
    if not config.is_dir():
        pytest.skip("tests/data/configs/qwen3-next-80b-a3b is not shipped")
    recipe = resolve("queued-abort")
    setup = resolve_setup(recipe, Overrides(model=str(config), worker="simulated", speculative_method="ngram",
                                            num_speculative_tokens=3))
    assert setup.untested is None and setup.mamba_fill_requests, (setup.untested, setup.mamba_fill_requests)
    result = runner("scheduler").judged_run(api, recipe, setup, "installed")
    assert result.outcome.value in ("reproduced", "not_reproduced"), (result.outcome, result.detail)
    held = 3 * (MAMBA_ALIGN_BLOCKS_PER_REQUEST + 3) * setup.mamba_fill_requests
    notes = result.kv_plan.notes if result.kv_plan is not None else []
    assert any(f"the {held} blocks its 3 Mamba group(s) hold" in note and "3 speculative block(s) each" in note
               for note in notes), notes
