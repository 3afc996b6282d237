"""The worker side of kvdoctor's executor inside a `vllm serve` child (`--engine serve`).

No harness exists there: kvdoctor's simulated worker completes every transfer when issued, and
each request that has computed all its known tokens samples a decode token (no model, no EOS:
requests end at max_tokens). One log line per step (`kvdoctor-engine step N: ...`) records what
was scheduled and finished, so the client can tell from the server's own log whether an aborted
request was still queued when its abort landed."""

from __future__ import annotations

import json
from typing import Any

from kvdoctor.engine import compat
from kvdoctor.engine.harness import DECODE_TOKEN
from kvdoctor.engine.worker import Job

STEP_LOG_PREFIX = "kvdoctor-engine step"


class StandaloneSide:
    def __init__(self, vllm_config: Any) -> None:
        from vllm.logger import init_logger

        from kvdoctor.engine.workers.simulated import SimulatedTransfers

        self.api = compat.load()
        self.logger = init_logger("vllm.kvdoctor.executor")  # under "vllm": the server's log handler
        self.worker = SimulatedTransfers(self.api)
        self.num_tokens: dict[str, int] = {}
        self.step_index = 0
        self.connector = vllm_config.kv_transfer_config is not None

    def step(self, output: Any) -> Any:
        self.step_index += 1
        computed: dict[str, int] = {}
        for new in output.scheduled_new_reqs:
            self.num_tokens[new.req_id] = len(self.api.scheduled_new_tokens(new))
            computed[new.req_id] = new.num_computed_tokens
        cached = output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            computed[req_id] = cached.num_computed_tokens[i]
        sampled: dict[str, list[int]] = {}
        for req_id, count in output.num_scheduled_tokens.items():
            after = computed.get(req_id, 0) + count
            known = self.num_tokens.get(req_id, after)
            if after >= known:  # prefill done: one token sampled
                self.num_tokens[req_id] = known + 1
                sampled[req_id] = [DECODE_TOKEN]
            else:
                sampled[req_id] = []
        for req_id in output.finished_req_ids or ():
            self.num_tokens.pop(req_id, None)
        kv_output = None
        if self.connector:
            stores, loads = self.api.store_and_load_jobs(output)
            metas = self.api.connector_metadatas(output)
            flush = set(getattr(metas[0], "jobs_to_flush", None) or ()) if metas else set()
            jobs = [Job(jid, job.req_id, "store", self.step_index,
                        src_block_ids=self.api.block_ids_of(getattr(job, "src_spec", None)))
                    for jid, job in stores.items()]
            jobs += [Job(jid, job.req_id, "load", self.step_index,
                         self.api.block_ids_of(getattr(job, "dst_spec", None)))
                     for jid, job in loads.items()]
            kv_output = self.worker.run_step(output, jobs, flush, self.step_index, sampled).kv_connector_output
        self.logger.info("%s %d: %s", STEP_LOG_PREFIX, self.step_index, json.dumps({
            "scheduled": dict(output.num_scheduled_tokens), "finished": sorted(output.finished_req_ids or ())}))
        req_ids = list(output.num_scheduled_tokens)
        return self.api.model_runner_output(req_ids, [sampled[r] for r in req_ids], kv_output)

    def shutdown(self) -> None:
        self.worker.shutdown()
