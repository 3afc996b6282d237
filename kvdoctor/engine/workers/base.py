"""The worker seam: what the harness asks of whatever stands where vLLM's GPU worker runs.

Two implementations: `SimulatedTransfers` (bookkeeping only, the fast mode for explore)
and `VllmWorker` (vLLM's worker-role connector, KV bytes as fingerprints, kvdoctor's copy engine).
The harness talks to this protocol only: it hands each step's scheduler output over and
gets back the `KVConnectorOutput` for `ModelRunnerOutput`, plus what the step did.
Recipe steps use the hold / complete / fail capabilities.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from kvdoctor.engine.worker import Job


@dataclass
class WorkerStep:
    """What one step's worker side produced."""

    kv_connector_output: Any  # vLLM's KVConnectorOutput, or None (nothing to report)
    completed_jobs: list[int] = field(default_factory=list)
    failed_jobs: list[int] = field(default_factory=list)
    content_findings: list[Any] = field(default_factory=list)  # ContentFinding (vllm worker)


class Worker(Protocol):
    name: str  # "simulated" | "vllm"
    in_flight: dict[int, Job]  # job id -> job, issued and not yet reported

    def hold(self, request: str | None = None, kind: str | None = None) -> None: ...

    def complete(self, request: str | None = None, kind: str | None = None) -> list[int]: ...

    def fail(self, request: str | None = None, kind: str | None = None) -> list[int]: ...

    def forget(self) -> None:
        """The scheduler reset its connector (reset_prefix_cache(reset_connector=True))."""

    def run_step(self, output: Any, new_jobs: list[Job], jobs_to_flush: set[int], step: int,
                 sampled: dict[str, list[int]]) -> WorkerStep:
        """Execute one scheduler output on the worker side (model forward included)."""

    def describe(self) -> str:
        """One line for timelines: which worker ran, on what."""

    def shutdown(self) -> None: ...
