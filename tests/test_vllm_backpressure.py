"""vLLM's own backpressure detector (its EMABackpressureDetector, Throttled/DropStore policy: tiering/backpressure.py)
on kvdoctor's scripted tier and step clock (issue 36): `Setup.backpressure_pattern = "vllm[:...]"`. The detector is
vLLM's, built by vLLM's tier factory; kvdoctor replaces only the clock it reads (compat/step_clock.py) and records what
it decides (compat/vllm_backpressure.py). Each new invariant holds on the real detector and is violated on a mutated
copy of one of its methods (patched on vLLM's class inside a MonkeyPatch scope, restored even when the run raises).

One scenario throughout: ten 8-token requests (2 chunks each) one after the other, every cascade to the scripted
tier completing late (two steps: 256 s/MiB on the step clock, over the 64 s/MiB high water mark), then idle steps in
which vLLM's EMA decays, then four requests more."""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from typing import Any

import pytest

from kvdoctor.engine.setup import Setup
from kvdoctor.errors import UsageError

TIERING = "TieringOffloadingSpec"
GEOMETRY = dict(block_size=4, gpu_blocks=16, max_model_len=64, spec_name=TIERING, cpu_bytes_to_use=8192,
                secondary_tier="scripted", tier_script="late/")
DROP = "vllm:policy=drop,warmup=2,half_life=2,cooldown=2"
BACKPRESSURE_MODULE = "vllm.v1.kv_offload.tiering.backpressure"


# -- no vLLM needed ---------------------------------------------------------------------------------

def test_setup_names_vllms_detector_with_its_parameters_and_the_step_clock():
    cfg = Setup(**{**GEOMETRY, "backpressure_pattern": "vllm:policy=drop,step_s=0.5,failures=2"}).validate()
    (tier,) = cfg.kv_connector_extra_config()["secondary_tiers"]
    assert tier["step_s"] == 0.5
    assert tier["backpressure"] == {
        "backpressure_cls": "kvdoctor.engine.compat.vllm_backpressure.RecordedEMADetector",
        "policy_cls": "kvdoctor.engine.compat.vllm_backpressure.RecordedDropPolicy",
        "high_water_s": 64.0, "low_water_s": 16.0, "warmup_completions": 2, "decay_half_life_s": 2.0,
        "cooldown_s": 2.0, "failure_threshold": 2}
    for bad, match in (("vllm:policy=fast", "policy must be one of"), ("vllm:tempo=1", "unknown vLLM backpressure"),
                       ("vllm:high=1,low=2", "out of range"), ("vllm:step_s=x", "not a number")):
        with pytest.raises(UsageError, match=match):
            Setup(**{**GEOMETRY, "backpressure_pattern": bad}).validate()


def test_explore_draws_vllms_detector_only_where_the_feature_is():
    from kvdoctor.explore.tier_draw import SCRIPTED_TIER_DRAW, VLLM_BACKPRESSURE_DRAW, scripted_tier_fields

    old, new = frozenset({SCRIPTED_TIER_DRAW}), frozenset({SCRIPTED_TIER_DRAW, VLLM_BACKPRESSURE_DRAW})
    for script_bits, expected in ((0, "1,0,1"), (1, "vllm"), (2, "1,0,1"), (3, "vllm:policy=drop,failures=2")):
        byte = 1 << 7 | script_bits << 5 | 1 << 3  # the scripted tier alone, a script, the backpressure bit
        assert scripted_tier_fields(byte, old)[2] == "1,0,1"  # releases without the feature: as before
        assert scripted_tier_fields(byte, new)[2] == expected
        assert scripted_tier_fields(byte & 0x7F, new)[2] is None  # no backpressure bit: none, as before


# -- on the installed vLLM ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def vllm_bp(api):
    if not api.has_offloading_spec(TIERING) or not api.has_scripted_tier() or not api.has_vllm_backpressure():
        pytest.skip("this vLLM has no scripted tier with its own EMABackpressureDetector built from a tier's "
                    "`backpressure` dict (0.34.0 here; 0.31-0.33 have the detector but no scripted tier)")
    return api


def test_a_vllm_that_cannot_build_the_detector_refuses_in_one_line(api):
    """Exit 2 (UsageError, before any build) where the probe says this vLLM cannot build its detector on the scripted
    tier (0.26.0-0.33.0: no scripted tier; measured); the same setup's config is accepted where it can (0.34.0)."""
    extra = Setup(**{**GEOMETRY, "backpressure_pattern": "vllm"}).validate().kv_connector_extra_config()
    if api.has_vllm_backpressure():
        assert api.kv_transfer_config(extra, {}) is not None
        return
    with pytest.raises(UsageError, match="cannot build its EMABackpressureDetector"):
        api.kv_transfer_config(extra, {})


Mutant = Callable[[Any, Any], None]  # (vLLM's backpressure module, a MonkeyPatch) -> patches it


def _drive(api: Any, pattern: str = DROP, mutant: Mutant | None = None, fail_at: int | None = None) -> dict:
    """The scenario, every tier invariant checked after each step; `fail_at`: the scenario raises at that step."""
    from kvdoctor.engine.harness import Harness
    from kvdoctor.observe.invariants import StepContext, check_all
    from kvdoctor.observe.tier_invariants import TIER_INVARIANTS

    violations: list[tuple[str, str]] = []
    with pytest.MonkeyPatch.context() as patch:
        if mutant is not None:
            mutant(importlib.import_module(BACKPRESSURE_MODULE), patch)
        harness = Harness(api, Setup(**{**GEOMETRY, "backpressure_pattern": pattern}).validate())
        (tier,) = api.scripted_tiers(api.tiering_manager_of(harness.connector_scheduler))
        detector = tier.bp_detector
        records: list[Any] = []
        steps = 0

        def step() -> None:
            nonlocal steps
            steps += 1
            if steps == fail_at:
                raise RuntimeError("the scenario fails here")
            harness.step()
            records.extend(detector.records)
            violations.extend((v.invariant, v.message) for v in check_all(TIER_INVARIANTS,
                                                                          StepContext(harness, None, [])))

        try:
            for index in range(14):
                harness.add(f"R{index}", list(range(100 * index + 100, 100 * index + 108)), 1)
                for _ in range(4):
                    step()
                if index == 9:
                    for _ in range(12):
                        step()
            finished = all(r.status.name.startswith("FINISHED") for r in harness.requests.values())
        finally:
            harness.shutdown()
    return {"violations": violations, "decisions": list(detector.decisions), "records": records,
            "finished": finished, "tier": tier}


