"""The Mamba "align" recipes (K7) on vLLM's real scheduler: the mid-block hit under every logic variant
and both scheduling modes, and the `prefix_match_unit` setup key it needs; the diverged hit on a Mamba +
sliding-window hybrid (mamba-swa-diverged-hit-load), against the measured release table.

One vLLM import and one `repro --logic all` per scheduling mode for the module. Outcomes per
release are kvdoctor's measurements (kvdoctor/data/release_outcomes.toml); a release or a
dimension not measured there skips.
"""

from __future__ import annotations

import pytest

from kvdoctor import app
from kvdoctor.engine.overrides import Overrides
from kvdoctor.engine.setup import Setup
from kvdoctor.errors import RecipeError, UsageError
from kvdoctor.matrix import data
from kvdoctor.matrix.data import coverage_class
from kvdoctor.observe.verdict import Outcome
from kvdoctor.recipes import requirements
from kvdoctor.recipes.builtins import load_builtin
from kvdoctor.recipes.loader import load_recipe_text

from .recipe_runs import measured, measured_row

K7 = "mamba-align-midblock-hit-load"
K7_DIVERGED = "mamba-swa-diverged-hit-load"
LOGICS = ("installed", "fixed", "unpatched")
MODES = (False, True)
R, N = Outcome.REPRODUCED, Outcome.NOT_REPRODUCED


# Expected outcomes are kvdoctor's measurements of the K7 recipes in kvdoctor/data/release_outcomes.toml
# (`kvdoctor matrix --audit`: installed and fixed logic, sync and --async-scheduling; `unpatched` is
# compared with the installed measurement, see recipe_runs.measured). The audit runs K7 with the
# simulated worker (vLLM's refuses a Mamba layout), as `app.repro` here does. `fixed` (the PR #49146
# store cap) does not touch the load path, so the measured logics agree on every release; what each
# release does at K7's crash site (update_state_after_alloc's load-boundary assertion, with a local hit
# ending inside a block) is the row's coverage: 0.26.0 reaches it and the assertion fires (B hits 80
# tokens locally: the attention group's block 1 is the unhashed copy-on-write block, so
# update_state_after_alloc asserts 80 <= 1 * 64); on 0.27.0-0.29.0 the scan and its assertion are still
# there but B's local hit is block-aligned (64 tokens), so the run never reaches K7's case: not_reached,
# never "fixed"; from 0.30.0 the assertion is gone from the installed source (PR #52807): the connector
# is asked from the 64-token block boundary (on 0.30.0 B finds no CPU hit, on 0.34.0 it loads 176 tokens).


# -- without vLLM: the setup key and the requirement form ---------------------------------------

def test_k7_recipe_states_its_trigger():
    recipe = load_builtin(K7)
    assert recipe.bug == "K7" and any("52807" in ref for ref in recipe.refs)
    assert any("43884" in ref for ref in recipe.refs)
    assert recipe.setup["layout"] == "mamba-hybrid" and recipe.setup["mamba_cache_mode"] == "align"
    assert (recipe.setup["block_size"], recipe.setup["prefix_match_unit"]) == (64, 16)
    assert set(recipe.requires) == {"setup:own_geometry", "cache_config_field:prefix_match_unit"}
    assert (recipe.signature.exception, recipe.signature.function) == ("AssertionError", "update_state_after_alloc")
    assert recipe.signature.callers == ("schedule",)


def test_k7_diverged_recipe_states_its_trigger():
    recipe = load_builtin(K7_DIVERGED)
    assert recipe.bug == "K7" and any("52807" in ref for ref in recipe.refs)
    assert recipe.setup["layout"] == "mamba-swa-hybrid" and recipe.setup["mamba_cache_mode"] == "align"
    assert (recipe.setup["block_size"], recipe.setup["blocks_per_chunk"], recipe.setup["gpu_blocks"]) == (64, 1, 14)
    assert recipe.requires == ("setup:own_geometry",)
    assert recipe.signature.crash_site() == ("update_state_after_alloc", "num_locally_computed_tokens <= "
                                             "num_locally_computed_gpu_blocks * tokens_per_block")
    # the summary says why no path reaches K7's case where the run ends not_reached
    assert "supports_divergent_local_hybrid_hits" in recipe.summary


def test_k7_counts_fixed_only_where_every_recipe_earned_it():
    """K7 reproduces on 0.26.0-0.27.0 (by one recipe or the other): audit's upgrade hint names a release as
    fixing K7 only where both K7 recipes reached the scan and held, or the scan is gone there; a release
    where either run ended not_reached is never that release."""
    from kvdoctor.matrix.known import upgrade_hint

    rows = data.load()
    k7 = {name: {r.release: r for r in rows if r.recipe == name} for name in (K7, K7_DIVERGED)}
    if not all(k7.values()):
        pytest.skip("the release table holds no K7 measurements")
    for installed in sorted({r.release for r in rows if r.bug == "K7" and r.outcome == "reproduced"}):
        hint = upgrade_hint({"K7": [K7, K7_DIVERGED]}, installed)
        if hint is None or "K7" in hint.still_reproducing:
            continue
        assert all(k7[name][hint.release].earns_fixed for name in k7), (installed, hint)


_BASE = """[recipe]
name = "x"
summary = "x"
[setup]
layout = "mamba-hybrid"
prefix_match_unit = {value}
[signature]
exception = "AssertionError"
function = "f"
[[step]]
action = "schedule"
"""


def test_prefix_match_unit_loads_as_a_setup_key():
    recipe = load_recipe_text(_BASE.format(value=16), "x.toml")
    assert recipe.setup["prefix_match_unit"] == 16


