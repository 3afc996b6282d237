"""--worker vllm: vLLM's worker-role OffloadingConnector on real KV bytes (CPU copy engine).

Per-release outcomes are kvdoctor's measurements (kvdoctor/data/release_outcomes.toml); the
content checks are judged on every built-in recipe. One harness per recipe run, one vLLM import per session.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest

from kvdoctor import app
from kvdoctor.engine.harness import Harness
from kvdoctor.engine.overrides import Overrides
from kvdoctor.levels.scheduler import run_scenario
from kvdoctor.observe.invariants import CONTENT_INVARIANTS
from kvdoctor.observe.verdict import Outcome
from kvdoctor.recipes.builtins import all_builtins, resolve
from tests.conftest import ROOT
from tests.recipe_runs import bug_present, measured, measured_if_any

pytestmark = pytest.mark.vllm

VLLM_CPU = {"worker": "vllm", "device": "cpu"}
REPRODUCED, NOT = Outcome.REPRODUCED, Outcome.NOT_REPRODUCED
# The built-in recipes vLLM's worker runs here (the hybrid-layout and hash-delay ones: K3 on two block
# sizes, K5 with an EAGLE group, K6, K11 included; the Mamba and MultiConnector ones fall back to the
# simulated worker). Their expected outcomes are kvdoctor's measurements in
# kvdoctor/data/release_outcomes.toml: `kvdoctor matrix --audit` runs each recipe at its default setup
# with the CLI's default worker, vLLM's (measured on CPU-only machines: device cpu, as VLLM_CPU pins),
# so a row is a measurement of the run this module makes (test_audit_measures_these_recipes_with_vllms_worker
# holds that premise).
WORKER_RECIPES = ("queued-abort", "preemption", "prefetch", "final-token-slot-stored", "finished-after-finalize",
                  "preempt-reload-same-step", "swa-unaligned-pending-bound", "eagle-final-chunk-unstored",
                  "offload-keys-lag-blocks", "swa-unaligned-hit-missing-chunk", "readmitted-stale-store-cursor")
NEWER = ("swa-unaligned-pending-bound", "eagle-final-chunk-unstored", "offload-keys-lag-blocks",
         "swa-unaligned-hit-missing-chunk")
# K11, restated so that A's stores are complete before B's need their CPU slots (vLLM's worker
# reports a store a step late): with either worker the same outcome (measured 2026-12-04).
K11 = "readmitted-stale-store-cursor"


def test_audit_measures_these_recipes_with_vllms_worker():
    """The premise of reading this module's expectations from the data file: the audit (which measured
    it) resolves each of these recipes to vLLM's worker, with no fallback to the simulated one."""
    from kvdoctor.cli.options import DEFAULT_WORKER, worker_overrides

    for name in WORKER_RECIPES:
        setup = app.resolve_setup(resolve(name), worker_overrides(None, None, None), worker_fallback=True,
                                  default_worker=DEFAULT_WORKER)
        assert (setup.worker, setup.worker_fallback) == ("vllm", None), name


@pytest.fixture(scope="module")
def vllm_runs(api):
    """Every built-in recipe once under the installed logic with vLLM's worker, and the simulated
    worker's outcome beside it."""
    runs = {}
    for recipe in all_builtins():
        if recipe.name not in WORKER_RECIPES:  # newer recipes: not yet measured with vLLM's worker
            continue
        setup = app.resolve_setup(recipe, Overrides(**VLLM_CPU))
        simulated = run_scenario(api, recipe, app.resolve_setup(recipe), "installed")
        runs[recipe.name] = (run_scenario(api, recipe, setup, "installed"), simulated)
    return runs


@pytest.mark.parametrize("name", WORKER_RECIPES)
def test_builtin_recipe_outcome_with_vllm_worker(api, vllm_runs, name):
    expected = measured(api, name)
    real, simulated = vllm_runs[name]
    assert real.outcome is expected, real.detail or real.failure
    assert "vLLM worker-role OffloadingConnector" in real.worker and real.model_runner in ("v1", "v2")
    if name in ("queued-abort", "preemption", "prefetch", *NEWER, K11):
        assert not [v for v in real.violations if v.invariant in CONTENT_INVARIANTS], real.violations
        assert real.outcome is simulated.outcome  # the K1 paths reproduce as with the simulated worker
        if real.failure is not None:
            assert (real.failure.exception, real.failure.function) == (
                simulated.failure.exception, simulated.failure.function)


