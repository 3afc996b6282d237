"""The worker side of kvdoctor's executor inside a `vllm serve` child (`--engine serve`).

No harness exists there: the stand-in executor's own stepping decides who samples and logs each step
(`standin_executor.StandInExecutor.step_output`); this side decides what each request samples and
(EOS where the client asked for it, `StandInExecutor.choose_token`); this side replaces every other
sampled token and reports the KV transfers the OffloadingConnector issued:

- the token: the stand-in model's answer (`answer_key.answer_of`). With vLLM's worker
  (`KVDOCTOR_ENGINE_WORKER=vllm`: the worker-role OffloadingConnector on fingerprint KV tensors and
  kvdoctor's copy engine, as `--engine core` runs it) the toy model reads it from the KV bytes the
  request's attention reads; otherwise it is the tokens' own (`ContextKeys`: what right KV gives, the
  answer of an engine without offloading);
- the transfers: the vLLM worker's copies, or the simulated worker's (each completes when issued).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from kvdoctor.engine import compat
from kvdoctor.engine.core.names import UNANSWERED_LOG_PREFIX, WORKER_ENV
from kvdoctor.engine.step_loop import EOS_TOKEN
from kvdoctor.engine.tiny_model import ContextKeys
from kvdoctor.engine.worker import Job
from kvdoctor.engine.workers.simulated import SimulatedTransfers


class ServedSide:
    def __init__(self, vllm_config: Any, kv_cache_config: Any, plan: list[dict[str, Any]] | None = None) -> None:
        self.api = compat.load()
        # the recipe's transfer steps, played on its schedule (levels/serve.executor_plan): by engine step
        self.plan = sorted((e for e in plan or () if e["action"] in ("hold", "complete", "fail")),
                           key=lambda e: int(e["step"]))
        self.names = {e["tag"]: e["request"] for e in plan or () if e.get("tag")}  # request id part -> recipe name
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
            for job in jobs:  # the recipe's name for its request, as the plan's holds name it
                job.req_id = next((name for tag, name in self.names.items() if tag in job.req_id), job.req_id)
            self.play_plan(step)
            model = getattr(self.worker, "model", None)  # vLLM's worker: the toy model answers from the KV bytes
            for req_id in sampled:
                if model is not None:
                    model.logprobs.pop(req_id, None)
            kv_output = self.worker.run_step(output, jobs, flush, step, sampled).kv_connector_output
            if model is not None:
                self.report_unanswered(model, sampled, step)
        for req_id, tokens in sampled.items():
            if req_id in self.tokens:
                self.tokens[req_id].extend(tokens)
        for req_id in output.finished_req_ids or ():
            self.tokens.pop(req_id, None)
        return kv_output

    @staticmethod
    def report_unanswered(model: Any, sampled: dict[str, list[int]], step: int) -> None:
        """A sampled token the toy model did not answer (it keeps the stand-in's placeholder) is kvdoctor's
        failure, never a client's wrong answer: one log line the serve level reads (`UNANSWERED_LOG_PREFIX`)."""
        missed = sorted(rid for rid, tokens in sampled.items()
                        if tokens and tokens[-1] != EOS_TOKEN and rid not in model.logprobs)
        if missed:
            print(f"{UNANSWERED_LOG_PREFIX} {step}: {json.dumps(missed)}", file=sys.stderr, flush=True)

    def play_plan(self, step: int) -> None:
        """The plan's transfer steps due by this engine step, in order, as the recipe's steps play them on
        kvdoctor's worker (`steps.py`: hold_transfers, complete_transfers, fail_transfers)."""
        while self.plan and int(self.plan[0]["step"]) <= step:
            entry = self.plan.pop(0)
            getattr(self.worker, entry["action"])(entry["request"], entry["kind"])

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
