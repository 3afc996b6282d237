"""The hunt's public explore flags (issue 35): `--target EXC:FUNCTION`, `--force FEATURE`, `--exclude-trigger`,
and findings kept apart by the path they took, not only by exception + function.

The flag checks and the path bookkeeping need no vLLM; the last test runs a bounded hunt on the installed
vLLM (a 120 s budget, one worker, the simulated worker).
"""

from __future__ import annotations

import json

import pytest

from kvdoctor.explore.findings import Finding, finding_key, merge, path_of
from kvdoctor.explore.runner import Observation
from kvdoctor.recipes.model import Recipe, Signature, Step

from .cli_runner import invoke

K1_ASSERT = "assert len(offload_keys) == len(offload_block_ids)"


@pytest.mark.parametrize(("flags", "says"), [
    (["--target", "nope"], "--target must be EXCEPTION:FUNCTION"),
    (["--target", "AssertionError:not a name"], "--target must be EXCEPTION:FUNCTION"),
    (["--force", "bogus"], "--force: unknown feature 'bogus'"),
    (["--force", "layout=nope"], "--force: unknown layout 'nope'; one of default, eagle-pair, full-swa-mixed, "
                                 "mamba-hybrid, mamba-mtp-hybrid, mamba-swa-hybrid, swa-full, swa-full-mixed\n"),
    (["--exclude-trigger", "K99"], "--exclude-trigger: 'K99' is no known bug"),
    (["--exclude-trigger", ","], "--exclude-trigger: name known bugs"),
])
def test_bad_hunt_flags_are_one_line_exit_2(flags, says):
    proc = invoke("explore", *flags, "--time-budget", "5")
    assert proc.returncode == 2 and says in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


def test_a_forced_layout_is_the_only_layout_drawn():
    """`--force layout=NAME` maps the layout field onto the forced layouts (no vLLM: the decoding alone), the
    sliding window and Mamba mode following the layout; without it, the random draw never gives the forced-only
    layouts (so a release's seeds stay as they were)."""
    import random

    from kvdoctor.explore.generate import GEOMETRY_RANGES, Example

    rng = random.Random(0)
    drawn = set()
    for _ in range(300):
        geometry = bytes(rng.randrange(256) for _ in GEOMETRY_RANGES)
        raw = (geometry, [bytes(rng.randrange(256) for _ in range(4))])
        mixed = Example.decode(raw, layouts=("swa-full-mixed", "mamba-swa-hybrid")).geometry
        assert mixed.layout in ("swa-full-mixed", "mamba-swa-hybrid") and mixed.sliding_window
        assert (mixed.mamba_cache_mode == "align") == (mixed.layout == "mamba-swa-hybrid")
        assert Example.decode(raw, layouts=(None,)).geometry.layout is None
        drawn.add(Example.decode(raw).geometry.layout)
    assert drawn == {None, "swa-full", "mamba-hybrid", "eagle-pair"}


def test_force_layout_draws_only_that_layout_through_the_search(api):
    """The search itself (vLLM's planner and scheduler, the probe of the layout) with `--force
    layout=swa-full-mixed`: every example it runs is that layout. A handful of examples (seconds)."""
    from kvdoctor.explore.search import ExploreConfig, layout_refusal, worker_search

    if layout_refusal(api, "swa-full-mixed") is not None:
        pytest.skip(f"vLLM {api.version_text} does not build swa-full-mixed: {layout_refusal(api, 'swa-full-mixed')}")
    trace: list = []
    config = ExploreConfig(seed=3, max_examples=12, time_budget=20, triage=False,
                           force=frozenset({"layout=swa-full-mixed"}))
    _, stats = worker_search(api, config, trace=trace)
    assert stats.examples > 0 and trace
    assert {recipe.setup.get("layout") for recipe, _, _ in trace} == {"swa-full-mixed"}


def _obs() -> Observation:
    return Observation(signature="AssertionError in _build_store_jobs", kind="exception", exception="AssertionError",
                       function="_build_store_jobs", code=K1_ASSERT, message=K1_ASSERT.removeprefix("assert "),
                       detail=f"scheduler.py:975: AssertionError: {K1_ASSERT}")


def _recipe(*actions: str) -> Recipe:
    steps = tuple(Step(action, {"request": "A"} if action != "schedule" else {}, 0) for action in actions)
    return Recipe("generated", "", Signature(), steps)


def _finding(path: str, steps: int) -> Finding:
    recipe = _recipe(*(["add"] + ["schedule"] * (steps - 1)))
    return Finding("AssertionError in _build_store_jobs", "exception", "", recipe, 0, 0, 0, 1, "installed", "0.26.0",
                   0, 0.5, path=path)


def test_the_path_is_the_known_trigger_the_run_went_through():
    assert path_of(_obs(), _recipe("add", "schedule", "abort", "schedule")) == "K1"
    assert path_of(_obs(), _recipe("add", "delay_block_hashes", "schedule")) == "K6"  # K6's trigger
    other = Observation(signature="AssertionError in _build_store_jobs", kind="exception", exception="AssertionError",
                        function="_build_store_jobs", code="assert job_id not in self._jobs")
    assert path_of(other, _recipe("add", "schedule")) == ""


def test_findings_of_one_site_are_kept_apart_by_path():
    kept = merge([_finding("K1", 4), _finding("K6", 5), _finding("", 7), _finding("K1", 3)])
    assert sorted((f.path, f.steps) for f in kept) == [("", 7), ("K1", 3), ("K6", 5)]
    assert finding_key("AssertionError in _build_store_jobs", "K1") == "AssertionError in _build_store_jobs via K1"
    assert kept[0].as_dict()["path"] in (None, "K1", "K6")


def test_a_hunt_with_known_triggers_excluded_keeps_none_of_their_routes(api, tmp_path):
    """0.26.0: `_build_store_jobs`' assert is reached through K1's trigger within a second of exploring; with K1's
    and K6's triggers excluded, every finding is at the target and by another path, and the runs through
    them are counted. Where the release has neither bug (measured), no run fails through their triggers."""
    from .recipe_runs import bug_present

    if not (bug_present(api, "queued-abort") or bug_present(api, "offload-keys-lag-blocks")):
        pytest.skip(f"vLLM {api.version_text} has neither K1 nor K6 (kvdoctor's measurement): no run fails "
                    f"through their triggers, so there is nothing to exclude")
    proc = invoke("explore", "--target", "AssertionError:_build_store_jobs", "--exclude-trigger", "K1,K6",
                  "--time-budget", "120", "--max-examples", "300", "--no-triage", "--out", str(tmp_path), "--json")
    doc = json.loads(proc.stdout)
    if doc["examples"] == 0:
        pytest.skip("no example ran within the budget on this machine (vLLM's import took it)")
    for finding in doc["findings"]:
        assert finding["signature"] == "AssertionError in _build_store_jobs"
        assert finding["path"] not in ("K1", "K6") and finding["known_bug"] not in ("K1", "K6")
    assert doc["excluded_runs"] > 0 or doc["findings"], doc
