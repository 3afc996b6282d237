"""Several workers (issue 27, item 4): `num_workers` sets vLLM's world size as --tensor-parallel-size does,
the simulated worker reports each job once per worker and vLLM's own KVOutputAggregator combines the
reports, as the executor does. Every assertion is on what vLLM's real scheduler and connector did.
Cheap: one harness run per case and one explored draw, shared per module."""

from __future__ import annotations

import pytest

from kvdoctor import app as application
from kvdoctor.engine.overrides import Overrides
from kvdoctor.engine.setup import Setup
from kvdoctor.errors import UsageError
from kvdoctor.explore.generate import (
    GEOMETRY_RANGES,
    WORKERS_DRAW,
    Example,
    Geometry,
    decode_workers,
    examples,
    to_recipe,
)
from kvdoctor.observe.verdict import Outcome
from kvdoctor.recipes.writer import recipe_to_toml

PLAIN = Geometry(4, 1, 24, 16, 256, False)
PROMPT = list(range(100, 116))  # 16 tokens: four 4-token blocks, each its own chunk


# -- no vLLM needed ---------------------------------------------------------------------------------

def test_setup_refuses_what_kvdoctor_cannot_stand_in_for():
    with pytest.raises(UsageError, match="num_workers must be a positive integer"):
        Setup(num_workers=0).validate()
    with pytest.raises(UsageError, match="late_worker_steps needs num_workers >= 2"):
        Setup(late_worker_steps=1).validate()
    with pytest.raises(UsageError, match="num_workers > 1"):
        Setup(num_workers=2, worker="vllm").validate()
    with pytest.raises(UsageError, match="scheduler level only"):
        Setup(num_workers=2, engine="core").validate()
    with pytest.raises(UsageError, match="multi_connector"):
        Setup(num_workers=2, multi_connector=True).validate()
    assert Setup(num_workers=4, late_worker_steps=3).validate().num_workers == 4


def test_the_byte_is_drawn_only_where_gated_and_zero_is_one_worker():
    assert decode_workers(PLAIN, 0) == PLAIN
    assert decode_workers(PLAIN, 2, worker="vllm") == PLAIN
    multi = Geometry(4, 1, 24, 16, 256, False, multi_connector=True)
    assert decode_workers(multi, 2) == multi
    drawn = decode_workers(PLAIN, 2 | 3 << 2 | 1 << 5)  # 4 workers, the last 2 steps late, failing alone
    assert (drawn.num_workers, drawn.late_worker_steps, drawn.fail_worker) == (4, 2, 3)
    small_tier = Geometry(16, 4, 24, 16, 256, False, cpu_bytes_to_use=4096)
    assert decode_workers(small_tier, 1).cpu_bytes_to_use == 2 * 4096  # as many chunks as one worker's
    from hypothesis import find

    assert len(find(examples(4, workers=True), lambda raw: True)[0]) == len(GEOMETRY_RANGES) + 1
    assert len(find(examples(4), lambda raw: True)[0]) == len(GEOMETRY_RANGES)  # ungated: draws unchanged
    raw = (bytes([0] * len(GEOMETRY_RANGES)) + bytes([1]), [b"\x00" * 4])
    assert Example.decode(raw, features=frozenset({WORKERS_DRAW})).geometry.num_workers == 2
    assert Example.decode(raw).geometry.num_workers == 1  # without the gate the byte is not read


def test_a_drawn_failure_names_its_worker_and_the_settle_tail_waits_for_the_late_one():
    geometry = decode_workers(PLAIN, 1 | 4 << 2 | 2 << 5)  # 2 workers, the last 3 steps late, worker 0 fails
    recipe = to_recipe(Example(geometry, (("add", ("tokens", 8), 2, None), ("fail", None, "store"))))
    assert recipe.setup["num_workers"] == 2 and recipe.setup["late_worker_steps"] == 3
    fail = next(step for step in recipe.steps if step.action == "fail_transfers")
    assert fail.args == {"kind": "store", "worker": 0}
    assert recipe.steps[-1].args["count"] == 4 + 3


# -- on the installed vLLM ----------------------------------------------------------------------------

def _store_timeline(api, num_workers: int, late: int) -> list[dict[int, int]]:
    """A's stores, step by step: vLLM's own pending jobs (job id -> workers still to report)."""
    from kvdoctor.engine.harness import Harness

    harness = Harness(api, Setup(block_size=4, gpu_blocks=16, num_workers=num_workers,
                                 late_worker_steps=late).validate())
    rows = []
    try:
        assert api.offload_config(harness.connector_scheduler).num_workers == num_workers
        harness.add("A", PROMPT, 6)
        for _ in range(5):
            harness.step()
            rows.append({jid: job.pending_count for jid, job in api.jobs(harness.connector_scheduler).items()})
    finally:
        harness.shutdown()
    return rows


@pytest.fixture(scope="module")
def late_run(api):
    if not api.counts_worker_reports:
        pytest.skip("this vLLM's offloading scheduler does not count each job's reports to world_size")
    return _store_timeline(api, 2, 2)


