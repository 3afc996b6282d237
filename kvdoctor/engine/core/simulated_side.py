"""The transfers of kvdoctor's executor inside a `vllm serve` child (`--engine serve`).

No harness exists there: the stand-in executor's own stepping samples the tokens and logs each
step (`standin_executor.StandInExecutor.step_output`), and kvdoctor's simulated worker reports the
KV transfers the OffloadingConnector issued (each completes when issued)."""

from __future__ import annotations

from typing import Any

from kvdoctor.engine import compat
from kvdoctor.engine.worker import Job
from kvdoctor.engine.workers.simulated import SimulatedTransfers


class SimulatedSide:
    def __init__(self, vllm_config: Any) -> None:
        self.api = compat.load()
        self.worker = SimulatedTransfers(self.api)
        self.connector = vllm_config.kv_transfer_config is not None

    def transfers(self, output: Any, sampled: dict[str, list[int]], step: int) -> Any:
        """The step's KVConnectorOutput (None without a connector)."""
        if not self.connector:
            return None
        stores, loads = self.api.store_and_load_jobs(output)
        metas = self.api.connector_metadatas(output)
        flush = set(getattr(metas[0], "jobs_to_flush", None) or ()) if metas else set()
        jobs = [Job(jid, job.req_id, "store", step, src_block_ids=self.api.block_ids_of(getattr(job, "src_spec", None)))
                for jid, job in stores.items()]
        jobs += [Job(jid, job.req_id, "load", step, self.api.block_ids_of(getattr(job, "dst_spec", None)))
                 for jid, job in loads.items()]
        return self.worker.run_step(output, jobs, flush, step, sampled).kv_connector_output

    def shutdown(self) -> None:
        self.worker.shutdown()
