"""--device cuda: KV tensors on the GPU and vLLM's own CPUOffloadingSpec worker, unchanged.

Run on a machine with a CUDA GPU: `uv run pytest -m gpu`. Written against vLLM's real
worker API: `CPUOffloadingSpec.get_worker()` builds `CPUOffloadingWorker` (CUDA streams and
events, pinned host memory, `swap_blocks_batch` from `vllm._C`) over int8 (blocks, page)
CUDA views that the connector's `register_kv_caches` derives from kvdoctor's KV tensors.
"""

from __future__ import annotations

import pytest

from kvdoctor.engine.overrides import Overrides

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.vllm,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch sees none)")]

CUDA = {"worker": "vllm", "device": "cuda"}


def test_vllm_cpu_offloading_worker_runs_on_gpu_tensors(api):
    from kvdoctor import app
    from kvdoctor.engine.harness import Harness
    from kvdoctor.recipes.builtins import resolve

    setup = app.resolve_setup(resolve("queued-abort"), Overrides(**CUDA, gpu_blocks=16))
    assert setup.kv_connector_extra_config().get("spec_name") is None  # vLLM's own CPUOffloadingSpec
    harness = Harness(api, setup)
    try:
        worker = harness.worker
        assert worker.engine is None  # not kvdoctor's copy engine
        assert all(t.is_cuda for t in worker.kv_caches.values())
        from kvdoctor.engine import compat

        real = compat.load().offloading_worker_of(worker.connector)
        assert type(real).__module__ == "vllm.v1.kv_offload.cpu.gpu_worker", type(real)
        prompt = list(range(100, 124))
        harness.add("A", prompt, 2)
        for _ in range(4):
            harness.step()
        harness.reset_prefix_cache(reset_running_requests=False, reset_connector=False)
        harness.add("B", [*prompt, 7, 8, 9], 2)
        findings, loads = [], 0
        for _ in range(6):
            events = harness.step()
            findings += events.content_findings
            loads += len(events.new_load_jobs)
        torch.cuda.synchronize()
        assert loads >= 1 and findings == [], findings  # B read A's KV back through the CUDA copies
    finally:
        harness.shutdown()


@pytest.mark.parametrize("name", ["queued-abort", "final-token-slot-stored"])
def test_builtin_recipes_on_the_gpu_match_the_cpu_copy_engine(api, name):
    from kvdoctor import app
    from kvdoctor.levels.scheduler import run_scenario
    from kvdoctor.recipes.builtins import resolve

    recipe = resolve(name)
    gpu = run_scenario(api, recipe, app.resolve_setup(recipe, Overrides(**CUDA)), "installed")
    cpu = run_scenario(api, recipe, app.resolve_setup(recipe, Overrides(worker="vllm", device="cpu")), "installed")
    assert gpu.outcome is cpu.outcome, (gpu.detail, cpu.detail)