@pytest.mark.parametrize("value, message", [
    ("0", "x.toml:6: [setup] prefix_match_unit must be a positive integer, got 0"),
    ('"16"', "x.toml:6: [setup] prefix_match_unit must be an integer"),
    ("true", "x.toml:6: [setup] prefix_match_unit must be an integer"),
])
def test_prefix_match_unit_is_checked_with_its_line(value, message):
    with pytest.raises(RecipeError) as info:
        load_recipe_text(_BASE.format(value=value), "x.toml")
    assert str(info.value).startswith(message), str(info.value)


@pytest.mark.parametrize("value", [0, -16, True, "16"])
def test_setup_refuses_a_bad_prefix_match_unit(value):
    with pytest.raises(UsageError, match="prefix_match_unit must be a positive integer"):
        Setup(prefix_match_unit=value).validate()


def test_cache_config_field_requirement_is_judged_by_the_adapter():
    assert requirements.is_known_requirement("cache_config_field:prefix_match_unit")
    assert not requirements.is_known_requirement("cache_config_field:")

    class NoField:
        def cache_config_has_field(self, name):
            return False

    assert requirements.missing(NoField(), ("cache_config_field:prefix_match_unit",)) == [
        "this vLLM's CacheConfig has no field 'prefix_match_unit'"]


# -- on the installed vLLM ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def reports(api):
    return {mode: app.repro(K7, Overrides(async_scheduling=mode), "all", record_timeline=True) for mode in MODES}


def result(reports, mode, logic):
    return next(r for r in reports[mode].results if r.logic == logic)


@pytest.mark.vllm
def test_k7_layout_hashes_finer_than_its_blocks(reports):
    """vLLM's planner made a Mamba align group and an attention group of 64-token blocks, hashed every 16."""
    plan = result(reports, False, "installed").kv_plan
    assert sorted((g.kind, g.block_size) for g in plan.groups) == [("full_attention", 64), ("mamba", 64)]
    assert [g.mamba_cache_mode for g in plan.groups if g.kind == "mamba"] == ["align"]
    assert plan.hash_block_size == 16


@pytest.mark.vllm
@pytest.mark.parametrize("mode", MODES, ids=("sync", "async"))
@pytest.mark.parametrize("logic", LOGICS)
def test_k7_outcome(reports, api, mode, logic):
    run = result(reports, mode, logic)
    want = measured(api, K7, logic, mode)
    assert run.outcome is want, f"{K7} {logic} async={mode}: {run.outcome.value} ({run.detail}), expected {want.value}"
    if want is R:
        assert run.failure.function == "update_state_after_alloc"
        assert "num_locally_computed_tokens" in ((run.failure.code or "") + run.failure.message)


@pytest.mark.vllm
def test_k7_crash_site_coverage(reports, api):
    """K7 reproduces only where its run reached the assertion in K7's case; where it does not reproduce,
    the run reached the site and it held, or the site is gone, or the outcome says not_reached."""
    want = measured_row(api, K7).coverage_class
    run = result(reports, False, "installed")
    coverage = run.coverage
    assert coverage is not None and coverage.function == "update_state_after_alloc"
    assert coverage_class(coverage.line()) == want, coverage.line()
    if want == "fired":
        assert run.outcome is R and coverage.reached and coverage.closest == "80 <= 64"
    elif want == "not_reached":
        assert run.outcome is Outcome.NOT_REACHED and run.detail.startswith("not reached: ")
        assert "num_locally_computed_tokens % tokens_per_block != 0" in run.detail
    else:
        assert run.outcome is N and run.detail.startswith("site gone: ") and "update_state_after_alloc" in run.detail


@pytest.mark.vllm
def test_k7_with_vllms_worker_is_refused_in_one_line(api):
    """The toy model writes attention KV only: a shipped Mamba layout is refused from its config.json,
    before vLLM is imported (on 0.26.0 vLLM's register_kv_caches asserted first: other_failure)."""
    with pytest.raises(UsageError, match="layout mamba-hybrid has a Mamba layer, and kvdoctor's toy model writes "
                                         "attention KV only"):
        app.repro(K7, Overrides(worker="vllm", device="cpu"), "installed")


# -- the diverged hit (mamba-swa-diverged-hit-load): one run, checked against the measured table ------

@pytest.fixture(scope="module")
def diverged(api):
    return app.repro(K7_DIVERGED, Overrides(), "installed").results[0]


@pytest.mark.vllm
def test_k7_diverged_hit_matches_the_release_table(diverged, api):
    """The run ends as kvdoctor measured it on this release (outcome and what it did at the scan): where it
    reproduces, the sliding-window group's fresh block below the 256-token mark fired the assertion."""
    rows = [r for r in data.load() if r.release == api.version_text and r.recipe == K7_DIVERGED]
    if not rows:
        pytest.skip(f"kvdoctor/data/release_outcomes.toml has no {K7_DIVERGED} row for vLLM {api.version_text}")
    row, run = rows[0], diverged
    assert run.outcome.value == row.outcome, f"{run.outcome.value} ({run.detail}), measured {row.outcome}"
    assert run.coverage is not None and coverage_class(run.coverage.line()) == row.coverage_class, run.coverage.line()
    if run.outcome is R:
        assert run.failure.function == "update_state_after_alloc"
        assert run.coverage.closest == "256 <= 192"  # index 3 of the sliding-window group, below 256
    elif run.outcome is Outcome.NOT_REACHED:
        assert "sliding_window_size_in_chunks is not None" in run.detail
    else:
        assert run.outcome is N and run.detail.startswith(("site gone: ", "reached "))
