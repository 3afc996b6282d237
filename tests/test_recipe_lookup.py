"""K6 at the lookup (`withheld-hashes-lookup`): a re-admitted request whose block hashes lag its tokens
trips the offloading scheduler's lookup assert. One vLLM import and one run (every logic) for the module.

Outcomes and crash-site coverage per release are kvdoctor's measurements in
kvdoctor/data/release_outcomes.toml (reproduced in `_lookup` on 0.26.0-0.27.1 and in
`_lookup_complete_chunks` on 0.28.0-0.33.0; on 0.34.0 the assert bounds the keys by the block hashes
delivered, so the recipe's statement is gone); a release not measured there skips. Explore found this
assert on 0.26.0 (`kvdoctor explore --seed 1 --time-budget 120`, shrunk to 5 steps); its labeller must
name it K6 by this recipe, under either function name, and only on K6's path (withheld hashes).
"""

from __future__ import annotations

import pytest

from kvdoctor.engine.overrides import Overrides
from kvdoctor.errors import RecipeError
from kvdoctor.explore.findings import known_bug
from kvdoctor.matrix.data import coverage_class
from kvdoctor.observe.verdict import Outcome
from kvdoctor.recipes.builtins import load_builtin
from kvdoctor.recipes.loader import load_recipe_file
from kvdoctor.recipes.model import Signature
from kvdoctor.recipes.writer import recipe_to_toml

from .recipe_runs import LOGICS, measured, measured_row

NAME = "withheld-hashes-lookup"
ASSERT = "(len(offload_keys) >= req_status.req.num_tokens // tokens_per_chunk)"


def test_recipe_states_its_trigger():
    recipe = load_builtin(NAME)
    sig = recipe.signature
    assert recipe.bug == "K6" and any("52170" in ref for ref in recipe.refs)
    assert (sig.exception, sig.function, sig.function_aliases) == ("AssertionError", "_lookup",
                                                                   ("_lookup_complete_chunks",))
    assert sig.contains in ASSERT and sig.crash_site() == ("_lookup", sig.contains)
    actions = [step.action for step in recipe.steps]
    assert actions.index("delay_block_hashes") < actions.index("reset_prefix_cache") < actions.index(
        "release_block_hashes")
    assert recipe.setup["enable_prefix_caching"] is False


# -- explore's labeller on the shrunk finding's signature (no vLLM run) --------------------------------------

# explore's shrunk finding on 0.26.0 (seed 1): A (15 tokens, 4-token blocks) with its hashes withheld,
# one step, a reset that preempts it, and its re-admission.
FINDING_SETUP = {"block_size": 4, "blocks_per_chunk": 1, "gpu_blocks": 6, "enable_prefix_caching": False}
FINDING_ACTIONS = frozenset({"add", "delay_block_hashes", "schedule", "reset_prefix_cache"})


@pytest.mark.parametrize("function", ["_lookup", "_lookup_complete_chunks"])
def test_explore_labels_the_lookup_assert_k6_by_this_recipe(function):
    found = Signature(exception="AssertionError", function=function, contains=ASSERT)
    detail = (f"vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py:582: AssertionError: "
              f"assert {ASSERT}")
    assert known_bug(found, actions=FINDING_ACTIONS, setup=FINDING_SETUP, detail=detail) == ("K6", (NAME,))


def test_explore_does_not_label_the_lookup_assert_off_k6s_path():
    """The same assert without withheld block hashes is another mechanism: a candidate, not K6."""
    found = Signature(exception="AssertionError", function="_lookup", contains=ASSERT)
    assert known_bug(found, actions=FINDING_ACTIONS - {"delay_block_hashes"}, setup=FINDING_SETUP,
                     detail="scheduler.py:582: AssertionError") is None


def test_store_side_assert_stays_k6_with_withheld_hashes_and_k1_without():
    store = Signature(exception="AssertionError", function="_build_store_jobs",
                      contains="len(offload_keys) == len(offload_block_ids)")
    assert known_bug(store, actions=frozenset({"add", "delay_block_hashes", "schedule"}), setup={},
                     detail="x")[0] == "K6"
    assert known_bug(store, actions=frozenset({"add", "schedule", "abort"}), setup={}, detail="x")[0] == "K1"


def test_function_aliases_round_trip_and_refuse_a_bad_name(tmp_path):
    recipe = load_builtin(NAME)
    path = tmp_path / "again.toml"
    path.write_text(recipe_to_toml(recipe))
    assert load_recipe_file(path).signature.function_aliases == ("_lookup_complete_chunks",)
    bad = tmp_path / "bad.toml"
    bad.write_text(path.read_text().replace('function_aliases = ["_lookup_complete_chunks"]',
                                            'function_aliases = ["not a name"]'))
    with pytest.raises(RecipeError, match="function_aliases entries must be function names"):
        load_recipe_file(bad)


# -- the run on the installed vLLM ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def report(api):
    from kvdoctor import app

    return app.repro(NAME, Overrides(), "all")


def result(report, logic):
    return next(r for r in report.results if r.logic == logic)


@pytest.mark.vllm
@pytest.mark.parametrize("logic", LOGICS)
def test_outcome(report, api, logic):
    run = result(report, logic)
    want = measured(api, NAME, logic)
    assert run.outcome is want, f"{logic}: {run.outcome.value} ({run.detail}), expected {want.value}"
    if want is Outcome.REPRODUCED:
        failure = run.failure
        assert failure.function in ("_lookup", "_lookup_complete_chunks"), failure.where()
        assert "num_tokens // tokens_per_chunk" in (failure.code or "") + failure.message
        assert "get_num_new_matched_tokens" in [frame.function for frame in failure.vllm_frames]


@pytest.mark.vllm
def test_crash_site_coverage(report, api):
    """Where the assert is (under either name) the run reached it; where it fired or held is measured."""
    want = measured_row(api, NAME).coverage_class
    if want is None:
        pytest.skip(f"no crash-site coverage of {NAME} measured on vLLM {api.version_text}")
    coverage = result(report, "installed").coverage
    assert coverage is not None and coverage_class(coverage.line()) == want, coverage and coverage.line()
