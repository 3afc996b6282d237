"""The simulated worker behind the seam: `SimulatedWorker`'s decisions as a KVConnectorOutput."""

from __future__ import annotations

from typing import Any

from kvdoctor.engine.worker import Job, SimulatedWorker
from kvdoctor.engine.workers.base import WorkerStep


class SimulatedTransfers(SimulatedWorker):
    """No bytes, no model: completes, holds or fails jobs on command (see SimulatedWorker)."""

    name = "simulated"

    def __init__(self, api: Any, load_latency_steps: int = 0) -> None:
        super().__init__(load_latency_steps)
        self.api = api

    def run_step(self, output: Any, new_jobs: list[Job], jobs_to_flush: set[int], step: int,
                 sampled: dict[str, list[int]]) -> WorkerStep:
        report = self.take_step(new_jobs, jobs_to_flush, step)
        meta = self.api.worker_metadata([job.job_id for job in report.completed],
                                        [job.job_id for job in report.failed])
        kv_output = self.api.kv_connector_output(meta, report.finished_recving, report.failed_loads,
                                                 report.invalid_block_ids)
        return WorkerStep(kv_output, [j.job_id for j in report.completed], [j.job_id for j in report.failed])

    def describe(self) -> str:
        return "simulated worker (bookkeeping only: no KV bytes, jobs complete on command)"

    def shutdown(self) -> None:
        pass
