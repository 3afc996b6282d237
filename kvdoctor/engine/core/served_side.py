"""The worker side of kvdoctor's executor inside a `vllm serve` child (`--engine serve`).

No harness exists there: the stand-in executor's own stepping decides who samples and logs each step
(`standin_executor.StandInExecutor.step_output`); this side decides what each request samples and
(EOS where the client asked for it, `StandInExecutor.choose_token`); this side replaces every other
sampled token and reports the KV transfers the OffloadingConnector issued:

- the token: the stand-in model's answer (`tiny_model.answer_of`). With vLLM's worker
  (`KVDOCTOR_ENGINE_WORKER=vllm`: the worker-role OffloadingConnector on fingerprint KV tensors and
  kvdoctor's copy engine, as `--engine core` runs it) the toy model reads it from the KV bytes the
  request's attention reads; otherwise it is the tokens' own (`ContextKeys`: what right KV gives, the
  answer of an engine without offloading);
- the transfers: the vLLM worker's copies, or the simulated worker's (each completes when issued).
"""

from __future__ import annotations

import os
from typing import Any

from kvdoctor.engine import compat
from kvdoctor.engine.core.names import WORKER_ENV
from kvdoctor.engine.step_loop import EOS_TOKEN
from kvdoctor.engine.tiny_model import ContextKeys
from kvdoctor.engine.worker import Job
from kvdoctor.engine.workers.simulated import SimulatedTransfers


class ServedSide:
    def __init__(self, vllm_config: Any, kv_cache_config: Any) -> None:
        self.api = compat.load()
        self.connector = vllm_config.kv_transfer_config is not None
        self.tokens: dict[str, list[int]] = {}  # each request's tokens, as a model runner keeps them
        self.context_keys = ContextKeys()
        self.worker: Any = None
        if self.connector and os.environ.get(WORKER_ENV) == "vllm":
            from kvdoctor.engine.workers.vllm_worker import VllmWorker

            view = self.api.served_scheduler_view(vllm_config, kv_cache_config)
            self.worker = VllmWorker(self.api, view, "cpu", self.api.served_model_runner(vllm_config))
        elif self.connector:
            self.worker = SimulatedTransfers(self.api)

    def admit(self, output: Any) -> None:
        """The step's new (and resumed) requests: their tokens, as a model runner keeps them."""
        for new in output.scheduled_new_reqs:
            prompt = list(getattr(new, "prefill_token_ids", None) or new.prompt_token_ids or ())
            known = self.tokens.get(new.req_id, [])
            self.tokens[new.req_id] = known if known[:len(prompt)] == prompt and len(known) > len(prompt) else prompt

    def transfers(self, output: Any, sampled: dict[str, list[int]], step: int) -> Any:
        """The step's answers (into `sampled`) and its KVConnectorOutput (None without a connector)."""
        if self.worker is None or self.worker.name != "vllm":
            for req_id, tokens in sampled.items():
                if tokens and tokens[-1] != EOS_TOKEN and req_id in self.tokens:
                    known = self.tokens[req_id]
                    tokens[-1], _ = self.context_keys.answer(req_id, known, len(known))
        kv_output = None
        if self.worker is not None:
            stores, loads = self.api.store_and_load_jobs(output)
            metas = self.api.connector_metadatas(output)
            flush = self.api.jobs_to_flush(metas[0]) if metas else set()
            jobs = [Job(jid, job.req_id, "store", step,
                        src_block_ids=self.api.block_ids_of(getattr(job, "src_spec", None)))
                    for jid, job in stores.items()]
            for jid, job in loads.items():
                dst_spec = getattr(job, "dst_spec", None)
                jobs.append(Job(jid, job.req_id, "load", step, self.api.block_ids_of(dst_spec),
                                dst_groups=self.api.block_ids_by_group(dst_spec), sync=self.api.load_is_sync(job)))
            kv_output = self.worker.run_step(output, jobs, flush, step, sampled).kv_connector_output
        for req_id, tokens in sampled.items():
            if req_id in self.tokens:
                self.tokens[req_id].extend(tokens)
        for req_id in output.finished_req_ids or ():
            self.tokens.pop(req_id, None)
        return kv_output

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
