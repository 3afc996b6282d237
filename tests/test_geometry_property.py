"""Built-in recipes at geometries drawn at random: never a setup_error.

On a release that carries a recipe's bug (K1, K2, K4, K8: the recipe reproduces
at its own geometry, as kvdoctor/data/release_outcomes.toml measured) the recipe
either reproduces at the drawn geometry or says before running why the user's
flags make its trigger impossible there (`untested`, naming the flag that
prevents it and the smallest change that allows it; never an exit-0 verdict).
On a release with the fix it never reproduces. Each example builds one
harness per recipe; the number of examples is kept small so a release costs
well under two minutes here.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from kvdoctor.engine.overrides import Overrides
from kvdoctor.recipes.builtins import all_builtins
from kvdoctor.resolution import resolve_setup
from tests.recipe_runs import bug_present

pytestmark = pytest.mark.vllm

BUGS = ("K1", "K2", "K4", "K8")


@st.composite
def geometries(draw) -> dict:
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128]))
    blocks_per_chunk = draw(st.sampled_from([1, 2, 4, 8, 16]))
    gpu_blocks = draw(st.integers(8, 100_000))
    chunked = draw(st.booleans())
    max_model_len = draw(st.sampled_from([256, 1024, 4096, 32768, 131072]))
    max_num_seqs = draw(st.sampled_from([1, 4, 16, 64, 256]))
    budget = draw(st.sampled_from([8, 64, 256, 2048, 8192]))
    budget = max(budget, max_num_seqs)
    if not chunked:
        budget = max(budget, max_model_len)  # vLLM requires it without chunked prefill
    return dict(block_size=block_size, blocks_per_chunk=blocks_per_chunk, gpu_blocks=gpu_blocks,
                enable_chunked_prefill=chunked, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                max_num_batched_tokens=budget, async_scheduling=draw(st.booleans()))


@pytest.fixture(scope="module")
def recipes():
    return [r for r in all_builtins() if r.bug in BUGS]


@pytest.fixture(scope="module")
def expectation(api, recipes) -> dict[str, str]:
    """Per recipe, what every drawn geometry must show on this release (the bug measured present or not)."""
    return {r.name: "reproduced_or_untested" if bug_present(api, r.name) else "never_reproduced" for r in recipes}


# No shrinking: a failure names its geometry already, and shrinking would multiply the cost.
@settings(max_examples=6, deadline=None, derandomize=True, phases=(Phase.explicit, Phase.generate),
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@example(geometry=dict(block_size=16, blocks_per_chunk=1, gpu_blocks=512, enable_chunked_prefill=True,
                       max_model_len=256, max_num_seqs=64, max_num_batched_tokens=2048, async_scheduling=True))
# Found by this test at 60 examples on 0.26.0: at block size 1, K4's final store crashed instead (other_failure).
@example(geometry=dict(block_size=1, blocks_per_chunk=2, gpu_blocks=512, enable_chunked_prefill=False,
                       max_model_len=1024, max_num_seqs=256, max_num_batched_tokens=2048, async_scheduling=False))
@given(geometry=geometries())
def test_recipes_hold_at_any_geometry(api, recipes, expectation, geometry):
    from kvdoctor.levels.runners import runner


    run_scenario = runner("scheduler").judged_run  # as repro runs it: a broken measured reason judged
    outcomes = {}
    for recipe in recipes:
        setup = resolve_setup(recipe, Overrides(**geometry))
        result = run_scenario(api, recipe, setup, "installed")
        outcomes[recipe.name] = (result.outcome.value, result.detail)
    for name, (outcome, detail) in outcomes.items():
        assert outcome not in ("setup_error", "other_failure"), (name, geometry, outcome, detail)
        if outcome == "untested":  # every flag here is the user's: the reason names the one that prevents it
            assert "prevents it; the smallest change that allows it: " in detail, (name, geometry, detail)
        assert outcome != "not_applicable", (name, geometry, outcome, detail)  # 0.26+ has every feature
        if expectation[name] == "reproduced_or_untested":
            assert outcome in ("reproduced", "untested"), (name, geometry, outcome, detail)
        else:
            assert outcome != "reproduced", (name, geometry, outcome, detail)
