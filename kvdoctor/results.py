"""What the application functions return: one run of a recipe (`RunResult`), `repro`'s and `audit`'s
reports, and the records inside them. Plain data with typed fields, no formatting (`report/` words
them) and no vLLM import.

The levels build `RunResult`s (`levels/`, through `scenario`), the application functions gather them
into reports (`app`), the CLI hands the reports to `report/`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from kvdoctor.errors import ExitStatus
from kvdoctor.matrix.known import FixedIn, UpgradeHint, upgrade_hint
from kvdoctor.observe.failure import Failure
from kvdoctor.observe.verdict import ClientAnswers, Outcome
from kvdoctor.outcome_codes import exit_code_for_many

if TYPE_CHECKING:  # types only: their modules are the engine's and observe's, imported by the run
    from kvdoctor.engine.harness import StepEvents
    from kvdoctor.engine.kv_layout import KvPlan
    from kvdoctor.engine.setup import Setup
    from kvdoctor.observe.coverage import Coverage
    from kvdoctor.observe.invariants import Violation
    from kvdoctor.observe.metrics import PrefixSharingMetric
    from kvdoctor.observe.snapshot import RequestSnapshot
    from kvdoctor.recipes.model import Recipe


@dataclass
class TimelineEntry:
    index: int
    action: str
    description: str
    line: int
    events: StepEvents | None
    requests: list[RequestSnapshot]
    failed: bool = False

    @property
    def predicted_trip(self) -> list[str]:
        return [r.request for r in self.requests if r.would_trip]

    def as_dict(self) -> dict[str, Any]:
        return {
            "index": self.index, "action": self.action, "description": self.description, "line": self.line,
            "events": ({**self.events.__dict__,
                        "content_findings": [f.message for f in self.events.content_findings]}
                       if self.events else None),
            "requests": [r.as_dict() for r in self.requests],
            "predicted_failure": self.predicted_trip, "failed": self.failed,
        }


@dataclass
class CheckResult:
    description: str
    passed: bool
    observed: str


# Which cap held a finished request's storable chunks, shown by a variant without it returning more.
GuardCap = Literal["fixed_logic", "allocated_chunks", "offload_keys"]


@dataclass(frozen=True)
class Guard:
    """What kept one finished request's final store in bounds, from the `storable_chunks` calls vLLM
    really made (`scenario.explain_guards` measures it; `report.guards` words it).

    `held`: storable_chunks returned fewer chunks than its offloadable tokens make; `cap` names the
    cap that bound it (None: kvdoctor cannot name it). `counted`: the final store counted fewer tokens
    than the request's offloadable tokens come to, within its blocks; `aborted_counts_computed` where
    it was an aborted request counting only its computed tokens."""

    request: str
    group: int
    kind: Literal["held", "counted"]
    returned: int
    offloadable_tokens: int
    token_chunks: int
    allocated_chunks: int
    next_stored_chunk: int
    full_tokens: int  # the tokens its full offloadable chunks come to
    cap: GuardCap | None = None
    aborted_counts_computed: bool = False


@dataclass
class RunResult:
    logic: str
    outcome: Outcome
    detail: str = ""
    failure: Failure | None = None
    failure_step: int | None = None
    requests: list[RequestSnapshot] = field(default_factory=list)
    checks: list[CheckResult] = field(default_factory=list)
    guards: list[Guard] = field(default_factory=list)
    violations: list[Violation] = field(default_factory=list)
    timeline: list[TimelineEntry] = field(default_factory=list)
    kv_plan: KvPlan | None = None  # the KV cache groups vLLM's planner built for this run
    worker: str = ""  # which worker ran, in words (Worker.describe)
    model_runner: str = ""  # the model runner the scheduler shaped its output for
    coverage: Coverage | None = None  # did the run execute the recipe's crash site
    # not_applicable because this engine level cannot play a step (or the setup), not because a probe found
    # this vLLM without the feature: the run did not test the bug (exit 6, `outcome_codes`)
    unplayable: bool = False
    # Where the run was played past a measured reason the user's flags break (Setup.waived): the run's own
    # outcome, before kvdoctor/matrix/reasons.py let a measurement explain it (None: no reason waived).
    played_outcome: Outcome | None = None
    # A silent bug as its clients see it: every request's completion against the run's own reference
    # (offloading off), where the level compared them (None: not compared)
    answers: ClientAnswers | None = None


@dataclass
class ReproReport:
    recipe: Recipe
    setup: Setup
    vllm_version: str
    results: list[RunResult] = field(default_factory=list)
    command: str = ""
    # From kvdoctor's release measurements (kvdoctor.matrix.known), shown as a hint, never the verdict.
    fixed_in: FixedIn | None = None
    server_log: str = ""  # --engine serve: the server's own log

    @property
    def kv_plan(self) -> KvPlan | None:
        """The KV cache groups vLLM's planner built (every variant builds the same); None if none ran."""
        return next((r.kv_plan for r in self.results if r.kv_plan is not None), None)

    @property
    def decisive(self) -> RunResult:
        """The result whose outcome sets the exit code: installed logic when it ran."""
        for result in self.results:
            if result.logic == "installed":
                return result
        return self.results[0]


@dataclass
class AuditRow:
    bug: str
    recipe: Recipe
    setup: Setup
    installed: RunResult
    fixed: RunResult
    fixed_in: FixedIn | None = None  # measured on other releases, never the verdict
    server_log: str = ""  # --engine serve: the server's own log


@dataclass
class MetricRow:
    """A performance bug, reported as a measured number against a baseline."""

    bug: str
    title: str
    refs: tuple[str, ...]
    value: PrefixSharingMetric | None  # None when the measurement did not complete
    error: str | None = None  # why it did not complete (the row then counts as other_failure)
    level: str = "scheduler"  # the audit's engine level; K10 is always measured by kvdoctor's harness

    @property
    def outcome(self) -> str:
        return "other_failure" if self.error else "measured"


@dataclass
class AuditReport:
    vllm_version: str
    rows: list[AuditRow] = field(default_factory=list)
    metrics: list[MetricRow] = field(default_factory=list)
    command: str = ""
    engine: str = "scheduler"  # the engine level every row ran at (kvdoctor/levels/table.py)

    @property
    def any_reproduced(self) -> bool:
        return any(row.installed.outcome.value == "reproduced" for row in self.rows)

    @property
    def reproducing(self) -> dict[str, list[str]]:
        """Bug id -> its recipes that reproduce under the installed logic (catalogue order)."""
        found: dict[str, list[str]] = {}
        for row in self.rows:
            if row.installed.outcome.value == "reproduced":
                found.setdefault(row.bug, []).append(row.recipe.name)
        return found

    @property
    def upgrade_hint(self) -> UpgradeHint | None:
        """The measured release that fixes the most of what reproduces here (a hint, not a verdict)."""
        return upgrade_hint(self.reproducing, self.vllm_version)

    @property
    def exit_status(self) -> ExitStatus:
        """1 when any known bug reproduces; else 4 when any row (or a metric) ended other_failure or
        setup_error; else 6 when any did not test its bug (a level that cannot play it included); 0 only
        when every row is not_reproduced / not_applicable to this vLLM."""
        outcomes: list[Any] = [row.installed for row in self.rows]
        outcomes += [Outcome.OTHER_FAILURE for metric in self.metrics if metric.error]
        return exit_code_for_many(outcomes)
