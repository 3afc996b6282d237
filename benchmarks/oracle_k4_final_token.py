"""An independent oracle for K4 (final sampled token's KV slot offloaded): vLLM's own regression test, no kvdoctor.

Upstream's test (vllm-project/vllm PR #54288, tests/v1/kv_connector/unit/offloading_connector/test_scheduler.py::
test_final_sampled_token_does_not_complete_an_offloaded_block, parametrized over async_scheduling and
prompt_offset -1/-2): block size 4, one block per chunk, 10 GPU blocks, a prompt of 2 * 4 + offset tokens, the
first decoded token EOS, driven through upstream's RequestRunner engine loop (under async scheduling a step's
output is applied one schedule() later, as EngineCore's batch queue does). It asserts that only GPU block 0 is
ever stored: at offset -1 the EOS completes block 1, whose last slot (the final sampled token) the finishing
step must not store; at -2 block 1 stays partial.

This script plays the same loop against the installed vLLM with the real CPU offloading spec (upstream's mock
spec and mock manager changed signatures between releases; the CPU manager accepts every store, as the test's
`generate_store_output(keys)` does), with offload_prompt_only = false (block 1 holds a decoded token), and reads
the store jobs the connector builds from each scheduler output (a job built is a block stored: every transfer
succeeds, reported done one step after it is built, as vLLM's worker submits a step's stores at the next step's
start). It imports only vLLM and the standard library.

    for v in '' -vllm-0.27 ...; do /work/main/.venv$v/bin/python benchmarks/oracle_k4_final_token.py; done

Prints one line per (scheduling, offset): the stored block indices, PASS (only block 0) or FAIL (upstream's
loop), the same after one more schedule(), and (async) with that schedule() before the in-flight step's output
is applied (EngineCore's order); exit 0 when every case passes upstream's loop, 1 otherwise.

Measured 2026-12-05 (each /work/main env; offset -2 passes every column on every release measured):

    release  upstream's loop   one more schedule()          engine's order (async)
    0.26.0   all pass          sync -1 FAIL (block 1)       async -1 FAIL (block 1)
    0.27.0   all pass          sync -1, async -1 FAIL       async -1 FAIL
    0.27.1   all pass          sync -1, async -1 FAIL       async -1 FAIL
    0.28.0   all pass          sync -1, async -1 FAIL       async -1 FAIL
    0.29.0   all pass          sync -1, async -1 FAIL       async -1 FAIL
    0.30.0   all pass          all pass                     all pass
    0.31.0   all pass          all pass                     all pass
    0.32.0   all pass          all pass                     all pass
    0.33.0   all pass          all pass                     all pass
    0.34.0   all pass          all pass                     all pass
    (0.31.0: 74 s, 0.32.0: 277 s, 0.33.0: 312 s at load 2-10, `timeout 900` each, exit 0.) The releases where it
    fails are the ones release_outcomes.toml records K4 reproduced (final-token-slot-stored, sync and async):
    0.26.0-0.29.0; from 0.30.0 every case passes and K4 is
    not reproduced, sync and async: no row contradicts the oracle.

The built-in recipe ending at max_tokens instead of an EOS (max_tokens = 1, no finish step, the sync requirement
dropped), played by `kvdoctor.app.repro(PATH, logic="all", default_worker="vllm")` on each of the ten envs
(2026-12-05): reproduced under every logic, sync and async, on 0.26.0-0.29.0; not_reproduced, sync and async, on
0.30.0-0.34.0 - the sync verdicts of the EOS recipe on every release, and async reproduces exactly where sync
does (the EOS recipe under async: untested on 0.26.0-0.29.0, not_reproduced from 0.30.0). It is now the built-in
final-token-slot-stored (the EOS form is deleted); its rows re-measured with
`matrix --audit final-token-slot-stored --write-data`.

Upstream's loop never schedules after the request finished (it leaves scheduler.requests at once), so its final
store is never built there; it is built at the next schedule() (0.26.0 async: only in the engine's order, as
upstream's loop applied the in-flight step's output first, which completed the prefill store and released the
request's connector state). Under async scheduling the stored block 1 ends at an EOS whose slot the step in
flight did compute: the oracle fails by upstream's rule (never store a block ending at the final sampled token),
kvdoctor's former K4 recipe (an EOS too) measured not_reproduced there; a request ending at max_tokens gets no
step in flight and reproduces K4 under async (the built-in recipe now).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import sys
import tempfile
from typing import Any

BLOCK = 4
GPU_BLOCKS = 10
EOS = 2  # the tiny model's eos_token_id below
LAYER = "model.layers.0.self_attn.attn"
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 1, "vocab_size": 1024,
          "max_position_embeddings": 256, "eos_token_id": EOS, "bos_token_id": 1, "torch_dtype": "float16"}


def kv_cache_tensor(cls: Any, size: int, page: int) -> Any:
    """`KVCacheTensor(size, shared_by)` until 0.32; layout fields from 0.33 (a field probe)."""
    names = {f.name for f in dataclasses.fields(cls)}
    if "shared_by" in names:
        return cls(size=size, shared_by=[LAYER])
    return cls(size=size, layers=[LAYER], layer_stride=size, block_stride=page)


def build(async_scheduling: bool, model_dir: str) -> Any:
    import torch
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
    from vllm.v1.structured_output import StructuredOutputManager

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float32)
    page = spec.page_size_bytes
    config = VllmConfig(
        model_config=ModelConfig(model=model_dir, skip_tokenizer_init=True, max_model_len=64, dtype="float16",
                                 seed=0),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1000, max_model_len=64,
                                         is_encoder_decoder=False, async_scheduling=async_scheduling),
        kv_transfer_config=KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                            kv_connector_extra_config={"cpu_bytes_to_use": page * 64,
                                                                       "block_size": BLOCK,
                                                                       "offload_prompt_only": False}),
        device_config=DeviceConfig("cpu"),
    )
    kv = KVCacheConfig(num_blocks=GPU_BLOCKS, kv_cache_tensors=[kv_cache_tensor(KVCacheTensor, page * GPU_BLOCKS,
                                                                                page)],
                       kv_cache_groups=[KVCacheGroupSpec([LAYER], spec)])
    config.cache_config.num_gpu_blocks = GPU_BLOCKS
    cls = AsyncScheduler if async_scheduling else Scheduler
    return cls(vllm_config=config, kv_cache_config=kv, log_stats=True,
               structured_output_manager=StructuredOutputManager(config), block_size=BLOCK)


def play(async_scheduling: bool, offset: int, model_dir: str,
         engine_order: bool = False) -> tuple[list[int], list[int]]:
    """Upstream's RequestRunner._run loop for decoded_tokens=[EOS], then its drain: the stored block indices; and
    those after one more schedule() (the engine's next step, when another request arrives).

    engine_order: under async scheduling, that next schedule() comes before the in-flight step's output is
    applied, as EngineCore's batch queue orders them (upstream's loop applies it first, "sample last token")."""
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import Request

    sched = build(async_scheduling, model_dir)
    init_none_hash(sha256)
    params = SamplingParams(max_tokens=1000)
    params.update_from_generation_config({}, EOS)
    req = Request(request_id="0", prompt_token_ids=[0] * (2 * BLOCK + offset), sampling_params=params,
                  pooling_params=None, block_hasher=get_request_block_hasher(BLOCK, sha256))
    sched.add_request(req)
    takes_index = "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}
    stored: set[int] = set()
    in_flight: list[int] = []
    block_index: dict[int, int] = {}

    def worker(out: Any, token: int | None, running: bool = True) -> Any:
        for blocks in sched.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks.values():
            for i, block in enumerate(blocks):
                block_index[block.block_id] = i
        meta = out.kv_connector_metadata
        if os.environ.get("K4_ORACLE_DEBUG"):
            print(f"  step: scheduled={dict(out.num_scheduled_tokens)} finished={sorted(out.finished_req_ids)} "
                  f"stores={ {j: [int(b) for b in t.src_spec.block_ids] for j, t in meta.store_jobs.items()} } "
                  f"requests={list(sched.requests)} req.num_tokens={req.num_tokens} "
                  f"computed={req.num_computed_tokens} status={req.status.name}", flush=True)
        done = OffloadingWorkerMetadata()
        for job_id in in_flight:  # vLLM's worker submits a step's stores at the next step's start (PR #31341)
            done.mark_completed(job_id)
        in_flight.clear()
        for job_id, job in meta.store_jobs.items():
            stored.update(block_index[int(b)] for b in job.src_spec.block_ids)
            in_flight.append(job_id)
        for job_id in meta.load_jobs:
            done.mark_completed(job_id)
        ids = [r.request_id for r in sched.running] if running else []
        kwargs: dict[str, Any] = {"req_ids": ids, "sampled_token_ids": [[token or 0] for _ in ids],
                                  "kv_connector_output": KVConnectorOutput(kv_connector_worker_meta=done)}
        if takes_index:
            kwargs["req_id_to_index"] = {r: i for i, r in enumerate(ids)}
        return ModelRunnerOutput(**kwargs)

    tokens = iter([EOS])
    token = next(tokens, None)
    prev: tuple[Any, Any] | None = None
    while True:
        out = sched.schedule()
        result = worker(out, token)
        prev_token = token
        if sched.running:
            token = next(tokens, None)
        if async_scheduling:
            if prev is not None:
                sched.update_from_output(*prev)
            prev = (out, result)
        else:
            sched.update_from_output(out, result)
        if prev_token == EOS and prev_token != token and sched.requests:
            continue
        if token is None:
            if async_scheduling and prev is not None and not engine_order:
                sched.update_from_output(*prev)
            break
    if engine_order and async_scheduling and prev is not None:
        out = sched.schedule()  # the next step is scheduled while the last one is in flight
        result = worker(out, None, running=False)
        sched.update_from_output(*prev)
        sched.update_from_output(out, result)
    for _ in range(20):  # upstream's drain: schedule until the finished request's stores let it go
        if not sched.requests:
            break
        out = sched.schedule()
        sched.update_from_output(out, worker(out, None, running=False))
    upstream = sorted(stored)
    out = sched.schedule()  # the next step: a finished request's final store may be built only here
    sched.update_from_output(out, worker(out, None, running=False))
    return upstream, sorted(stored)


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout's SIGTERM still removes the temp dir
    root = tempfile.mkdtemp(prefix="k4-oracle-")
    model_dir = os.path.join(root, "model")  # the model directory holds config.json alone (0.30 validates it)
    os.makedirs(model_dir)
    os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(root, "vllm-cache"))  # leave ~/.cache/vllm alone
    import vllm

    try:
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(CONFIG, f)
        rows = []
        for async_scheduling in (False, True):
            for offset in (-1, -2):
                try:
                    stored, next_step = play(async_scheduling, offset, model_dir)
                    verdict = "PASS" if stored == [0] else "FAIL"
                    detail = (f"stored blocks {stored}; after one more schedule(): {next_step}, "
                              f"{'PASS' if next_step == [0] else 'FAIL'}")
                    if async_scheduling:
                        _, engine = play(async_scheduling, offset, model_dir, engine_order=True)
                        detail += f"; in the engine's order: {engine}, {'PASS' if engine == [0] else 'FAIL'}"
                except Exception as exc:  # an assertion inside vLLM is a failing test too
                    verdict, detail = "FAIL", f"{type(exc).__name__}: {exc}".splitlines()[0][:120]
                rows.append(verdict)
                mode = "async" if async_scheduling else "sync"
                print(f"vllm {vllm.__version__} {mode:5} prompt_offset={offset}: {verdict} ({detail})", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if all(v == "PASS" for v in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
