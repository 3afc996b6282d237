"""explore's extension byte: the newest load machinery (sync loads, the recompute policy, a finer
prefix_match_unit) and the connector's deployments (MultiConnector, P/D roles), drawn through vLLM's own
configuration path where the installed vLLM has them (feature probes). Each draw builds and runs on the
real scheduler and writes a recipe that `kvdoctor repro FILE` replays with the same setup. A few
seconds: one scheduler run per draw."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from pathlib import Path

from kvdoctor import app as application
from kvdoctor.explore.generate import (
    GEOMETRY_RANGES, PREFIX_MATCH_UNIT, RECOMPUTE, SYNC_LOADS, Example, Geometry, decode_extension, examples,
    to_recipe,
)
from kvdoctor.observe.verdict import Outcome
from kvdoctor.recipes.loader import load_recipe_text
from kvdoctor.recipes.writer import recipe_to_toml

DATA = Path(__file__).resolve().parent / "data"
ALL = frozenset({SYNC_LOADS, RECOMPUTE, PREFIX_MATCH_UNIT})
SWA = Geometry(8, 1, 16, 16, 256, False, layout="swa-full", sliding_window=16)
PLAIN = Geometry(8, 1, 16, 16, 256, False)
# byte -> the setup it draws on swa-full (bits: 0-1 sync budget, 2 recompute, 3-4 prefix unit, 5-6 role)
DRAWS = {1: "sync_load_budget_bytes", 2: "sync_load_budget_bytes", 4: "kv_load_failure_policy",
         8: "prefix_match_unit", 16: "prefix_match_unit", 32: "multi_connector", 64: "kv_role", 96: "kv_role"}
EVENTS = (("add", ("chunks", 2), 3, None), ("schedule", 2), ("reset", False, False),
          ("add", ("chunks", 3), 2, (0, None)), ("schedule", 1), ("hold", None, None), ("fail", None, "load"),
          ("finish", 0), ("schedule", 2), ("abort", 0))


def test_zero_is_the_plain_geometry_and_an_absent_feature_its_default():
    assert decode_extension(SWA, 0, ALL) == SWA
    for byte in range(256):
        assert decode_extension(PLAIN, byte, frozenset()).setup_dict() == {
            **PLAIN.setup_dict(), **({"multi_connector": True} if byte >> 5 & 3 == 1 else {}),
            **({"kv_transfer_fields": {"kv_role": ("kv_consumer", "kv_producer")[(byte >> 5 & 3) - 2]}}
               if byte >> 5 & 3 >= 2 else {})}
    # a single group takes no prefix_match_unit (vLLM refuses one at start-up): never drawn there
    assert all(decode_extension(PLAIN, byte, ALL).prefix_match_unit is None for byte in range(256))
    assert decode_extension(SWA, 8, ALL).prefix_match_unit == 4 and decode_extension(SWA, 16, ALL).prefix_match_unit == 2
    # vLLM's worker does not drive kvdoctor's second connector: no MultiConnector under --worker vllm
    assert not decode_extension(PLAIN, 32, ALL, worker="vllm").multi_connector


@settings(max_examples=100, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(examples(12, extended=True))
def test_extended_examples_are_recipes_the_loader_reads_back(raw):
    example = Example.decode(raw, features=ALL)
    assert len(raw[0]) == len(GEOMETRY_RANGES) + 1
    recipe = to_recipe(example)
    loaded = load_recipe_text(recipe_to_toml(recipe), "generated.toml")
    assert loaded.setup == recipe.setup


@pytest.fixture(scope="module")
def features(api):
    from kvdoctor.explore.search import available_features

    return available_features(api)


def test_features_are_probed_and_the_extension_drawn_only_with_sync_loads(api, features):
    """The extension byte is drawn where the release has sync loads (its geometry bytes, so the seeds
    measured on a release without them, stay as they were)."""
    from kvdoctor.explore.search import ExploreConfig, worker_search

    assert RECOMPUTE in features and PREFIX_MATCH_UNIT in features  # every supported release has both
    trace: list = []
    worker_search(api, ExploreConfig(seed=3, max_examples=20, time_budget=120, triage=False), trace=trace)
    extended = [recipe for recipe, _, _ in trace if {"kv_transfer_fields", "multi_connector", "prefix_match_unit",
                                                     "extra_connector_config"} & set(recipe.setup)]
    # drawn where the release has sync loads (20 examples, ~7 of 8 extension bytes draw something)
    assert bool(extended) == (SYNC_LOADS in features), [r.setup for r in extended[:1]]


@pytest.mark.parametrize("byte", sorted(DRAWS))
def test_each_draw_runs_on_the_real_scheduler_and_replays_from_its_file(api, features, byte, tmp_path):
    from kvdoctor.explore.runner import observe

    if byte & 3 and SYNC_LOADS not in features:
        pytest.skip("this vLLM's offloading scheduler has no sync loads (no sync_load_budget_bytes)")
    geometry = decode_extension(SWA, byte, features)
    recipe = to_recipe(Example(geometry, EVENTS))
    assert DRAWS[byte] in recipe.setup or DRAWS[byte] in recipe.setup.get("extra_connector_config", {}) \
        or DRAWS[byte] in recipe.setup.get("kv_transfer_fields", {}), recipe.setup
    obs = observe(api, recipe, "installed")
    # vLLM takes every drawn configuration (no start-up refusal) and kvdoctor raises nothing of its own
    assert not (obs.signature or "").startswith("kvdoctor"), obs.detail
    assert obs.failure_index != 0, obs.detail
    path = tmp_path / "draw.toml"
    path.write_text(recipe_to_toml(recipe))
    replay = application.repro(str(path), {}, "installed")
    assert replay.results[0].outcome is not Outcome.SETUP_ERROR, replay.results[0].detail
    for key in ("prefix_match_unit", "multi_connector"):
        assert getattr(replay.setup, key) == getattr(geometry, key)
    assert replay.setup.kv_transfer_fields == geometry.kv_transfer_fields()
    if geometry.sync_load_budget_bytes:
        assert replay.setup.extra_connector_config["sync_load_budget_bytes"] == geometry.sync_load_budget_bytes


def test_a_sync_load_completes_in_its_step_with_no_finished_recving(api, features, monkeypatch):
    """Regression from explore's shrunk false positive on 0.34.0 (tests/data): kvdoctor's simulated
    worker reported a sync load in finished_recving and vLLM asserted `req_id in self.requests`. vLLM's
    worker waits for a sync load within its step and reports no finished_recving for it; so does the
    simulated worker now, and the recipe runs through. Where the release has sync loads the run must
    issue one (else it tests nothing)."""
    from kvdoctor.engine.worker import SimulatedWorker

    seen: list = []
    original = SimulatedWorker.take_step

    def recording(self, new_jobs, jobs_to_flush, step):
        seen.extend(job for job in new_jobs if job.kind == "load")
        report = original(self, new_jobs, jobs_to_flush, step)
        assert not {job.req_id for job in report.completed if job.sync} & report.finished_recving
        return report

    monkeypatch.setattr(SimulatedWorker, "take_step", recording)  # kvdoctor's own worker, watched
    result = application.repro(str(DATA / "sync-load-no-finished-recving.toml"), {}, "installed").results[0]
    assert result.failure is None and result.outcome in (Outcome.NOT_REPRODUCED, Outcome.NOT_REACHED), result.detail
    if SYNC_LOADS in features:
        assert any(job.sync for job in seen), [(job.job_id, job.sync) for job in seen]
    else:
        assert not any(job.sync for job in seen)
