"""kvdoctor's stand-in for the GPU worker: it completes, holds or fails transfer jobs.

vLLM's scheduler side learns about transfers only through the worker's output
(`OffloadingWorkerMetadata.completed_jobs`, `finished_recving` for loads,
`invalid_block_ids` for failed loads). This class decides, per job, what that
output says, the way a real worker would but on command. Jobs named in
`jobs_to_flush` complete in the step that flushes them, as the real worker
waits for them.

The one definition of the simulated worker: the harness runs it (`workers/simulated.py`), and a
script exported with `--export-script` gets this module's code copied in on export
(`compat.inline_portable`). Hence no kvdoctor import, no vLLM import and no `from __future__` here.
"""

from dataclasses import dataclass, field


@dataclass
class Job:
    job_id: int
    req_id: str
    kind: str  # "store" | "load"
    issued_step: int
    dst_block_ids: tuple[int, ...] = ()  # loads: the GPU blocks written (all groups: they share one pool)
    src_block_ids: tuple[int, ...] = ()  # stores: the GPU blocks read
    dst_groups: tuple[tuple[int, ...], ...] = ()  # loads: the same blocks, per KV cache group
    # A sync load (vLLM 0.33+, `sync_load_budget_bytes`): vLLM's worker waits for it within the step that
    # issued it and reports no finished_recving for it (its request already runs this step).
    sync: bool = False


@dataclass
class Rule:
    """Which jobs a hold applies to: a request (None = any) and a kind (None = any)."""

    request: str | None = None
    kind: str | None = None

    def matches(self, job: Job) -> bool:
        return (self.request is None or job.req_id == self.request) and (
            self.kind is None or job.kind == self.kind
        )


@dataclass
class WorkerReport:
    """What the worker tells the scheduler after one step."""

    completed: list[Job] = field(default_factory=list)
    failed: list[Job] = field(default_factory=list)

    @property
    def finished_recving(self) -> set[str]:
        return {job.req_id for job in self.completed + self.failed if job.kind == "load" and not job.sync}

    @property
    def failed_loads(self) -> set[str]:
        return {job.req_id for job in self.failed if job.kind == "load"}

    @property
    def invalid_block_ids(self) -> set[int]:
        """The blocks failed loads left unwritten. vLLM takes one set of block ids (the groups share
        one pool); the null block (0) that sliding-window groups hold is never a load's target."""
        return {bid for job in self.failed if job.kind == "load" for bid in job.dst_block_ids if bid != 0}

    def invalid_block_ids_by_group(self) -> dict[int, set[int]]:
        """The same blocks, per KV cache group (for reports)."""
        groups: dict[int, set[int]] = {}
        for job in self.failed:
            if job.kind == "load":
                for g, ids in enumerate(job.dst_groups):
                    groups.setdefault(g, set()).update(b for b in ids if b != 0)
        return groups


class SimulatedWorker:
    def __init__(self, load_latency_steps: int = 0) -> None:
        # A load that is not held completes this many steps after the step that issued it
        # (0: in that step's own output). Used to measure waiting, e.g. K10.
        self.load_latency_steps = load_latency_steps
        self._due: dict[int, int] = {}
        self.in_flight: dict[int, Job] = {}
        self._holds: list[Rule] = []
        self._to_complete: set[int] = set()
        self._to_fail: set[int] = set()

    def hold(self, request: str | None = None, kind: str | None = None) -> None:
        """Jobs issued from now on that match stay in flight until released."""
        self._holds.append(Rule(request, kind))

    def release_holds(self, request: str | None = None, kind: str | None = None) -> None:
        self._holds = [r for r in self._holds
                       if not ((request is None or r.request == request) and (kind is None or r.kind == kind))]

    def complete(self, request: str | None = None, kind: str | None = None) -> list[int]:
        """Report matching in-flight jobs as completed in the next output; stop holding them."""
        return self._release(request, kind, self._to_complete)

    def fail(self, request: str | None = None, kind: str | None = None) -> list[int]:
        """Report matching in-flight jobs as failed (loads: their blocks are invalid)."""
        return self._release(request, kind, self._to_fail)

    def _release(self, request: str | None, kind: str | None, into: set[int]) -> list[int]:
        rule = Rule(request, kind)
        chosen = [jid for jid, job in self.in_flight.items() if rule.matches(job)]
        into.update(chosen)
        self.release_holds(request, kind)
        return chosen

    def forget(self) -> None:
        """The scheduler discarded every job (e.g. a connector cache reset)."""
        self.in_flight.clear()
        self._due.clear()
        self._to_complete.clear()
        self._to_fail.clear()

    def is_held(self, job: Job) -> bool:
        return any(rule.matches(job) for rule in self._holds)

    def take_step(self, new_jobs: list[Job], jobs_to_flush: set[int], step: int) -> WorkerReport:
        """Accept step `step`'s jobs and decide what its output reports."""
        for job in new_jobs:
            self.in_flight[job.job_id] = job
            if job.sync:  # waited for in its own step, as vLLM's worker does: never held
                self._to_complete.add(job.job_id)
            elif not self.is_held(job):
                latency = self.load_latency_steps if job.kind == "load" else 0
                self._due[job.job_id] = job.issued_step + latency
        self._to_complete.update(jid for jid, due in self._due.items() if due <= step)
        self._to_complete.update(jid for jid in jobs_to_flush if jid in self.in_flight)
        report = WorkerReport()
        for jid in sorted(self._to_fail):
            failed = self.in_flight.pop(jid, None)
            if failed is not None:
                report.failed.append(failed)
        for jid in sorted(self._to_complete - self._to_fail):
            completed = self.in_flight.pop(jid, None)
            if completed is not None:
                report.completed.append(completed)
        for job in report.completed + report.failed:
            self._due.pop(job.job_id, None)
        self._to_complete.clear()
        self._to_fail.clear()
        return report