def _names(run: dict) -> set[str]:
    return {name for name, _ in run["violations"]}


def test_pressure_builds_drops_cascades_clears_and_stores_resume(vllm_bp):
    run = _drive(vllm_bp)
    detector = run["tier"].bp_detector
    assert type(detector).__mro__[1].__name__ == "EMABackpressureDetector"  # vLLM's, built by its factory
    allowed = [ok for ok, _ in run["decisions"]]
    first_drop = allowed.index(False)  # late stores pushed the EMA over the high water mark: cascades dropped
    assert first_drop >= 2 and True in allowed[first_drop:], allowed  # the EMA decayed: stores resumed
    assert any(r.under_pressure and not r.pressured_after for r in run["records"]), run["records"]  # cleared
    assert run["finished"] and not run["violations"], run["violations"]  # requests finalize; invariants hold
    assert detector.policy.skipped_total == (allowed.count(False), 2 * allowed.count(False))
    assert run["tier"].journal.store_sizes == [2] * allowed.count(True)  # a dropped cascade submitted nothing


def test_the_step_clock_replays_and_is_put_back(vllm_bp):
    first, second = _drive(vllm_bp), _drive(vllm_bp)
    assert first["records"] == second["records"] and first["records"], "vLLM's detector decided differently"
    assert importlib.import_module(BACKPRESSURE_MODULE).time is time
    with pytest.raises(RuntimeError, match="fails here"):
        _drive(vllm_bp, fail_at=30)
    assert importlib.import_module(BACKPRESSURE_MODULE).time is time  # restored though the scenario raised


def test_a_clock_whose_tier_never_shut_down_is_detached_when_the_run_ends(vllm_bp):
    """A tier attached its clock and its shutdown never came (a build that failed after it, a scheduler whose
    shutdown raised first): the scenario's scope (`released_on_exit`, around every ScenarioRun) puts the real
    `time` back anyway, raising or not, and leaves a clock attached outside it alone."""
    from kvdoctor.engine.compat import step_clock

    module = importlib.import_module(BACKPRESSURE_MODULE)
    outer = step_clock.StepClock(1.0)
    with pytest.raises(RuntimeError, match="build failed"), step_clock.released_on_exit():
        step_clock.attach(step_clock.StepClock(1.0))
        assert module.time is not time
        raise RuntimeError("build failed")
    assert module.time is time
    step_clock.attach(outer)
    try:
        with step_clock.released_on_exit():
            step_clock.attach(step_clock.StepClock(2.0))
        assert module.time is not time and module.time.monotonic() == outer.now()  # the outer clock answers
    finally:
        step_clock.detach(outer)
    assert module.time is time


def test_throttled_policy_holds_every_invariant(vllm_bp):
    run = _drive(vllm_bp, "vllm:half_life=8")  # vLLM's default policy, ThrottledDropPolicy; a slower decay
    assert type(run["tier"].bp_detector.policy).__mro__[2].__name__ == "ThrottledDropPolicy"
    assert run["finished"] and not run["violations"], run["violations"]
    assert False in [ok for ok, _ in run["decisions"]], run["decisions"]


# -- each new invariant: violated on a mutated vLLM method, held on the real one (above) -----------------

def test_a_detector_whose_ema_never_decays_never_resumes(vllm_bp):
    def mutant(module, patch):
        patch.setattr(module.EMABackpressureDetector, "_apply_idle_decay", lambda self: None)

    run = _drive(vllm_bp, mutant=mutant)
    assert "tier-backpressure-resumes" in _names(run), run["violations"]


def test_a_policy_that_does_not_reset_its_counters_reports_drops_twice(vllm_bp):
    def mutant(module, patch):
        def pop(self):  # returns the counters but keeps them: every step's metrics count them again
            return self._stores_dropped, self._blocks_dropped
        patch.setattr(module.DropAccountingPolicy, "pop_stores_dropped", pop)

    run = _drive(vllm_bp, mutant=mutant)
    assert "tier-backpressure-counters-reported" in _names(run), run["violations"]


def test_the_recipe_replays_with_kvdoctor_repro(api):
    """The scenario from a recipe file (tests/data/backpressure-vllm-detector.toml): not_reproduced with its checks
    held where the probe says yes (measured on 0.34.0), not_applicable where the release has no scripted tier."""
    from pathlib import Path

    from .cli_runner import invoke

    result = invoke("repro", str(Path(__file__).resolve().parent / "data" / "backpressure-vllm-detector.toml"))
    assert result.returncode == 0, result.stdout + result.stderr
    if not (api.has_offloading_spec(TIERING) and api.has_scripted_tier() and api.has_vllm_backpressure()):
        assert "not_applicable" in result.stdout, result.stdout
        return
    assert "checks held: the last request ran to its max_tokens" in result.stdout, result.stdout
    assert "reproduced " not in result.stdout.replace("not_reproduced", ""), result.stdout
