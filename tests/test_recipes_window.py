"""The sliding-window recipes (K3, K12) on vLLM's real scheduler, under every logic variant.

One vLLM import and one run per recipe for the module (sync scheduling: the recipe's steps are
counted for it). Outcomes and crash-site coverage per release are kvdoctor's measurements in
kvdoctor/data/release_outcomes.toml; a release or dimension not measured there skips.
"""

from __future__ import annotations

import pytest

from kvdoctor import app
from kvdoctor.engine.overrides import Overrides
from kvdoctor.matrix.data import coverage_class
from kvdoctor.observe.verdict import Outcome
from kvdoctor.recipes.builtins import load_builtin

from .recipe_runs import measured, measured_row

pytestmark = pytest.mark.vllm

K3 = "swa-unaligned-pending-bound"
K12 = "swa-unaligned-hit-missing-chunk"
LOGICS = ("installed", "fixed", "unpatched")
R, N = Outcome.REPRODUCED, Outcome.NOT_REPRODUCED


# What the data file holds for these recipes (measured 2026-12-03/04 on every release). K3: reproduced on
# 0.26.0, where the bound is sliding_window_size_in_chunks * blocks_per_chunk; from 0.27.0 PR #49052 (bound
# + 1) holds: B loads its 160-token hit and runs. On 0.34.0 B's hit differs (see the recipe's summary), but
# the run still reaches K3's case at the crash site and the fixed bound holds. K12: reproduced on 0.26.0 ...
# 0.29.0, 'Block ... not found in cache' in prepare_load; on 0.30.0 (PR #55712, initial_window_size) the
# assertion is still there but the run never executes it (not_reached, not evidence of a fix); from 0.31.0
# the assertion is gone from the source (not_reproduced, said as "site gone"). `fixed` (the PR #49146
# store cap) touches neither the load path nor the lookup: it ends as `installed` does.


@pytest.fixture(scope="module")
def reports(api):
    return {name: app.repro(name, Overrides(), "all", record_timeline=True) for name in (K3, K12)}


def result(reports, name, logic):
    return next(r for r in reports[name].results if r.logic == logic)


def test_k3_recipe_states_its_trigger():
    recipe = load_builtin(K3)
    assert recipe.bug == "K3" and any("49052" in ref for ref in recipe.refs)
    assert recipe.setup["layout"] == "swa-full-mixed" and recipe.setup["blocks_per_chunk"] == 2
    assert (recipe.signature.exception, recipe.signature.function) == ("AssertionError", "update_state_after_alloc")


def test_k3_layout_has_mixed_granularity(reports):
    """The planner gave the two groups different block sizes (64-token sliding-window blocks)."""
    plan = result(reports, K3, "installed").kv_plan
    assert sorted((g.kind, g.block_size) for g in plan.groups) == [("full_attention", 16), ("sliding_window", 64)]


def test_k12_recipe_states_its_trigger():
    recipe = load_builtin(K12)
    assert recipe.bug == "K12" and any("54914" in ref for ref in recipe.refs)
    assert any("55712" in ref for ref in recipe.refs)
    assert (recipe.signature.exception, recipe.signature.function) == ("AssertionError", "prepare_load")



def test_k3_crash_site_coverage(reports, api):
    """What the installed logic's K3 run did at its crash site (the pending-block bound with one block more
    than sliding_window_size_in_chunks * blocks_per_chunk), as measured on this release."""
    want = measured_row(api, K3).coverage_class
    if want is None:
        pytest.skip(f"no crash-site coverage of {K3} measured on vLLM {api.version_text}")
    coverage = result(reports, K3, "installed").coverage
    assert coverage is not None and coverage_class(coverage.line()) == want, coverage and coverage.line()
    if want == "held":
        assert coverage.closest == "3 <= 3" and coverage.margin == 0  # K3's case, at the fixed bound's edge


def _k3_failure(failure):
    assert "num_pending_gpu_blocks" in ((failure.code or "") + failure.message)


def _k12_failure(failure):
    assert "not found in cache" in failure.message
    assert "update_state_after_alloc" in " ".join(frame.function for frame in failure.vllm_frames)


# What a reproduced run's failure must show, per recipe.
FAILURE_CHECKS = {K3: _k3_failure, K12: _k12_failure}


@pytest.mark.parametrize("logic", LOGICS)
@pytest.mark.parametrize("name", (K3, K12))
def test_outcome(reports, api, name, logic):
    run = result(reports, name, logic)
    want = measured(api, name, logic)
    assert run.outcome is want, f"{name} {logic}: {run.outcome.value} ({run.detail}), expected {want.value}"
    if want is R:
        FAILURE_CHECKS[name](run.failure)
