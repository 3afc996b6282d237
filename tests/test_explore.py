"""`kvdoctor explore` against the real scheduler: it finds K1 where the release has it, shrinks it to a
recipe `kvdoctor repro` replays, and finds nothing K1-like under the fixed logic or on a fixed release.

One vLLM import for the module (the session `api` fixture); each search is a few seconds.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings

from kvdoctor import SCHEMA_VERSION
from kvdoctor import app as application
from kvdoctor.engine.overrides import Overrides
from kvdoctor.explore.findings import cut_at_failure
from kvdoctor.explore.generate import SETTLE_STEPS, Example, examples, to_recipe
from kvdoctor.explore.search import ExploreConfig
from kvdoctor.observe.verdict import Outcome
from kvdoctor.recipes.loader import load_recipe_text
from kvdoctor.recipes.model import Step
from kvdoctor.recipes.writer import recipe_to_toml

from .cli_runner import invoke
from .recipe_runs import bug_present

K1 = "AssertionError in _build_store_jobs"
SEED = 0
# Enough for K1 on 0.26.0 with seed 0 (found after 7 examples; K2 after 103), small enough for CI;
# the default budget (1500 examples) is what the acceptance runs of `kvdoctor explore` use.
EXAMPLES = 200


def has_k1(api) -> bool:
    """Whether the release under test carries K1, as kvdoctor measured it: queued-abort reproduces under
    the installed logic (kvdoctor/data/release_outcomes.toml; preemption and prefetch, K1's other
    recipes, measure the same). K6 (offload-keys-lag-blocks) fails the same assertion from late offload
    keys, which explore draws too: where K6 is present and K1 is not, finding that signature or not
    says nothing about K1, so the caller skips."""
    k1 = bug_present(api, "queued-abort")
    if not k1 and bug_present(api, "offload-keys-lag-blocks"):
        pytest.skip(f"vLLM {api.version_text} has K6 (offload-keys-lag-blocks reproduces) without K1: "
                    f"explore may find K6's late keys at K1's assertion")
    return k1


@pytest.fixture(scope="module")
def searches(api, tmp_path_factory):
    from kvdoctor.explore.app import explore

    runs = {}
    for logic in ("installed", "fixed"):
        out = tmp_path_factory.mktemp(f"findings-{logic}")
        config = ExploreConfig(seed=SEED, logic=logic, max_examples=EXAMPLES)
        runs[logic] = explore(config, out, api=api)
    return runs


def by_signature(report):
    return {finding.signature: finding for finding in report.findings}


def test_k1_is_found_shrunk_and_replays(searches, api):
    report = searches["installed"]
    findings = by_signature(report)
    if not has_k1(api):
        assert K1 not in findings, findings[K1].detail if K1 in findings else ""
        return
    assert K1 in findings, f"explore found {sorted(findings)} but not K1"
    # the assert can come by several paths (K6's late keys too, kept apart since the hunt's path keys):
    # K1's own route is the one its fix prevents
    finding = next((f for f in report.findings if f.signature == K1 and f.path == "K1"), findings[K1])
    assert finding.steps <= 6
    assert "len(offload_keys) == len(offload_block_ids)" in finding.detail
    path = Path(finding.file)
    text = path.read_text(encoding="utf-8")
    assert text.startswith("# Found by kvdoctor explore: seed 0")
    assert "--seed 0" in finding.recipe.summary
    replay = application.repro(str(path), Overrides(), "all")
    outcomes = {r.logic: r.outcome for r in replay.results}
    assert outcomes["installed"] is Outcome.REPRODUCED
    assert outcomes["unpatched"] is Outcome.REPRODUCED
    # the fixed logic's cap keeps the shrunk run off the assert (not_reached, exit 6), or it holds there
    assert outcomes["fixed"] in (Outcome.NOT_REPRODUCED, Outcome.NOT_REACHED)


def test_nothing_k1_like_under_the_fixed_logic_but_k6s_late_keys(api, searches):
    """K1's fix caps stores by allocated chunks; K6 (the same assert) is late offload keys, which that
    cap does not bound: under the fixed logic a `_build_store_jobs` finding is K6's, made of drawn hash
    delays, and the same steps without the delays run through."""
    import dataclasses

    from kvdoctor.explore.runner import observe

    for signature, finding in by_signature(searches["fixed"]).items():
        if "_build_store_jobs" not in signature:
            continue
        actions = [step.action for step in finding.recipe.steps]
        assert "delay_block_hashes" in actions, (signature, actions)
        on_time = tuple(s for s in finding.recipe.steps if not s.action.endswith("_block_hashes"))
        assert observe(api, dataclasses.replace(finding.recipe, steps=on_time), "fixed").signature != signature


def test_every_finding_replays_with_its_signature(searches):
    """Whatever else explore found, its recipe reproduces it (exit 1) under the logic it was found with,
    replayed as `kvdoctor repro FILE` does (whose default worker is vLLM's: the file names the simulated
    worker it was found with)."""
    from kvdoctor.cli.options import DEFAULT_WORKER

    for logic, report in searches.items():
        for finding in report.findings:
            if finding.kind not in ("exception", "invariant"):
                continue
            assert finding.recipe.setup["worker"] == "simulated"
            replay = application.repro(finding.file, Overrides(), logic, default_worker=DEFAULT_WORKER).results[0]
            if replay.failure is not None and replay.failure_step == 0:
                # A start-up refusal (triaged as such: no step sequence): repro reports vLLM's failure
                # to build the scheduler, the same exception, as other_failure.
                assert replay.outcome is Outcome.OTHER_FAILURE and finding.signature in replay.detail, (
                    finding.signature, replay.detail)
                continue
            assert replay.outcome is Outcome.REPRODUCED, (finding.signature, replay.detail)


def test_same_seed_same_findings(api, tmp_path):
    from kvdoctor.explore.app import explore

    # ended by its examples, never by the clock: a run that hit the default 30 s budget on a loaded machine shrank
    # less than its twin (measured: 881 against 988 shrink examples, elapsed 30.0 s against 15.5 s, in a suite)
    config = ExploreConfig(seed=3, logic="installed", max_examples=50, time_budget=600.0)
    first = explore(config, tmp_path / "first", api=api)
    again = explore(config, tmp_path / "again", api=api)
    assert [(f.signature, f.steps) for f in again.findings] == [(f.signature, f.steps) for f in first.findings]
    assert first.result.stats.scheduler_steps == again.result.stats.scheduler_steps
    for f, g in zip(first.findings, again.findings, strict=True):
        assert Path(f.file).read_text() == Path(g.file).read_text()


def test_cli_json(api, tmp_path):
    k1 = has_k1(api)

    # seed 1, 100: K1 comes after 40 examples there (measured on 0.26.0 with the bytes draws)
    result = invoke("explore", "--seed", "1", "--max-examples", "100", "--json", "--out", str(tmp_path))
    document = json.loads(result.stdout)
    assert document["schema_version"] == SCHEMA_VERSION
    assert document["logic"] == "installed" and document["seed"] == 1
    assert document["examples"] == 100
    for finding in document["findings"]:
        assert set(finding) >= {"signature", "file", "steps", "seed"}
        assert Path(finding["file"]).is_file()
    signatures = [f["signature"] for f in document["findings"]]
    assert result.returncode == (1 if signatures else 0)
    assert (K1 in signatures) == k1


def test_cli_usage_errors(tmp_path):
    for args in (["--logic", "all"], ["--max-examples", "0"], ["--time-budget", "0"], ["--workers", "0"]):
        result = invoke("explore", *args, "--out", str(tmp_path))
        assert result.returncode == 2, (args, result.stdout, result.stderr)
        assert "kvdoctor: error:" in result.stderr


def test_explore_command_imports_nothing_heavy():
    code = ("import sys, kvdoctor.cli.explore_cmd; "
            "print('vllm' in sys.modules, 'torch' in sys.modules, 'hypothesis' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False", "False"]


def test_settle_tail_releases_finished_requests(api):
    """The end-of-run check sees no leak where every transfer drains (and counts engine steps)."""
    from kvdoctor.explore.generate import Geometry
    from kvdoctor.explore.runner import observe

    events = (("add", ("tokens", 10), 2, None), ("hold", None, "store"), ("schedule", 3),
              ("add", ("chunks", 2), 4, (0, 1)), ("schedule", 1), ("finish", 1))
    for is_async in (False, True):
        recipe = to_recipe(Example(Geometry(4, 1, 16, 16, 256, is_async), events))
        obs = observe(api, recipe, "fixed")
        assert obs.signature is None, obs.detail
        assert obs.scheduler_steps == 3 + 1 + 1 + SETTLE_STEPS


# -- no vLLM below: the generator and the recipe cut ------------------------------------------

def test_every_field_value_is_drawable_and_zero_stays_simplest():
    """A drawn byte reads as its field scaled to the field's range: every value of every geometry
    field and every event row is reachable, byte 0 reads as 0 (the simplest choice), and a smaller
    byte never reads as a larger value (so shrinking a byte simplifies its field)."""
    from kvdoctor.explore.generate import EVENT_TABLE, GEOMETRY_RANGES, event_fields, geometry_fields, scaled

    for n in (*GEOMETRY_RANGES, len(EVENT_TABLE)):
        values = [scaled(byte, n) for byte in range(256)]
        assert set(values) == set(range(n)) and values[0] == 0 and values == sorted(values)
    assert geometry_fields(bytes(len(GEOMETRY_RANGES))) == (0,) * len(GEOMETRY_RANGES)
    assert event_fields(bytes([255, 1, 2, 3])) == (len(EVENT_TABLE) - 1, 1, 2, 3)


@settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(examples(24))
def test_generated_sequences_are_valid_recipes(raw):
    """Every drawn example is a recipe the loader accepts (requests added before use, sizes in range)."""
    example = Example.decode(raw)
    recipe = to_recipe(example)
    loaded = load_recipe_text(recipe_to_toml(recipe), "generated.toml")
    assert [s.action for s in loaded.steps][-3:] == ["schedule", "complete_transfers", "schedule"]
    mml = example.geometry.max_model_len
    for step in loaded.steps:
        if step.action == "add":
            args = step.args
            length = (args.get("prompt_tokens") or args.get("prompt_chunks", 0) * example.geometry.chunk_tokens
                      or (example.geometry.gpu_blocks - 2) * example.geometry.block_size)
            assert length >= 1 and length + args["max_tokens"] <= mml


def test_cut_at_failure_keeps_the_repeats_up_to_the_failing_one():
    steps = (Step("add", {"request": "A", "prompt_tokens": 3}, 0), Step("schedule", {"count": 5}, 0),
             Step("abort", {"request": "A"}, 0), Step("schedule", {}, 0))
    assert cut_at_failure(steps, 3) == (*steps[:1], Step("schedule", {"count": 2}, 0))
    assert cut_at_failure(steps, 2) == (*steps[:1], Step("schedule", {}, 0))
    assert cut_at_failure(steps, 8) == steps


def test_every_finding_kind_writes_a_loadable_recipe():
    from kvdoctor.explore.findings import finding_recipe
    from kvdoctor.explore.generate import Geometry
    from kvdoctor.explore.runner import Observation

    recipe = to_recipe(Example(Geometry(4, 1, 8, 16, 256, False), (("add", ("tokens", 9), 2, None),
                                                                   ("schedule", 2), ("abort", 0))))
    observations = [
        Observation("AssertionError in f", "exception", "x.py:1: assert a", "AssertionError", "f", "assert a",
                    failure_index=3),
        Observation("invariant no-orphan-transfer-jobs", "invariant", "job #1", invariant="no-orphan-transfer-jobs",
                    failure_index=2),
        Observation("check finished-requests-released", "check", "A leaked", invariant="finished-requests-released",
                    leaked=["A"]),
        Observation("kvdoctor KeyError in step", "harness", "harness.py:3: x", "KeyError", "step", failure_index=4),
    ]
    for obs in observations:
        written = finding_recipe(recipe, obs, "summary\nline two")
        loaded = load_recipe_text(recipe_to_toml(written), "finding.toml")
        assert loaded.title == obs.signature and loaded.summary.startswith("summary\nline two\nImpact: ")
        if obs.kind == "check":
            assert loaded.steps == tuple(Step(s.action, s.args, loaded.steps[i].line)
                                         for i, s in enumerate(recipe.steps))
            assert [c.args["connector_state"] for c in loaded.checks] == ["released"]
        else:
            assert len(loaded.steps) <= len(recipe.steps)
        if obs.kind == "invariant":
            assert loaded.signature.invariant == "no-orphan-transfer-jobs"


def test_a_shared_assert_is_labelled_by_the_findings_trigger():
    """K1 and K6 fire the same assert in `_build_store_jobs`; a finding that withholds block hashes
    is K6's (its offload keys lag its blocks), one that does not is K1's."""
    from kvdoctor.explore.findings import known_bug
    from kvdoctor.recipes.model import Signature

    signature = Signature(exception="AssertionError", function="_build_store_jobs",
                          contains="len(offload_keys) == len(offload_block_ids)")
    assert known_bug(signature)[0] == "K1"
    assert known_bug(signature, actions=frozenset({"add", "schedule", "abort"}))[0] == "K1"
    bug, recipes = known_bug(signature, actions=frozenset({"add", "delay_block_hashes", "schedule"}))
    assert (bug, recipes) == ("K6", ("offload-keys-lag-blocks",))


def test_the_seed_alone_names_the_draws():
    """Inside the search Hypothesis draws from no constants mined from loaded modules (they made one seed
    find K2 alone and not inside the test suite); the swap is scoped and undone even when the search
    raises."""
    from hypothesis.internal.conjecture import providers

    from kvdoctor.explore.search import draws_named_by_seed

    original = providers._get_local_constants
    with pytest.raises(RuntimeError, match="stop"), draws_named_by_seed():
        assert providers._get_local_constants is not original
        assert len(providers._get_local_constants()) == 0
        raise RuntimeError("stop")
    assert providers._get_local_constants is original


@settings(max_examples=40, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(raw=examples(16))
def test_build_cache_changes_no_outcome(api, raw):
    """explore reuses a setup's VllmConfig and KV cache plan across runs (BuildCache): a run on reused
    pieces (its second build of the setup, after one run on them) ends exactly as a run on fresh ones."""
    from kvdoctor.engine.harness import BuildCache
    from kvdoctor.errors import UsageError
    from kvdoctor.explore.runner import InvalidExample, setup_of
    from kvdoctor.levels.scheduler import run_scenario
    from kvdoctor.observe.invariants import INVARIANTS

    recipe = to_recipe(Example.decode(raw))
    try:
        setup = setup_of(recipe)
    except InvalidExample:
        return
    cache = BuildCache()

    def outcome(build_cache):
        result = run_scenario(api, recipe, setup, "installed", extra_invariants=tuple(INVARIANTS),
                              build_cache=build_cache)
        failure = result.failure
        return (result.outcome, result.failure_step, failure and (failure.exception, failure.function),
                [v.invariant for v in result.violations], result.kv_plan and result.kv_plan.notes)

    try:
        fresh = outcome(None)
    except UsageError:  # vLLM refused the geometry: nothing built, nothing cached
        return
    outcome(cache)
    assert outcome(cache) == fresh
    assert cache.hits == 1 or fresh[1] == 0  # failure_step 0: vLLM failed while building (nothing cached)