def test_vllm_waits_for_the_late_worker(late_run):
    """Worker 0 reports A's store in the step that issued it, worker 1 two steps later: vLLM keeps the
    job pending with one report missing until then, and completes it with the last one."""
    first, second, third, *_ = late_run
    assert first and set(first.values()) == {1}, late_run
    assert second == first, late_run
    assert not third, late_run  # the late report arrived: vLLM completed the job


def test_with_every_worker_on_time_the_job_completes_in_its_step(api):
    if not api.counts_worker_reports:
        pytest.skip("this vLLM's offloading scheduler does not count each job's reports to world_size")
    assert not any(_store_timeline(api, 4, 0))


def _failed_load(api, num_workers: int) -> tuple[str, int, int]:
    """A stored, then B with A's prompt loads it from the CPU tier and the load fails (on worker 1
    alone where there are two): B's status, computed tokens, and vLLM's jobs left."""
    from kvdoctor.engine.harness import Harness

    harness = Harness(api, Setup(block_size=4, gpu_blocks=16, num_workers=num_workers).validate())
    try:
        harness.add("A", PROMPT, 1)
        for _ in range(3):
            harness.step()
        harness.reset_prefix_cache(False, False)  # A's blocks leave the GPU cache: B's hit is the CPU tier's
        harness.worker.hold(kind="load")
        harness.add("B", [*PROMPT, 7, 8], 4)
        harness.step()
        assert harness.worker.in_flight, "B's load was not issued: nothing to fail"
        if num_workers > 1:
            harness.worker.fail(kind="load", worker=1)
        else:
            harness.worker.fail(kind="load")
        for _ in range(3):
            harness.step()
        request = harness.requests["B"]
        return request.status.name, request.num_computed_tokens, len(api.jobs(harness.connector_scheduler))
    finally:
        harness.shutdown()


def test_one_workers_failed_load_is_the_requests_failed_load(api):
    """The executor unions the workers' failures: a load that worker 1 alone fails ends B exactly as
    the same failure of a single worker does (whatever this release's failure policy makes of it)."""
    if not api.counts_worker_reports:
        pytest.skip("this vLLM's offloading scheduler does not count each job's reports to world_size")
    one = _failed_load(api, 1)
    two = _failed_load(api, 2)
    assert two == one and two[2] == 0, (one, two)


@pytest.fixture(scope="module")
def explored(api, tmp_path_factory):
    from kvdoctor.explore.runner import observe

    geometry = decode_workers(PLAIN, 1 | 3 << 2 | 1 << 5)  # 2 workers, the last 2 steps late, and failing
    events = (("add", ("tokens", 10), 4, None), ("schedule", 2), ("hold", None, "load"),
              ("add", ("tokens", 10), 3, (0, None)), ("schedule", 1), ("fail", None, "load"), ("schedule", 3))
    recipe = to_recipe(Example(geometry, events))
    path = tmp_path_factory.mktemp("workers") / "draw.toml"
    path.write_text(recipe_to_toml(recipe))
    return geometry, observe(api, recipe, "installed"), path


def test_a_draw_runs_on_the_real_scheduler_with_no_finding(explored):
    """vLLM handles a late worker and one worker's failed load correctly: an invariant firing here would
    be kvdoctor's false positive."""
    _, obs, _ = explored
    assert obs.failure_index is None and obs.signature is None, obs.detail
    assert obs.scheduler_steps > 0


def test_the_draw_replays_from_its_file(explored):
    geometry, _, path = explored
    assert "num_workers = 2" in path.read_text() and "worker = 1" in path.read_text()
    replay = application.repro(str(path), Overrides(), "installed")
    assert (replay.setup.num_workers, replay.setup.late_worker_steps) == (2, 2) == (
        geometry.num_workers, geometry.late_worker_steps)
    assert replay.results[0].outcome in (Outcome.NOT_REPRODUCED, Outcome.NOT_REACHED), replay.results[0].detail


def test_a_drawn_small_tier_still_holds_chunks_for_every_worker(api):
    """Regression from bench_explore on 0.34.0 (seed 1): 2 workers with the generator's 4 KiB tier and
    16-token blocks, 4 per chunk, left TieringOffloadingSpec no chunk (vLLM counts a copy per worker), and
    its start-up raised `range() arg 3 must not be zero`; the draw scales the tier by the workers."""
    from kvdoctor.engine.harness import Harness
    from kvdoctor.explore.generate import TIERING
    from kvdoctor.explore.runner import setup_of

    if not api.has_offloading_spec(TIERING):
        pytest.skip("this vLLM has no TieringOffloadingSpec")
    geometry = decode_workers(Geometry(16, 4, 24, 16, 256, False, cpu_bytes_to_use=4096, spec_name=TIERING), 1)
    harness = Harness(api, setup_of(to_recipe(Example(geometry, (("add", ("tokens", 8), 1, None),)))))
    harness.shutdown()
