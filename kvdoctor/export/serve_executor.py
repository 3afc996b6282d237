"""The stand-in Executor of a script exported with `--export-script FILE --engine serve`.

vLLM only: the exported script writes this file (with the adapter's `portable` reads copied in)
into the stand-in package beside itself, and `vllm serve` loads it by its qualified name
(`--distributed-executor-backend kvrepro_standin.executor.StandInExecutor`). It stands where the
GPU workers run: no model; one decode token sampled per request that finished its prefill (no EOS:
requests end at max_tokens); every KV transfer the OffloadingConnector issues completes on the step
it is issued. Everything on the scheduler side (the Scheduler, the connector's scheduler side, the
CPU manager) is vLLM's own. Each step sleeps KVREPRO_STEP_SECONDS, so that client traffic lands
between engine steps, and logs one line (`kvdoctor-engine step N: {...}`) saying what was scheduled
and finished: the script reads it to tell whether an aborted request was still queued.
kvdoctor's own `--engine serve` runs the same contract (kvdoctor/engine/core/executor.py).
"""

import json
import os
import time
from collections import deque
from concurrent.futures import Future

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
from vllm.logger import init_logger
from vllm.v1.executor.abstract import Executor
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

# The adapter's vLLM-only reads and feature probes; an export copies their one definition in here.
from kvdoctor.engine.compat.portable import default_kv_cache_layouts, runner_output_takes_req_id_to_index

logger = init_logger("vllm.kvrepro.executor")  # under "vllm": the server's own log handler
STEP_LOG_PREFIX = "kvdoctor-engine step"
DECODE_TOKEN = 7


def _done(value):
    future = Future()
    future.set_result(value)
    return future


class StandInExecutor(Executor):
    uses_ray = False
    supports_pp = False

    @classmethod
    def supports_async_scheduling(cls):
        return True

    def _init_executor(self):
        self.step_seconds = float(os.environ.get("KVREPRO_STEP_SECONDS", "0") or 0)
        admission = os.environ.get("KVREPRO_ADMISSION_LEN")
        self.admission_len = int(admission) if admission else None
        self.original_len = None
        self.to_sample = deque()
        self.num_tokens = {}
        self.steps = 0

    # -- start-up ---------------------------------------------------------------------------
    def get_kv_cache_specs(self):
        """One full-attention spec per decoder layer of the tiny model config. The pool is deliberately
        tiny (--num-gpu-blocks-override): vLLM's start-up check that one max_model_len request fits runs
        with KVREPRO_ADMISSION_LEN, restored before the scheduler is built."""
        mc, pc = self.vllm_config.model_config, self.vllm_config.parallel_config
        if self.admission_len is not None:
            self.original_len = mc.max_model_len
            mc.max_model_len = min(self.original_len, self.admission_len)
        spec = FullAttentionSpec(block_size=self.vllm_config.cache_config.block_size,
                                 num_kv_heads=mc.get_num_kv_heads(pc), head_size=mc.get_head_size(), dtype=mc.dtype)
        return [{f"model.layers.{i}.self_attn.attn": spec for i in range(mc.get_num_layers(pc))}]

    def determine_available_memory(self):
        return [1 << 40]  # --num-gpu-blocks-override decides the pool

    def initialize_from_config(self, kv_cache_configs):
        if self.original_len is not None:
            self.vllm_config.model_config.max_model_len = self.original_len
            self.original_len = None

    def check_health(self):
        return None

    def shutdown(self):
        return None

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None, non_block=False, **_):
        """Everything else EngineCore asks of 'all workers': one answer per worker (one here)."""
        kwargs = kwargs or {}
        if callable(method):
            results = [method(self, *args, **kwargs)]
        else:
            handler = getattr(self, f"rpc_{method}", None)
            results = handler(*args, **kwargs) if handler is not None else [None]
        return _done(results) if non_block else results

    def rpc_get_supported_tasks(self):
        return [("generate",)]

    def rpc_get_kv_connector_handshake_metadata(self):
        return []  # the OffloadingConnector has no handshake

    def rpc_compile_or_warm_up_model(self):
        return []  # 0.27+: no CompilationTimes

    def rpc_get_supported_kv_cache_layouts(self):
        return [default_kv_cache_layouts()]  # 0.33+

    def rpc_extensible_kv_cache_unsupported_reason(self):
        return ["the stand-in executor measures no device memory"]  # 0.34: the extensible KV cache stays off

    # -- one step ---------------------------------------------------------------------------
    def execute_model(self, scheduler_output, non_block=False):
        """As vLLM's GPU model runner: with tokens scheduled the output waits for `sample_tokens`."""
        output = self.run_step(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens > 0:
            self.to_sample.append(output)
            output = None
        return _done(output) if non_block else output

    def sample_tokens(self, grammar_output, non_block=False):
        output = self.to_sample.popleft()
        return _done(output) if non_block else output

    def take_draft_token_ids(self):
        return None

    def run_step(self, so):
        self.steps += 1
        if self.step_seconds:
            time.sleep(self.step_seconds)
        computed = {}
        for new in so.scheduled_new_reqs:
            tokens = getattr(new, "prefill_token_ids", None) or new.prompt_token_ids or ()
            self.num_tokens[new.req_id] = len(tokens)
            computed[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            computed[req_id] = cached.num_computed_tokens[i]
        req_ids = list(so.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            after = computed.get(req_id, 0) + so.num_scheduled_tokens[req_id]
            known = self.num_tokens.get(req_id, after)
            if after >= known:  # prefill done: one token sampled
                self.num_tokens[req_id] = known + 1
                sampled.append([DECODE_TOKEN])
            else:
                sampled.append([])
        for req_id in so.finished_req_ids or ():
            self.num_tokens.pop(req_id, None)
        logger.info("%s %d: %s", STEP_LOG_PREFIX, self.steps, json.dumps({
            "scheduled": dict(so.num_scheduled_tokens), "finished": sorted(so.finished_req_ids or ())}))
        kwargs = {"req_ids": req_ids, "sampled_token_ids": sampled, "kv_connector_output": self.transfers(so)}
        if runner_output_takes_req_id_to_index(ModelRunnerOutput):
            kwargs["req_id_to_index"] = {rid: i for i, rid in enumerate(req_ids)}
        return ModelRunnerOutput(**kwargs)

    @staticmethod
    def transfers(so):
        """What the worker-role OffloadingConnector reports when every transfer finishes at once."""
        meta = getattr(so, "kv_connector_metadata", None)
        if meta is None:
            return None
        store_jobs = dict(getattr(meta, "store_jobs", None) or {})
        load_jobs = dict(getattr(meta, "load_jobs", None) or {})
        worker_meta = OffloadingWorkerMetadata()
        for job_id in list(store_jobs) + list(load_jobs):
            worker_meta.mark_completed(job_id)
        finished_recving = {job.req_id for job in load_jobs.values()}
        return KVConnectorOutput(finished_recving=finished_recving or None, kv_connector_worker_meta=worker_meta)