def test_content_checks_hold_where_nothing_reproduces(api, vllm_runs):
    """Not reproduced means every invariant held, the content ones included (they run on every step)."""
    checked = 0
    for name, (real, _) in vllm_runs.items():
        if measured_if_any(api, name) is NOT:
            assert real.outcome is NOT and not real.violations, (name, real.detail)
            checked += 1
    if not checked:
        pytest.skip(f"no recipe run here was measured not_reproduced with vLLM's worker on vLLM {api.version_text} "
                    "(kvdoctor/data/release_outcomes.toml)")


def test_final_token_slot_is_caught_by_content(api, vllm_runs):
    """K4 through the bytes: the store copies position 15, whose KV the model never wrote."""
    if not bug_present(api, "final-token-slot-stored"):
        pytest.skip(f"K4 does not reproduce on vLLM {api.version_text} (kvdoctor/data/release_outcomes.toml)")
    real, _ = vllm_runs["final-token-slot-stored"]
    content = [v for v in real.violations if v.invariant == "store-copies-computed-kv"]
    assert content, real.detail
    assert "A layer model.layers.0.self_attn.attn position 15" in content[0].message
    assert "never written" in content[0].message and "(block " in content[0].message


@contextmanager
def fence_removed(api):
    """The connector's metadata without `jobs_to_flush` (scoped: always restored)."""
    module = __import__("vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
                        fromlist=["OffloadingConnector"])
    cls = module.OffloadingConnector
    original = cls.build_connector_meta

    def without_fence(self, scheduler_output):
        meta = original(self, scheduler_output)
        meta.jobs_to_flush = set()
        return meta

    cls.build_connector_meta = without_fence
    try:
        yield
    finally:
        cls.build_connector_meta = original


HELD_STORE = str(ROOT / "tests" / "data" / "held-store-blocks-reused.toml")


def test_held_store_over_reused_blocks_is_fenced(api):
    """Released code: the flush makes the worker copy A's bytes before B computes into the blocks."""
    (result,) = app.repro(HELD_STORE, Overrides(**VLLM_CPU), "installed", record_timeline=True).results
    assert result.outcome is NOT, result.detail
    reuse = [e for e in result.timeline if e.events and e.events.reused_while_storing]
    assert reuse and all(set(e.events.reused_while_storing) <= set(e.events.jobs_to_flush) for e in reuse)


def test_missing_fence_shows_as_stale_bytes(api):
    with fence_removed(api):
        (result,) = app.repro(HELD_STORE, Overrides(**VLLM_CPU), "installed").results
    assert result.outcome is REPRODUCED, result.detail or result.failure
    (first, *_) = [v for v in result.violations if v.invariant == "store-copies-computed-kv"]
    assert "store job #" in first.message and "A layer" in first.message
    assert "stale: bytes of request B position" in first.message
    # and the scope restored vLLM's method: the released code holds again
    (again,) = app.repro(HELD_STORE, Overrides(**VLLM_CPU), "installed").results
    assert again.outcome is NOT


def test_bytes_really_move_and_loads_return_them(api):
    """Store a prefix, reset the GPU prefix cache, reload it: loaded pages equal stored ones,
    and the reader's forward checks every slot it reads."""
    recipe = resolve("queued-abort")
    setup = app.resolve_setup(recipe, Overrides(**VLLM_CPU, gpu_blocks=16))
    harness = Harness(api, setup)
    try:
        prompt = list(range(100, 124))
        harness.add("A", prompt, 2)
        for _ in range(4):
            harness.step()
        assert harness.reset_prefix_cache(reset_running_requests=False, reset_connector=False)
        harness.add("B", [*prompt, 7, 8, 9, 10, 11], 2)
        findings = []
        for _ in range(5):
            findings += harness.step().content_findings
        engine = harness.worker.engine
        kinds = {kind for kind, _ in engine.submitted}
        assert kinds == {"store", "load"}, engine.submitted
        assert engine.stored and harness.worker.model.checked_slots > len(prompt)
        assert findings == []
    finally:
        harness.shutdown()


