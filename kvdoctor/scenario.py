"""Run one recipe on a fresh harness under one logic variant, and observe it.

This is where the layers meet: the recipe's steps drive the engine's harness
inside the logic layer's patch scope, and the observe layer records every step
and decides the outcome. No formatting happens here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvdoctor.engine.compat import VllmApi
from kvdoctor.engine.harness import Harness, StepEvents
from kvdoctor.engine.setup import Setup
from kvdoctor.errors import InternalError, KvdoctorError
from kvdoctor.logic.patch import CallLog, StorableCall, storable_chunks_variant
from kvdoctor.observe.failure import Failure, describe_exception
from kvdoctor.observe.invariants import StepContext, Violation, check_all
from kvdoctor.observe.snapshot import Observer, RequestSnapshot
from kvdoctor.observe.verdict import Outcome, matches_exception
from kvdoctor.recipes.compile import CompiledRecipe, ConcreteStep, compile_recipe
from kvdoctor.recipes.geometry import NotApplicable, check as check_geometry
from kvdoctor.recipes.model import Recipe, Step
from kvdoctor.steps import ExpectationFailed, StepTarget, check_expectation, play


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


@dataclass
class RunResult:
    logic: str
    outcome: Outcome
    detail: str = ""
    failure: Failure | None = None
    failure_step: int | None = None
    requests: list[RequestSnapshot] = field(default_factory=list)
    checks: list[CheckResult] = field(default_factory=list)
    guards: list[str] = field(default_factory=list)
    violations: list[Violation] = field(default_factory=list)
    timeline: list[TimelineEntry] = field(default_factory=list)
    kv_plan: Any = None  # kv_layout.KvPlan: the KV cache groups vLLM's planner built for this run
    worker: str = ""  # which worker ran, in words (Worker.describe)
    model_runner: str = ""  # the model runner the scheduler shaped its output for
    coverage: Any = None  # observe.coverage.Coverage: did the run execute the recipe's crash site
    # Where the run was played past a measured reason the user's flags break (Setup.waived): the run's own
    # outcome, before kvdoctor/matrix/reasons.py let a measurement explain it (None: no reason waived).
    played_outcome: Outcome | None = None


def involved_request(exc: BaseException, failing_calls: list[StorableCall], requests: set[str]) -> str | None:
    """The request vLLM was working on when it raised, from what kvdoctor saw.

    A `KeyError` keyed by a request id names it; otherwise the last
    `storable_chunks` call of the failing step (the store pass asks it per
    request, right before pairing keys with blocks).
    """
    if isinstance(exc, KeyError) and exc.args and str(exc.args[0]) in requests:
        return str(exc.args[0])
    if failing_calls:
        return failing_calls[-1].req_id
    return None


def _chunks(count: int) -> str:
    return f"{count} chunk" if count == 1 else f"{count} chunks"


def explain_guards(calls: list[StorableCall]) -> list[str]:
    """Say, from the calls vLLM really made, what kept a finished request's store in bounds.

    "In bounds" means the chunks to store beyond `next_stored_chunk` can all be
    paired with allocated blocks. A term is named only when the recorded values
    show it bound (removing it raises the result); otherwise the text says that
    kvdoctor cannot tell.
    """
    guards: list[str] = []
    seen: set[tuple[str, int]] = set()
    for call in calls:
        if not call.request_status.startswith("FINISHED") or (call.req_id, call.group_idx) in seen:
            continue
        seen.add((call.req_id, call.group_idx))
        covered = max(call.allocated_chunks, call.next_stored_chunk)
        who = f"{call.req_id} (group {call.group_idx})" if call.group_idx else call.req_id
        if call.token_chunks > covered:
            if call.returned > covered:
                continue  # nothing held: the store pass will trip
            term = _binding_term(call)
            held = (f"held storable chunks to {call.returned}; its {call.num_offloadable_tokens} offloadable "
                    f"tokens make {_chunks(call.token_chunks)} but it holds {_chunks(call.allocated_chunks)} "
                    f"and has {call.next_stored_chunk} stored")
            guards.append(f"{who}: {term} {held}" if term else
                          f"{who}: something kvdoctor cannot name {held}")
        elif call.full_token_chunks > covered:
            counted = (f"the final store counted {call.num_offloadable_tokens} tokens "
                       f"({_chunks(call.token_chunks)}), not the {call.full_token_chunks * call.tokens_per_chunk} "
                       f"its offloadable tokens come to")
            within = (f"within its {call.allocated_chunks} allocated / {call.next_stored_chunk} stored; "
                      f"no cap was needed")
            if call.request_status == "FINISHED_ABORTED" and call.num_offloadable_tokens <= call.computed_tokens:
                guards.append(f"{who}: {counted}: aborted requests count only computed tokens "
                              f"(PR #49285), {within}")
            else:
                guards.append(f"{who}: {counted}, for a reason kvdoctor cannot name, {within}")
    return guards


def _binding_term(call: StorableCall) -> str | None:
    """The cap that bound `call.returned`, shown by a variant without it returning more."""
    if call.returned == call.allocated_chunks:
        if call.installed > call.returned:
            return "kvdoctor's fixed logic (the allocated-chunk cap of PR #49146)"
        if call.unpatched > call.returned:
            return "this release's allocated-chunk cap (PR #49146)"
    if call.keys_uncapped is not None and call.keys_uncapped > call.returned == call.keyed_chunks:
        return "this release's offload-key cap (PR #52923)"
    return None


class ScenarioRun:
    """One recipe, one variant, one fresh scheduler."""

    harness_class: Any = Harness  # the engine level swaps in its EngineCore harness (kvdoctor.engine.core)
    level = "scheduler"  # the engine level playing the steps (a step it cannot play: not_applicable)

    def __init__(self, api: VllmApi, recipe: Recipe, setup: Setup, logic: str, record_timeline: bool,
                 extra_invariants: tuple[str, ...] = (), timeline_at: frozenset[int] = frozenset(),
                 build_cache: Any = None) -> None:
        self.api = api
        self.build_cache = build_cache  # harness.BuildCache: per-setup build pieces reused (explore)
        from kvdoctor.observe.invariants import CONTENT_INVARIANTS

        content = CONTENT_INVARIANTS if setup.worker == "vllm" else ()
        names = [recipe.signature.invariant, *recipe.invariants, *extra_invariants, *content]
        self.invariants = list(dict.fromkeys(n for n in names if n))
        self.recipe = recipe
        self.setup = setup
        self.logic = logic
        self.record_timeline = record_timeline
        self.timeline_at = timeline_at  # step counters recorded even without a whole timeline
        self.log = CallLog()
        self.all_calls: list[StorableCall] = []
        self.compiled: CompiledRecipe | None = None  # the recipe's concrete steps at this geometry
        self.result = RunResult(logic=logic, outcome=Outcome.NOT_REPRODUCED)

    def run(self) -> RunResult:
        from kvdoctor.recipes.requirements import missing

        # The trigger impossible at this geometry: untested (never exit 0); this vLLM without the feature
        # the bug needs (a probe): not applicable.
        untested = [self.setup.untested] if self.setup.untested else []
        try:
            untested = untested or check_geometry(self.recipe, self.setup)
            if not untested:
                self.compiled = compile_recipe(self.recipe.steps, self.setup)
        except NotApplicable as exc:
            untested = [str(exc)]
        lacking = missing(self.api, self.recipe.requires)
        if not lacking:  # a step only an engine plays (pause/resume) is not this level's: say why
            from kvdoctor.engine.core.levels import unexpressible

            lacking = unexpressible(self.recipe.steps, self.level, self.setup.async_scheduling)
        if lacking or untested:
            self.result.outcome = Outcome.NOT_APPLICABLE if lacking else Outcome.UNTESTED
            self.result.detail = "; ".join(lacking or untested)
            return self.result
        try:
            harness = self.harness_class(self.api, self.setup, self.build_cache)
        except KvdoctorError:
            raise
        except Exception as exc:  # noqa: BLE001 - vLLM failed while building the scheduler/connector
            return self._failed_to_build(exc)
        self.result.kv_plan = harness.kv_plan
        self.result.worker = harness.worker.describe()
        self.result.model_runner = harness.model_runner
        try:
            from kvdoctor.observe.coverage import site_tracer
            from kvdoctor.observe.verdict import apply_coverage

            with site_tracer(self.recipe.signature, harness) as coverage:
                self._run_on(harness)
            self.result.coverage = coverage
            return apply_coverage(self.result, self.recipe.signature)
        finally:
            harness.shutdown()

    def _run_on(self, harness: Harness) -> RunResult:
        observer = Observer(harness, self.logic)
        target = StepTarget(harness, observer)
        with storable_chunks_variant(self.api, self.logic, self.log):
            for concrete in self.compiled.steps:
                counter, step = concrete.counter, concrete.step
                try:
                    events = apply_to_harness(concrete, target)
                except ExpectationFailed as exc:
                    self.result.outcome = Outcome.SETUP_ERROR
                    self.result.detail = f"step {counter} (line {step.line}): {exc}"
                    self.result.requests = observer.snapshot()
                    if self.record_timeline:
                        self.result.timeline.append(TimelineEntry(counter, step.action, step.describe(),
                                                                  step.line, None, self.result.requests,
                                                                  failed=True))
                    return self.result
                except KvdoctorError:
                    raise
                except Exception as exc:  # noqa: BLE001 - every failure is observed, none hidden
                    failing_calls = self.log.take()
                    self.all_calls.extend(failing_calls)
                    return self._failed(exc, counter, step, observer, failing_calls)
                self.log.raise_recording_errors()
                step_calls = self.log.take()
                self.all_calls.extend(step_calls)
                violations: list[Violation] = []
                if events is not None:
                    observer.note_step(events.finished)
                    violations = check_all(self.invariants, StepContext(harness, events, step_calls))
                # snapshots cost ~6% of a run: only where someone reads them
                if self.record_timeline or counter in self.timeline_at:
                    self.result.timeline.append(TimelineEntry(counter, step.action, step.describe(),
                                                              step.line, events, observer.snapshot(),
                                                              failed=bool(violations)))
                if violations:
                    self.result.requests = observer.snapshot()
                    return self._violated(violations, counter)
        self.result.requests = observer.snapshot()
        self._finish_checks()
        self.result.guards = explain_guards(self.all_calls)
        return self.result

    def _violated(self, violations: list[Violation], counter: int) -> RunResult:
        self.result.violations = violations
        self.result.failure_step = counter
        from kvdoctor.observe.invariants import CONTENT_FORM_OF

        wanted = self.recipe.signature.invariant
        accepted = {wanted, CONTENT_FORM_OF.get(wanted)} - {None}
        if wanted and any(v.invariant in accepted for v in violations):
            self.result.outcome = Outcome.REPRODUCED
        else:
            self.result.outcome = Outcome.OTHER_FAILURE
        self.result.detail = "; ".join(f"invariant {v.invariant} violated: {v.message}" for v in violations)
        self.result.guards = explain_guards(self.all_calls)
        return self.result

    def _failed(self, exc: Exception, counter: int, step: Step, observer: Observer,
                failing_calls: list[StorableCall]) -> RunResult:
        failure = describe_exception(exc)
        if not failure.in_vllm:
            raise InternalError(f"{failure.exception} in kvdoctor's {failure.function} ({failure.file}:"
                                f"{failure.line}) at step {counter}: {failure.message}") from exc
        self.log.raise_recording_errors()
        failure.involved_request = involved_request(exc, failing_calls, set(observer.harness.requests))
        self.result.failure = failure
        self.result.failure_step = counter
        self.result.requests = observer.snapshot(failing_calls)
        signature = self.recipe.signature
        if matches_exception(signature, failure):
            if signature.request is None or failure.involved_request == signature.request:
                self.result.outcome = Outcome.REPRODUCED
            else:
                self.result.outcome = Outcome.OTHER_FAILURE
                whom = (f"request {failure.involved_request}" if failure.involved_request
                        else "a request kvdoctor could not identify")
                self.result.detail = (f"{failure.exception} in {failure.function} fired for {whom}, but this "
                                      f"recipe's bug must involve request {signature.request}: the same "
                                      f"assertion reached by another path, not the bug the recipe is about")
        else:
            self.result.outcome = Outcome.OTHER_FAILURE
            self.result.detail = f"{failure.exception} in vLLM's {failure.function}: {failure.message}"
        if self.record_timeline:
            self.result.timeline.append(TimelineEntry(counter, step.action, step.describe(), step.line,
                                                      None, self.result.requests, failed=True))
        return self.result

    def _failed_to_build(self, exc: Exception) -> RunResult:
        """vLLM raised while building the scheduler or its connector: a vLLM outcome, not a usage error."""
        failure = describe_exception(exc)
        if not failure.in_vllm:
            raise InternalError(f"{failure.exception} in kvdoctor's {failure.function} ({failure.file}:"
                                f"{failure.line}) while building the scheduler: {failure.message}") from exc
        self.result.failure = failure
        self.result.failure_step = 0
        self.result.outcome = Outcome.OTHER_FAILURE
        self.result.detail = (f"vLLM failed while building the scheduler and its connector: {failure.exception} "
                              f"in {failure.function}: {failure.message}")
        return self.result

    def _finish_checks(self) -> None:
        for check in self.recipe.checks:
            held, observed = check_expectation(check, self.result.requests)
            self.result.checks.append(CheckResult(check.args.get("description", check.describe()), held, observed))
        failed = [c for c in self.result.checks if not c.passed]
        if failed and self.result.outcome is Outcome.NOT_REPRODUCED:
            self.result.outcome = Outcome.OTHER_FAILURE
            self.result.detail = "check failed: " + "; ".join(f"{c.description} ({c.observed})" for c in failed)


def apply_to_harness(step: ConcreteStep, target: StepTarget) -> StepEvents | None:
    """Play one concrete step through the step registry; `schedule` returns its events."""
    return play(step, target)


def run_scenario(api: VllmApi, recipe: Recipe, setup: Setup, logic: str, record_timeline: bool = False,
                 extra_invariants: tuple[str, ...] = (), timeline_at: frozenset[int] = frozenset(),
                 build_cache: Any = None) -> RunResult:
    """`timeline_at`: step counters (1-based, schedule repeats counted) whose entry is recorded even
    when `record_timeline` is off. `build_cache`: a `harness.BuildCache` (explore's)."""
    return ScenarioRun(api, recipe, setup, logic, record_timeline, extra_invariants, timeline_at,
                       build_cache).run()
