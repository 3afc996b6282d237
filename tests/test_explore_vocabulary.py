"""explore's extension byte: the newest load machinery (sync loads, the recompute policy, a finer
prefix_match_unit) and the connector's deployments (MultiConnector, P/D roles), drawn through vLLM's own
configuration path where the installed vLLM has them (feature probes). Each draw builds and runs on the
real scheduler and writes a recipe that `kvdoctor repro FILE` replays with the same setup. A few
seconds: one scheduler run per draw."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings

from kvdoctor import app as application
from kvdoctor.engine.overrides import Overrides
from kvdoctor.explore.generate import (
    GEOMETRY_RANGES,
    LOAD_CAPS,
    PREFIX_MATCH_UNIT,
    PRIORITY,
    RECOMPUTE,
    RETENTION,
    SYNC_LOADS,
    Example,
    Geometry,
    decode_event,
    decode_extension,
    decode_second_extension,
    event_steps,
    examples,
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
    assert decode_extension(SWA, 8, ALL).prefix_match_unit == 4
    assert decode_extension(SWA, 16, ALL).prefix_match_unit == 2
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
    # the second byte and the events' fifth, where the connector reads per-request caps (half the geometries
    # draw the priority policy, five in eight adds a cap); elsewhere the same bytes as before
    second = [recipe for recipe, _, _ in trace
              if {"scheduling_policy", "prefix_cache_retention_interval"} & set(recipe.setup)
              or any("kv_transfer_params" in step.args or "priority" in step.args for step in recipe.steps)]
    assert bool(second) == (LOAD_CAPS in features and SYNC_LOADS in features), [r.setup for r in second[:1]]


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
    replay = application.repro(str(path), Overrides(), "installed")
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
    result = application.repro(str(DATA / "sync-load-no-finished-recving.toml"), Overrides(), "installed").results[0]
    assert result.failure is None and result.outcome in (Outcome.NOT_REPRODUCED, Outcome.NOT_REACHED), result.detail
    if SYNC_LOADS in features:
        assert any(job.sync for job in seen), [(job.job_id, job.sync) for job in seen]
    else:
        assert not any(job.sync for job in seen)


# -- the second extension byte and each event's fifth byte (where the connector reads per-request caps) --

ALL2 = ALL | {LOAD_CAPS, RETENTION, PRIORITY}
MAMBA = Geometry(8, 1, 16, 16, 256, False, layout="mamba-hybrid", mamba_cache_mode="align")
# (base geometry, second byte) -> the [setup] key it draws (bits: 0-1 retention in chunks, 2 the priority policy)
SECOND_DRAWS = {("swa", 1): "prefix_cache_retention_interval", ("mamba", 2): "prefix_cache_retention_interval",
                ("plain", 4): "scheduling_policy", ("swa", 6): "scheduling_policy"}
BASES = {"swa": SWA, "mamba": MAMBA, "plain": PLAIN}
# adds with the fifth byte's (max_load_tokens, max_offload_tokens, priority): caps on and off chunk boundaries
CAPPED_EVENTS = (("add", ("chunks", 2), 3, None), ("schedule", 2),
                 ("add", ("chunks", 3), 2, (0, None), ("chunk+1", 0, -1)), ("schedule", 3), ("hold", None, None),
                 ("add", ("chunks", 1), 4, (1, None), (0, "chunk-1", 1)), ("schedule", 2), ("fail", None, "load"),
                 ("add", ("tokens", 5), 2, (2, None), ("block", "chunk", 2)), ("finish", 0), ("schedule", 2))


def test_second_extension_zero_is_the_geometry_and_an_absent_feature_its_default():
    for geometry in BASES.values():
        assert decode_second_extension(geometry, 0, ALL2) == geometry
        assert all(decode_second_extension(geometry, byte, ALL) == geometry for byte in range(256))
    # vLLM refuses a positive retention interval without a sliding-window or Mamba group: never drawn there
    assert all(decode_second_extension(PLAIN, byte, ALL2).prefix_cache_retention_interval is None
               for byte in range(256))
    assert decode_second_extension(SWA, 2, ALL2).prefix_cache_retention_interval == 2 * SWA.chunk_tokens
    # the fifth byte: 0 draws nothing (an add as before), caps resolve against the geometry's chunk
    assert decode_event(1, 0, 0, 0, 0) == decode_event(1, 0, 0, 0)
    assert decode_event(1, 0, 0, 0, 0b10_101_110)[0][-1] == ("chunk", "chunk-1", -1)
    steps = event_steps(Example(PLAIN, CAPPED_EVENTS))
    caps = [s.args.get("kv_transfer_params") for s in steps if s.action == "add"]
    assert caps == [None, {"max_load_tokens": 9, "max_offload_tokens": 0},  # PLAIN: 8-token blocks and chunks
                    {"max_load_tokens": 0, "max_offload_tokens": 7}, {"max_load_tokens": 8, "max_offload_tokens": 8}]
    assert not any("priority" in s.args for s in steps)  # fcfs: vLLM ignores a priority, none is written


@settings(max_examples=100, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(examples(12, extended=True, second=True))
def test_second_extension_examples_are_recipes_the_loader_reads_back(raw):
    example = Example.decode(raw, features=ALL2)
    assert len(raw[0]) == len(GEOMETRY_RANGES) + 2 and all(len(event) == 5 for event in raw[1])
    recipe = to_recipe(example)
    loaded = load_recipe_text(recipe_to_toml(recipe), "generated.toml")
    assert loaded.setup == recipe.setup
    assert [(s.action, s.args) for s in loaded.steps] == [(s.action, s.args) for s in recipe.steps]


@pytest.mark.parametrize("draw", sorted(SECOND_DRAWS))
def test_each_second_draw_runs_on_the_real_scheduler_and_replays_from_its_file(api, features, draw, tmp_path):
    from kvdoctor.explore.runner import observe

    key = SECOND_DRAWS[draw]
    if LOAD_CAPS not in features:
        pytest.skip("this vLLM's offloading connector reads no per-request caps (max_load_tokens): "
                    "the second extension byte is not drawn")
    assert RETENTION in features and PRIORITY in features  # measured: every release with the caps has both
    geometry = decode_second_extension(BASES[draw[0]], draw[1], features)
    recipe = to_recipe(Example(geometry, CAPPED_EVENTS))
    assert key in recipe.setup, recipe.setup
    assert any("kv_transfer_params" in s.args for s in recipe.steps)
    assert any("priority" in s.args for s in recipe.steps) == (geometry.scheduling_policy == "priority")
    obs = observe(api, recipe, "installed")
    # vLLM takes every drawn configuration (no start-up refusal) and kvdoctor raises nothing of its own
    assert not (obs.signature or "").startswith("kvdoctor"), obs.detail
    assert obs.failure_index != 0 and obs.scheduler_steps > 0, obs.detail
    path = tmp_path / "draw.toml"
    path.write_text(recipe_to_toml(recipe))
    replay = application.repro(str(path), Overrides(), "installed")
    assert replay.results[0].outcome is not Outcome.SETUP_ERROR, replay.results[0].detail
    assert getattr(replay.setup, key) == getattr(geometry, key)


def _capped_run(api, setup, cap_b=None, cap_a=None):
    """A stores its prompt; B, with A's prompt, arrives after the GPU prefix cache is reset: the jobs each
    request got (its kv_transfer_params sent as a client's)."""
    from kvdoctor.engine.harness import Harness

    harness = Harness(api, setup)
    jobs: dict[str, list[str]] = {"A": [], "B": []}
    try:
        prompt = list(range(10, 10 + 4 * setup.offloaded_block_size))
        harness.add("A", prompt, 2, kv_transfer_params=cap_a)
        for _ in range(4):
            events = harness.step()
            jobs["A"] += ["store" for rid in events.new_store_jobs.values() if rid == "A"]
        harness.reset_prefix_cache(False, False)
        harness.add("B", prompt, 2, kv_transfer_params=cap_b)
        for _ in range(3):
            events = harness.step()
            jobs["B"] += ["load" for rid in events.new_load_jobs.values() if rid == "B"]
    finally:
        harness.shutdown()
    return jobs


def test_vllm_honours_the_per_request_caps_sent_as_a_client_sends_them(api, features):
    """The caps travel where vLLM reads a client's (the sampling params' extra_args -> Request.kv_transfer_params
    -> the connector's request state): max_offload_tokens = 0 stores nothing, max_load_tokens = 0 loads nothing,
    where the same run without them stores and loads."""
    from kvdoctor.engine.setup import Setup

    if LOAD_CAPS not in features:
        pytest.skip("this vLLM's offloading connector reads no per-request caps (max_load_tokens)")
    setup = Setup(block_size=4, gpu_blocks=16, max_model_len=60)
    plain = _capped_run(api, setup)
    assert plain["A"] and plain["B"], plain
    assert not _capped_run(api, setup, cap_a={"max_offload_tokens": 0})["A"]
    assert not _capped_run(api, setup, cap_b={"max_load_tokens": 0})["B"]


def test_the_priority_policy_preempts_the_least_urgent_running_request(api):
    """Under `scheduling_policy = "priority"` a running request that needs a block preempts the running request
    with the largest priority value (A, admitted first); under fcfs the last admitted (B) goes. Both admitted
    with three blocks each into a seven-block pool: A's first decode takes the last free block, B's has none."""
    from kvdoctor.engine.harness import Harness
    from kvdoctor.engine.setup import Setup

    preempted = {}
    for policy in ("fcfs", "priority"):
        harness = Harness(api, Setup(block_size=4, gpu_blocks=8, max_model_len=28, scheduling_policy=policy))
        try:
            harness.add("A", list(range(10, 22)), 8, priority=1)
            harness.add("B", list(range(40, 52)), 8, priority=-1)
            preempted[policy] = [rid for _ in range(4) for rid in harness.step().preempted]
        finally:
            harness.shutdown()
    assert preempted["priority"][:1] == ["A"] and preempted["fcfs"][:1] == ["B"], preempted


# -- engine events: pause / resume, through vLLM's EngineCore (`--engine core`) ----------------------------

def test_pause_and_resume_go_through_the_engine_and_the_scheduler_level_says_why_not(api, tmp_path):
    """`pause` / `resume` call EngineCore.pause_scheduler / resume_scheduler: under mode "keep" a request added
    while paused gets no tokens until the resume, and mode "abort" with clear_cache aborts A and releases its
    connector state. The scheduler level has no engine around the scheduler: not_applicable, naming why."""
    from kvdoctor.engine.core.harness import CoreHarness
    from kvdoctor.engine.setup import Setup

    harness = CoreHarness(api, Setup(block_size=4, gpu_blocks=16, max_model_len=60))
    try:
        harness.add("A", list(range(10, 34)), 8)
        assert harness.step().scheduled_tokens.get("A") == 24
        harness.pause("keep", False)
        harness.add("B", list(range(40, 52)), 2)
        paused = [harness.step().scheduled_tokens for _ in range(2)]
        assert paused == [{}, {}], paused  # PAUSED_ALL: the engine's step schedules nothing
        harness.resume()
        resumed = harness.step().scheduled_tokens
        assert resumed.get("B") == 12 and resumed.get("A") == 1, resumed
        harness.pause("abort", True)
        assert harness.core.scheduler.get_num_unfinished_requests() == 0
        harness.resume()
        harness.step()  # the aborts' finished ids reach the connector
        assert not api.request_states(harness.connector_scheduler), api.request_states(harness.connector_scheduler)
    finally:
        harness.shutdown()
    recipe = tmp_path / "pause.toml"
    recipe.write_text(PAUSE_RECIPE)
    result = application.repro(str(recipe), Overrides(), "installed").results[0]
    assert result.outcome is Outcome.NOT_APPLICABLE and "play it with --engine core" in result.detail, result.detail
    core = application.repro(str(recipe), Overrides(engine="core"), "installed").results[0]
    assert core.outcome is Outcome.NOT_REPRODUCED and core.failure is None, core.detail


PAUSE_RECIPE = """
[recipe]
name = "pause-resume"
summary = "the engine pauses while A's stores are held, B queues, an abort-pause clears the caches, C arrives"

[setup]
block_size = 4
gpu_blocks = 16
max_model_len = 60
worker = "simulated"

[signature]
exception = "AssertionError"
function = "(none)"

[[step]]
action = "add"
request = "A"
prompt_tokens = 24
max_tokens = 4

[[step]]
action = "hold_transfers"
kind = "store"

[[step]]
action = "schedule"
count = 2

[[step]]
action = "pause"
mode = "keep"

[[step]]
action = "add"
request = "B"
prompt_tokens = 24
shared_prefix_with = "A"
shared_prefix_tokens = 24
max_tokens = 2

[[step]]
action = "schedule"
count = 2

[[step]]
action = "resume"

[[step]]
action = "schedule"

[[step]]
action = "pause"
mode = "abort"
clear_cache = true

[[step]]
action = "resume"

[[step]]
action = "complete_transfers"

[[step]]
action = "add"
request = "C"
prompt_tokens = 24
max_tokens = 2

[[step]]
action = "schedule"
count = 6
"""


@pytest.mark.parametrize("line, words", [
    ('scheduling_policy = "lifo"', "scheduling_policy must be one of fcfs|priority"),
    ("prefix_cache_retention_interval = 0", "prefix_cache_retention_interval must be a positive integer"),
])
def test_new_setup_keys_are_refused_in_one_line_before_vllm_is_imported(tmp_path, line, words):
    import subprocess
    import sys

    from .conftest import ROOT

    path = tmp_path / "bad.toml"
    path.write_text(PAUSE_RECIPE.replace('worker = "simulated"', f'worker = "simulated"\n{line}'))
    done = subprocess.run([sys.executable, "-m", "kvdoctor", "repro", str(path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and words in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_the_exported_script_carries_caps_priorities_and_the_policy():
    """A generated recipe with per-request caps under the priority policy exports to a vLLM-only script that
    sends them as the harness does (kv_transfer_params in extra_args, Request.priority, SchedulerConfig.policy).
    Not run here (its ModelConfig build alone took 26 s on the loaded 2-core machine); measured by hand: such a
    script runs through on 0.26.0 and 0.34.0."""
    from kvdoctor.explore.runner import setup_of
    from kvdoctor.export.script import export_script, recipe_data

    geometry = decode_second_extension(PLAIN, 4, ALL2)
    recipe = to_recipe(Example(geometry, CAPPED_EVENTS))
    data = recipe_data(recipe, setup_of(recipe))
    assert data["setup"]["scheduling_policy"] == "priority"
    adds = [step["args"] for step in data["steps"] if step["action"] == "add"]
    assert [a.get("kv_transfer_params") for a in adds] == [s.args.get("kv_transfer_params")
                                                           for s in recipe.steps if s.action == "add"]
    assert [a.get("priority", 0) for a in adds] == [0, -1, 1, 2]
    script = export_script(recipe, setup_of(recipe))
    assert '"extra_args": {"kv_transfer_params"' in script and "priority=args.get(\"priority\", 0)" in script
    assert '"policy": setup["scheduling_policy"]' in script
