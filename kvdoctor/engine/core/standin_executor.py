"""`StandInExecutor`: a vLLM `Executor` that stands where the GPU workers run (vLLM only).

The one definition of the executor's answers to `EngineCore` (KV specs, memory,
`initialize_from_config`, the RPCs of each release, `execute_model` / `sample_tokens`), used two
ways, so the two can never drift apart:

- kvdoctor's own `KvdoctorExecutor` (kvdoctor/engine/core/executor.py) subclasses it and hands each
  step to kvdoctor's worker side (the in-process harness, or its simulated worker in a serve child);
- a script exported with `--export-script FILE --engine serve` embeds this file verbatim (with the
  adapter's `portable` reads copied in) as the stand-in package beside itself, and `vllm serve` loads
  it by its qualified name (`--distributed-executor-backend kvrepro_standin.executor.StandInExecutor`).
  This file therefore imports only vLLM and the standard library (`tests/test_engine_export.py`).

Standing alone it runs no model: one decode token is sampled per request that finished its prefill
(EOS only where the client's `vllm_xargs` asked for it, else requests end at max_tokens), and every
KV transfer the OffloadingConnector issues completes on the step it is issued. Everything on the
scheduler side (the Scheduler, the connector's scheduler side, the CPU manager) is vLLM's own. Each
step sleeps `STEP_SECONDS_ENV` seconds, so that client traffic lands between engine steps, and logs
one line (`kvdoctor-engine step N: {...}`) saying what was scheduled and finished: the client reads
it to tell whether an aborted request was still queued.
As vLLM's GPU model runner, `execute_model` returns None when tokens were scheduled and the output
comes from `sample_tokens`: `EngineCore.step` and `step_with_batch_queue` rely on that.
"""

import json
import os
import time
from collections import deque
from concurrent.futures import Future
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
from vllm.logger import init_logger
from vllm.v1.executor.abstract import Executor
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

# The adapter's vLLM-only reads and feature probes; an export copies their one definition in here.
from kvdoctor.engine.compat.portable import default_kv_cache_layouts, runner_output_takes_req_id_to_index

logger = init_logger("vllm.kvrepro.executor")  # under "vllm": the server's own log handler
STEP_LOG_PREFIX = "kvdoctor-engine step"  # the serve client reads it (serve_client.py; tests check both agree)
DECODE_TOKEN = 7
EOS_TOKEN = 2  # kvdoctor's stop token (step_loop.EOS_TOKEN): its clients send it as their stop_token_ids
EOS_AFTER_ARG = "kvdoctor_eos_after"  # a request's vllm_xargs: its (N+1)-th sampled token is EOS (names.py)


def _done(value: Any) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_result(value)
    return future


def _failed(exc: BaseException) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_exception(exc)
    return future