def test_content_invariants_are_named():
    from kvdoctor.observe.invariants import INVARIANTS

    assert set(CONTENT_INVARIANTS) <= set(INVARIANTS)


def test_device_cuda_without_a_gpu_is_a_usage_error():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    from tests.conftest import run_cli

    proc = run_cli("repro", "queued-abort", "--worker", "vllm", "--device", "cuda")
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "--device cuda" in proc.stderr


@pytest.mark.parametrize("name", ["finished-after-finalize", "preempt-reload-same-step"])
def test_async_recipes_end_as_with_the_simulated_worker(api, name):
    """vLLM's worker reports a copy a step after it submits it; under async scheduling that is one
    more step than the simulated worker takes. These recipes wait for it (before, their expect
    step or final check saw the store still in flight: setup_error / other_failure)."""
    recipe = resolve(name)
    real_setup = app.resolve_setup(recipe, Overrides(**VLLM_CPU, async_scheduling=True))
    real = run_scenario(api, recipe, real_setup, "installed")
    simulated = run_scenario(api, recipe, app.resolve_setup(recipe, Overrides(async_scheduling=True)), "installed")
    assert real.outcome is simulated.outcome, (real.detail, simulated.detail)
    assert real.outcome in (REPRODUCED, NOT), real.detail
    assert not [v for v in real.violations if v.invariant in CONTENT_INVARIANTS], real.violations


CONFIGS = ROOT / "tests" / "data" / "configs"


@pytest.mark.parametrize("name,groups", [("llama-3.1-8b", 1), ("gemma-3-27b", 7)])
def test_the_worker_holds_fingerprints_at_the_schedulers_geometry(api, name, groups):
    """Issue 23: vLLM's worker runs over the scheduler's groups, block sizes and block count, one layer a group
    at 16 bytes a token slot (Gemma 3's seven groups alias one tensor, as vLLM places a hybrid's); the CPU tier
    keeps the slots the scheduler computes from the real pages; bytes still move and loads return them."""
    recipe = resolve("queued-abort")
    tier = 1 << 30
    setup = app.resolve_setup(recipe, Overrides(**{**VLLM_CPU, "model": str(CONFIGS / name), "block_size": 16,
                                       "gpu_blocks": 64, "cpu_bytes_to_use": tier}))
    harness = Harness(api, setup)
    try:
        worker = harness.worker
        real, fp = worker.kv_cache_config, worker.worker_kv_cache_config
        assert len(fp.kv_cache_groups) == len(real.kv_cache_groups) == groups
        assert fp.num_blocks == real.num_blocks
        assert [g.kv_cache_spec.block_size for g in fp.kv_cache_groups] == [
            g.kv_cache_spec.block_size for g in real.kv_cache_groups]
        assert all(len(g.layer_names) == 1 for g in fp.kv_cache_groups)
        pages = {int(spec.page_size_bytes) for _, spec in api.kv_layer_specs(fp).values()}
        assert pages == {16 * 16}
        storages = {t.untyped_storage().data_ptr() for t in worker.kv_caches.values()}
        assert len(storages) == 1  # the groups alias one allocation
        if name == "llama-3.1-8b":  # one group: a CPU chunk is a block of every layer, 2 MiB
            assert worker.fingerprint.cpu_slots == tier // (2 << 20)
        assert worker.engine.cpu_tensors[0].shape[0] == worker.fingerprint.cpu_slots
        prompt = list(range(100, 164))
        harness.add("A", prompt, 2)
        for _ in range(4):
            harness.step()
        assert harness.reset_prefix_cache(reset_running_requests=False, reset_connector=False)
        harness.add("B", [*prompt, 7, 8], 2)
        findings = []
        for _ in range(5):
            findings += harness.step().content_findings
        assert {kind for kind, _ in worker.engine.submitted} == {"store", "load"}, worker.engine.submitted
        assert worker.model.checked_slots > len(prompt) and findings == []
    finally:
        harness.shutdown()
