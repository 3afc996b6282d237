"""The simulated worker standing in for several workers (`num_workers > 1`, as under tensor parallelism).

vLLM's offloading scheduler counts a transfer job done only when every worker (world_size of them)
has reported it (`TransferJobStatus.pending_count`), and the executor combines the workers' outputs
with `KVOutputAggregator` (completed-job counts summed, `finished_recving` per request counted to
world_size, `invalid_block_ids` unioned). Bugs hide where the workers disagree: one reports late, or
one fails a job the others finish. So each worker's report is built on its own and the outputs are
combined by vLLM's own aggregator, never by kvdoctor's arithmetic.
"""

from __future__ import annotations

from typing import Any

from kvdoctor.engine.worker import Job, WorkerReport
from kvdoctor.engine.workers.base import WorkerStep
from kvdoctor.engine.workers.simulated import SimulatedTransfers
from kvdoctor.errors import UsageError


class SeveralWorkers(SimulatedTransfers):
    """All workers run the same jobs; the last one reports `late_steps` later, and a failure can be one
    worker's alone (`fail(..., worker=i)`: that worker fails the job, the others complete it)."""

    name = "simulated"

    def __init__(self, api: Any, num_workers: int, late_steps: int = 0, load_latency_steps: int = 0) -> None:
        super().__init__(api, load_latency_steps)
        self.num_workers = num_workers
        self.late_steps = late_steps
        self._aggregator = api.kv_output_aggregator(num_workers)
        if self._aggregator is None:
            raise UsageError("num_workers > 1: this vLLM has no KVOutputAggregator to combine the workers' "
                             "outputs with; run it with num_workers = 1")
        self._fail_on: dict[int, int] = {}  # job id -> the one worker that fails it
        self._late: list[tuple[int, WorkerReport]] = []  # (due step, the late worker's report)
        self._reports_left: dict[int, int] = {}  # job id -> workers that have not reported it
        self._any_failed: set[int] = set()

    def fail(self, request: str | None = None, kind: str | None = None, worker: int | None = None) -> list[int]:
        if worker is not None and not 0 <= worker < self.num_workers:
            raise UsageError(f"fail_transfers worker = {worker}: the setup has workers 0..{self.num_workers - 1}")
        chosen = super().fail(request, kind)
        if worker is not None:
            for jid in chosen:
                self._fail_on[jid] = worker
        return chosen

    def _report_of(self, worker: int, report: WorkerReport) -> WorkerReport:
        """What `worker` reports of the jobs the step decided on."""
        failed = [j for j in report.failed if self._fail_on.get(j.job_id, worker) == worker]
        ok = report.completed + [j for j in report.failed if j not in failed]
        return WorkerReport(completed=ok, failed=failed)

    def run_step(self, output: Any, new_jobs: list[Job], jobs_to_flush: set[int], step: int,
                 sampled: dict[str, list[int]]) -> WorkerStep:
        report = self.take_step(new_jobs, jobs_to_flush, step)
        for job in report.completed + report.failed:
            self._reports_left.setdefault(job.job_id, self.num_workers)
        reports = [self._report_of(w, report) for w in range(self.num_workers)]
        if self.late_steps:
            self._late.append((step + self.late_steps, reports[-1]))
            due = [r for at, r in self._late if at <= step]
            self._late = [(at, r) for at, r in self._late if at > step]
            reports[-1] = WorkerReport(completed=[j for r in due for j in r.completed],
                                       failed=[j for r in due for j in r.failed])
        kv_outputs = []
        done: list[int] = []
        failed: list[int] = []
        for r in reports:
            meta = self.api.worker_metadata([j.job_id for j in r.completed], [j.job_id for j in r.failed])
            kv_outputs.append(self.api.kv_connector_output(meta, r.finished_recving, r.failed_loads,
                                                           r.invalid_block_ids))
            self._any_failed.update(j.job_id for j in r.failed)
            for job in r.completed + r.failed:
                left = self._reports_left.get(job.job_id)
                if left is None:
                    continue
                if left > 1:
                    self._reports_left[job.job_id] = left - 1
                    continue
                del self._reports_left[job.job_id]
                (failed if job.job_id in self._any_failed else done).append(job.job_id)
                self._any_failed.discard(job.job_id)
                self._fail_on.pop(job.job_id, None)
        combined = self.api.aggregate_kv_outputs(self._aggregator, kv_outputs)
        return WorkerStep(combined, done, failed)

    def describe(self) -> str:
        late = f", the last {self.late_steps} step(s) late" if self.late_steps else ""
        return (f"simulated worker standing in for {self.num_workers} workers{late} (outputs combined by "
                f"vLLM's KVOutputAggregator; bookkeeping only)")