class StandInExecutor(Executor):
    uses_ray = False
    supports_pp = False
    STEP_SECONDS_ENV = "KVREPRO_STEP_SECONDS"  # pace the steps so client events land between them
    ADMISSION_ENV = "KVREPRO_ADMISSION_LEN"  # the max_model_len of the start-up admission check
    NO_MEMORY_REASON = "the stand-in executor measures no device memory"

    @classmethod
    def supports_async_scheduling(cls) -> bool:
        return True

    def _init_executor(self) -> None:
        self.step_seconds = float(os.environ.get(self.STEP_SECONDS_ENV, "0") or 0)
        admission = os.environ.get(self.ADMISSION_ENV)
        self.admission_len = int(admission) if admission else None
        self.original_len: int | None = None
        self.to_sample: deque[Any] = deque()
        self.num_tokens: dict[str, int] = {}
        self.eos_after: dict[str, int] = {}  # request -> sampled tokens before its EOS (its client's vllm_xargs)
        self.num_sampled: dict[str, int] = {}
        self.steps = 0

    # -- start-up ---------------------------------------------------------------------------
    def get_kv_cache_specs(self) -> list[dict[str, Any]]:
        """The pool is deliberately tiny (--num-gpu-blocks-override): vLLM's start-up check that one
        max_model_len request fits runs with `admission_len`, restored before the scheduler is built."""
        if self.admission_len is not None:
            model_config = self.vllm_config.model_config
            self.original_len = model_config.max_model_len
            model_config.max_model_len = min(self.original_len, self.admission_len)
        return [self.layer_specs()]

    def layer_specs(self) -> dict[str, Any]:
        """One full-attention spec per decoder layer of the model config (the tiny Llama)."""
        mc, pc = self.vllm_config.model_config, self.vllm_config.parallel_config
        spec = FullAttentionSpec(block_size=self.vllm_config.cache_config.block_size,
                                 num_kv_heads=mc.get_num_kv_heads(pc), head_size=mc.get_head_size(), dtype=mc.dtype)
        return {f"model.layers.{i}.self_attn.attn": spec for i in range(mc.get_num_layers(pc))}

    def determine_available_memory(self) -> list[int]:
        return [1 << 40]  # --num-gpu-blocks-override decides the pool

    def initialize_from_config(self, kv_cache_configs: Any) -> None:
        if self.original_len is not None:
            self.vllm_config.model_config.max_model_len = self.original_len
            self.original_len = None

    def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        return None

    def collective_rpc(self, method: Any, timeout: float | None = None, args: tuple[Any, ...] = (),
                       kwargs: dict[str, Any] | None = None, non_block: bool = False, **_: Any) -> Any:
        """Everything else EngineCore asks of 'all workers': one answer per worker (one here). A method
        `rpc_<name>` gives the answers that matter; any other call is answered None."""
        kwargs = kwargs or {}
        if callable(method):
            results = [method(self, *args, **kwargs)]
        else:
            handler = getattr(self, f"rpc_{method}", None)
            results = handler(*args, **kwargs) if handler is not None else [None]
        return _done(results) if non_block else results

    def rpc_get_supported_tasks(self) -> list[tuple[str, ...]]:
        return [("generate",)]

    def rpc_get_kv_connector_handshake_metadata(self) -> list[Any]:
        return []  # the OffloadingConnector has no handshake

    def rpc_compile_or_warm_up_model(self) -> list[Any]:
        return []  # 0.27+: no CompilationTimes (the list is read only when non-empty)

    def rpc_get_supported_kv_cache_layouts(self) -> list[list[str]]:
        """0.33+: each worker's KV layouts, most preferred first: what the connector requires, then vLLM's."""
        return [default_kv_cache_layouts()]

    def rpc_extensible_kv_cache_unsupported_reason(self) -> list[str]:
        return [self.NO_MEMORY_REASON]  # 0.34: the extensible KV cache stays off

    # -- one step ---------------------------------------------------------------------------
    def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Any:
        try:
            output = self.run_step(scheduler_output)
        except Exception as exc:  # the engine sees it where a GPU worker's error surfaces
            if non_block:
                return _failed(exc)
            raise
        if scheduler_output.total_num_scheduled_tokens > 0:
            self.to_sample.append(output)
            output = None
        return _done(output) if non_block else output

    def sample_tokens(self, grammar_output: Any, non_block: bool = False) -> Any:
        output = self.to_sample.popleft()
        return _done(output) if non_block else output

    def take_draft_token_ids(self) -> None:
        return None

    def run_step(self, so: Any) -> Any:
        self.steps += 1
        if self.step_seconds:
            time.sleep(self.step_seconds)
        return self.step_output(so)

    def step_output(self, so: Any) -> Any:
        """One decode token for each request that has computed all its known tokens; the step's log line;
        the transfers' report (`transfers`)."""
        computed: dict[str, int] = {}
        for new in so.scheduled_new_reqs:
            tokens = getattr(new, "prefill_token_ids", None) or new.prompt_token_ids or ()
            self.num_tokens[new.req_id] = len(tokens)
            computed[new.req_id] = new.num_computed_tokens
            extra = getattr(getattr(new, "sampling_params", None), "extra_args", None) or {}
            if EOS_AFTER_ARG in extra:
                self.eos_after[new.req_id] = int(extra[EOS_AFTER_ARG])
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            computed[req_id] = cached.num_computed_tokens[i]
        req_ids = list(so.num_scheduled_tokens)
        sampled: dict[str, list[int]] = {}
        for req_id in req_ids:
            after = computed.get(req_id, 0) + so.num_scheduled_tokens[req_id]
            known = self.num_tokens.get(req_id, after)
            if after >= known:  # prefill done: one token sampled
                self.num_tokens[req_id] = known + 1
                sampled[req_id] = [self.choose_token(req_id)]
            else:
                sampled[req_id] = []
        for req_id in so.finished_req_ids or ():
            for table in (self.num_tokens, self.eos_after, self.num_sampled):
                table.pop(req_id, None)
        kv_output = self.transfers(so, sampled)
        logger.info("%s %d: %s", STEP_LOG_PREFIX, self.steps, json.dumps({
            "scheduled": dict(so.num_scheduled_tokens), "finished": sorted(so.finished_req_ids or ())}))
        kwargs = {"req_ids": req_ids, "sampled_token_ids": [sampled[r] for r in req_ids],
                  "kv_connector_output": kv_output}
        if runner_output_takes_req_id_to_index(ModelRunnerOutput):
            kwargs["req_id_to_index"] = {rid: i for i, rid in enumerate(req_ids)}
        return ModelRunnerOutput(**kwargs)

    def choose_token(self, req_id: str) -> int:
        """The token a request samples once its prefill is done: EOS where its client asked for it
        (`EOS_AFTER_ARG`), else DECODE_TOKEN (kvdoctor's executor replaces it by the stand-in model's answer
        in `transfers`)."""
        count = self.num_sampled.get(req_id, 0)
        self.num_sampled[req_id] = count + 1
        return EOS_TOKEN if self.eos_after.get(req_id) == count else DECODE_TOKEN

    def transfers(self, so: Any, sampled: dict[str, list[int]]) -> Any:
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
