"""kvdoctor's scripted secondary tier (issue 36): a `SecondaryTierManager` subclass vLLM's tiering spec loads
itself through the tier spec's `module_path`, its job outcomes and backpressure decisions scripted, and the
tier invariants (observe/tier_invariants.py) that read it. Each invariant holds on the real tiering manager
and is violated on a mutated copy of the manager's method (patched on its class inside a MonkeyPatch scope,
restored even when the run raises). Every assertion is on what vLLM's manager did.

One scenario throughout (as tests/test_tiers.py): A (8 tokens, 2 chunks) stored; C's 2 chunks evict A's from
the two-chunk CPU tier; the GPU prefix cache is reset; B = A's prompt + 1 token promotes A's chunks back."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

from kvdoctor.engine.setup import Setup
from kvdoctor.errors import UsageError

from .tier_promotion import play_promotion

TIERING = "TieringOffloadingSpec"
GEOMETRY = dict(block_size=4, gpu_blocks=16, max_model_len=64, spec_name=TIERING, cpu_bytes_to_use=8192)


# -- no vLLM needed ---------------------------------------------------------------------------------

def test_setup_takes_the_scripted_tier_its_script_and_a_backpressure_pattern():
    cfg = Setup(secondary_tier="fs+scripted", tier_script="late/defer,partial", backpressure_pattern="1,0",
                **GEOMETRY).validate().kv_connector_extra_config()
    fs, scripted = cfg["secondary_tiers"]
    assert fs["type"] == "fs"
    assert (scripted["type"], scripted["module_path"]) == ("ScriptedSecondaryTier",
                                                           "kvdoctor.engine.compat.scripted_tier")
    assert scripted["script"] == "late/defer,partial"
    assert scripted["backpressure"] == {"backpressure_cls": "kvdoctor.engine.compat.scripted_tier.ScriptedDetector",
                                        "policy_cls": "kvdoctor.engine.compat.scripted_tier.ScriptedPolicy",
                                        "pattern": "1,0"}
    assert "backpressure" not in Setup(secondary_tier="scripted", **GEOMETRY).kv_connector_extra_config()[
        "secondary_tiers"][0]
    with pytest.raises(UsageError, match="unknown outcome 'defer'"):
        Setup(secondary_tier="scripted", tier_script="defer", **GEOMETRY).validate()  # stores cannot defer
    with pytest.raises(UsageError, match="0s and 1s"):
        Setup(secondary_tier="scripted", backpressure_pattern="1,x", **GEOMETRY).validate()
    with pytest.raises(UsageError, match="tier_script needs secondary_tier"):
        Setup(secondary_tier="fs", tier_script="ok", **GEOMETRY).validate()


# -- on the installed vLLM ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def scripted(api):
    if not api.has_offloading_spec(TIERING) or not api.has_scripted_tier():
        pytest.skip("this vLLM's tiering spec loads no out-of-tree tier with deferred releases "
                    "(tiering/factory.py module_path, JobResult.deferred_release: 0.34.0 here)")
    return api


Mutant = Callable[[type, Any], None]  # (the tiering manager's class, a MonkeyPatch) -> patches it


def _drive(api, mutant: Mutant | None = None, **setup: Any) -> dict:
    """The scenario, every tier invariant checked after each step."""
    from kvdoctor.engine.harness import Harness
    from kvdoctor.observe.tier_invariants import TIER_INVARIANTS

    harness = Harness(api, Setup(**{**GEOMETRY, "secondary_tier": "scripted", **setup}).validate())
    manager = api.tiering_manager_of(harness.connector_scheduler)
    with pytest.MonkeyPatch.context() as patch:
        if mutant is not None:
            mutant(type(manager), patch)

        try:
            violations, rows = play_promotion(harness, TIER_INVARIANTS)
        finally:
            (tier,) = api.scripted_tiers(manager)
            harness.shutdown()
    return {"violations": violations, "rows": rows, "tier": tier,
            "tiers": [type(t).__name__ for t in manager.secondary_tiers]}


def _names(run: dict) -> set[str]:
    return {name for name, _ in run["violations"]}


def test_vllm_loads_the_scripted_tier_and_promotes_from_it(scripted):
    run = _drive(scripted)
    assert run["tiers"] == ["ScriptedSecondaryTier"]
    journal = run["tier"].journal
    assert journal.store_sizes == [2, 2] and journal.lookups["HIT"] >= 2, journal  # A's and C's chunks cascaded
    assert ("WAITING_FOR_REMOTE_KVS", 8) in run["rows"], run["rows"]  # B loads A's 2 promoted chunks
    assert run["rows"][-1][0] == "FINISHED_LENGTH_CAPPED" and not run["violations"], run


def test_two_tiers_at_once_fs_first(scripted):
    run = _drive(scripted, secondary_tier="fs+scripted")
    assert run["tiers"] == ["FileSystemTierManager", "ScriptedSecondaryTier"]
    assert run["tier"].journal.store_sizes == [2, 2]  # every CPU-tier chunk cascades to both tiers
    assert ("WAITING_FOR_REMOTE_KVS", 8) in run["rows"] and not run["violations"], run


@pytest.mark.parametrize("script, computed", [
    ("late/partial", 4),  # stores complete a step late (RETRY meanwhile); half of the promotion loads
    ("/defer", None),     # the promotion fails with a deferred release: B recomputes
    ("fail/", None),      # every cascade fails: nothing to promote
])
def test_failures_are_survived_and_every_invariant_holds(scripted, script, computed):
    run = _drive(scripted, tier_script=script)
    assert not run["violations"], run["violations"]
    assert run["rows"][-1][0] == "FINISHED_LENGTH_CAPPED", run["rows"]
    waited = [c for status, c in run["rows"] if status == "WAITING_FOR_REMOTE_KVS"]
    assert waited == ([computed] if computed else []), run["rows"]
    assert not run["tier"].journal.deferred_chunks  # every deferred release was set and applied


# -- each invariant: violated on a mutated manager, held on the real one (above) ------------------------

def _patch(cls: type, patch: Any, name: str, make: Callable[[Any], Any]) -> None:
    patch.setattr(cls, name, make(getattr(cls, name)))


def test_a_manager_that_resubmits_its_promotions_promotes_a_chunk_twice(scripted):
    def mutant(cls, patch):
        def make(original):
            def flush(self):  # forgets to clear its pending promotions
                pending = {tier: dict(entries) for tier, entries in self._pending_load_submissions.items()}
                original(self)
                self._pending_load_submissions.update(pending)
            return flush
        _patch(cls, patch, "_flush_pending_promotions", make)

    run = _drive(scripted, mutant, tier_script="/late")
    assert "tier-no-double-promotion" in _names(run), run["violations"]


def test_a_manager_that_serves_a_failed_promotion_has_a_hit_for_it(scripted):
    def mutant(cls, patch):
        _patch(cls, patch, "_complete_promotion", lambda original: lambda self, job, done: original(
            self, job, dataclasses.replace(done, success=True, successful_keys=None, deferred_release=None)))

    run = _drive(scripted, mutant, tier_script="/fail")
    assert "tier-no-hit-after-failed-promotion" in _names(run), run["violations"]


def test_a_manager_that_frees_a_deferred_chunk_at_once_releases_it_under_the_tier(scripted):
    def mutant(cls, patch):
        _patch(cls, patch, "_complete_promotion", lambda original: lambda self, job, done: original(
            self, job, dataclasses.replace(done, deferred_release=None)))

    run = _drive(scripted, mutant, tier_script="/defer")
    assert "tier-no-promotion-into-released-chunk" in _names(run), run["violations"]


def test_a_manager_that_forgets_to_finish_the_tiers_leaks_their_request_state(scripted):
    def mutant(cls, patch):
        def make(original):
            def finalize(self, req_id, exclude_tier_idx=None):  # drops the state, never tells the tiers
                state = self._req_state[req_id]
                if state.is_finished and not state.pending_primary_stores and not state.pending_cascade_keys:
                    del self._req_state[req_id]
            return finalize
        _patch(cls, patch, "_maybe_finalize_request", make)

    run = _drive(scripted, mutant)
    assert "tier-request-released-once" in _names(run), run["violations"]


# -- backpressure -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def backpressure(scripted):
    if not scripted.has_tier_backpressure():
        pytest.skip("this vLLM builds no backpressure detector from a tier's `backpressure_cls`")
    return scripted


def test_backpressure_drops_what_its_pattern_says_and_stores_resume(backpressure):
    run = _drive(backpressure, backpressure_pattern="0,1")
    detector = run["tier"].bp_detector
    assert type(detector).__name__ == "ScriptedDetector"  # built by vLLM's factory from `backpressure_cls`
    assert [ok for ok, _ in detector.decisions][:2] == [False, True], detector.decisions
    assert run["tier"].journal.store_sizes == [n for ok, n in detector.decisions if ok] == [2]  # C's stored
    assert run["rows"][-1][0] == "FINISHED_LENGTH_CAPPED" and not run["violations"], run
    assert ("WAITING_FOR_REMOTE_KVS", 8) not in run["rows"]  # A's cascade was dropped: nothing to promote


def test_a_manager_that_ignores_backpressure_is_caught(backpressure):
    def mutant(cls, patch):
        _patch(cls, patch, "_should_store_to_tier",
               lambda original: lambda self, tier, n: (original(self, tier, n), True)[1])

    run = _drive(backpressure, mutant, backpressure_pattern="0,1")
    assert "tier-backpressure-accounted" in _names(run), run["violations"]


def test_the_recipe_replays_with_kvdoctor_repro(api):
    """Both tiers from a recipe file: the scripted one deferring its failed promotions, under backpressure,
    every tier invariant checked (the recipe's `invariants`); not_applicable where the probe says no."""
    from pathlib import Path

    from .cli_runner import invoke

    result = invoke("repro", str(Path(__file__).resolve().parent / "data" / "scripted-tier-promotion.toml"))
    assert result.returncode == 0, result.stdout + result.stderr
    if not (api.has_offloading_spec(TIERING) and api.has_scripted_tier() and api.has_secondary_tier("fs")):
        assert "not_applicable" in result.stdout, result.stdout
        return
    assert "checks held: B ran to its max_tokens with two tiers" in result.stdout, result.stdout
    assert "reproduced " not in result.stdout.replace("not_reproduced", ""), result.stdout


# Found by `explore --seed 1` on 0.34.0 (600 s): a reset while a promotion fails with a deferred release, the
# gauge of deferred-release chunks at 1 once nothing runs. vLLM's connector says the engine must keep stepping
# then (`has_pending_push_work`: the tier may still write the chunk), so it is work in flight, not a leak.
DEFERRED_AT_IDLE = "\n".join([
    '[recipe]', 'name = "deferred-release-at-idle"', 'summary = "a deferred release pending when requests are done"',
    '[setup]', 'block_size = 2', 'blocks_per_chunk = 1', 'gpu_blocks = 4', 'max_model_len = 6',
    'cpu_bytes_to_use = 4096', f'spec_name = "{TIERING}"', 'secondary_tier = "scripted"',
    'tier_script = "late,ok/defer,ok"', 'worker = "simulated"',
    '[signature]', 'invariant = "idle-connector-gauges-zero"',
    '[[step]]', 'action = "add"', 'request = "A"', 'prompt_tokens = 2', 'max_tokens = 1',
    '[[step]]', 'action = "schedule"',
    '[[step]]', 'action = "add"', 'request = "B"', 'prompt_tokens = 2', 'max_tokens = 1',
    'shared_prefix_with = "A"', 'shared_prefix_tokens = 2',
    '[[step]]', 'action = "reset_prefix_cache"', 'reset_connector = true',
    '[[step]]', 'action = "schedule"',
    '[[step]]', 'action = "complete_transfers"',
    '[[step]]', 'action = "schedule"',
]) + "\n"


def test_a_pending_deferred_release_is_not_an_idle_engine(scripted, tmp_path):
    """The idle gauges are judged only once vLLM's connector lets the engine stop stepping: the deferred
    release still pending at the last step keeps it busy, so the invariant holds (it fired before)."""
    from kvdoctor import app as application
    from kvdoctor.engine.overrides import Overrides
    from kvdoctor.observe.verdict import Outcome

    path = tmp_path / "deferred.toml"
    path.write_text(DEFERRED_AT_IDLE, encoding="utf-8")
    (result,) = application.repro(str(path), Overrides(), "installed").results
    assert result.outcome is Outcome.NOT_REPRODUCED, (result.outcome, result.detail)


# -- explore's draw ---------------------------------------------------------------------------------------

def test_the_tier_bytes_upper_bits_draw_the_scripted_tier_only_where_probed():
    from kvdoctor.explore.generate import Example, Geometry, decode_tier, to_recipe
    from kvdoctor.explore.tier_draw import SCRIPTED_TIER_DRAW
    from kvdoctor.recipes.loader import load_recipe_text
    from kvdoctor.recipes.writer import recipe_to_toml

    plain = Geometry(4, 1, 24, 16, 256, False)
    on = frozenset({SCRIPTED_TIER_DRAW})
    # without the feature (every release but those loading the scripted tier) the upper bits change nothing
    assert all(decode_tier(plain, byte) == decode_tier(plain, byte & 7) for byte in range(256))
    assert decode_tier(plain, 1, features=on) == decode_tier(plain, 1)  # zero upper bits: the fs tier, as before
    drawn = decode_tier(plain, 1 | 1 << 3 | 2 << 5 | 1 << 7, features=on)
    assert (drawn.secondary_tier, drawn.tier_script, drawn.backpressure_pattern) == (
        "scripted", "ok,fail/partial,late", "1,0,1")
    assert decode_tier(plain, 1 | 2 << 3, features=on).secondary_tier == "fs+scripted"
    events = (("add", ("tokens", 8), 1, None), ("schedule", 4))
    recipe = to_recipe(Example(drawn, events))
    loaded = load_recipe_text(recipe_to_toml(recipe), "generated.toml")
    assert loaded.setup == recipe.setup and recipe.setup["tier_script"] == "ok,fail/partial,late"
    Setup(**{k: v for k, v in drawn.setup_dict().items() if k != "extra_connector_config"}).validate()


def test_explore_probes_the_scripted_tier_by_feature(api):
    from kvdoctor.explore.search import available_features
    from kvdoctor.explore.tier_draw import SCRIPTED_TIER_DRAW, VLLM_BACKPRESSURE_DRAW

    expected = api.has_scripted_tier() and api.has_tier_backpressure() and api.has_secondary_tier("fs")
    features = available_features(api)
    assert (SCRIPTED_TIER_DRAW in features) == expected
    # vLLM's own detector in the backpressure bit (tests/test_vllm_backpressure.py): with it, where it can be built
    assert (VLLM_BACKPRESSURE_DRAW in features) == (expected and api.has_vllm_backpressure(failure_threshold=True))
