"""Run one recipe on a fresh harness under one logic variant, and observe it.

This is where the layers meet: the recipe's steps drive the engine's harness
inside the logic layer's patch scope, and the observe layer records every step
and decides the outcome. No formatting happens here.
"""

from __future__ import annotations

from typing import Any, Literal

from kvdoctor.engine.compat import VllmApi
from kvdoctor.engine.compat.step_clock import released_on_exit
from kvdoctor.engine.harness import Harness, StepEvents
from kvdoctor.engine.kv_layout import TriggerGroupsMissing
from kvdoctor.engine.setup import Setup
from kvdoctor.errors import InternalError, KvdoctorError
from kvdoctor.logic.patch import CallLog, StorableCall, storable_chunks_variant
from kvdoctor.observe.coverage import site_tracer
from kvdoctor.observe.failure import describe_exception
from kvdoctor.observe.invariants import CONTENT_FORM_OF, CONTENT_INVARIANTS, StepContext, Violation, check_all
from kvdoctor.observe.snapshot import Observer
from kvdoctor.observe.verdict import Outcome, apply_coverage, failure_verdict
from kvdoctor.recipes.compile import CompiledRecipe, ConcreteStep, compile_recipe
from kvdoctor.recipes.geometry import NotApplicable
from kvdoctor.recipes.geometry import check as check_geometry
from kvdoctor.recipes.model import Recipe, Step
from kvdoctor.recipes.requirements import missing
from kvdoctor.results import CheckResult, Guard, GuardCap, RunResult, TimelineEntry
from kvdoctor.steps import ExpectationFailed, StepTarget, check_expectation, play


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


def explain_guards(calls: list[StorableCall]) -> list[Guard]:
    """Say, from the calls vLLM really made, what kept a finished request's store in bounds.

    "In bounds" means the chunks to store beyond `next_stored_chunk` can all be
    paired with allocated blocks. A cap is named only when the recorded values
    show it bound (removing it raises the result); otherwise the record says that
    kvdoctor cannot tell (`cap` None). `report.guards` words the records.
    """
    guards: list[Guard] = []
    seen: set[tuple[str, int]] = set()
    for call in calls:
        if not call.request_status.startswith("FINISHED") or (call.req_id, call.group_idx) in seen:
            continue
        seen.add((call.req_id, call.group_idx))
        covered = max(call.allocated_chunks, call.next_stored_chunk)
        if call.token_chunks > covered:
            if call.returned > covered:
                continue  # nothing held: the store pass will trip
            guards.append(_guard(call, "held", cap=_binding_cap(call)))
        elif call.full_token_chunks > covered:
            aborted = call.request_status == "FINISHED_ABORTED" and call.num_offloadable_tokens <= call.computed_tokens
            guards.append(_guard(call, "counted", aborted_counts_computed=aborted))
    return guards


def _guard(call: StorableCall, kind: Literal["held", "counted"], cap: GuardCap | None = None,
           aborted_counts_computed: bool = False) -> Guard:
    return Guard(request=call.req_id, group=call.group_idx, kind=kind, returned=call.returned,
                 offloadable_tokens=call.num_offloadable_tokens, token_chunks=call.token_chunks,
                 allocated_chunks=call.allocated_chunks, next_stored_chunk=call.next_stored_chunk,
                 full_tokens=call.full_token_chunks * call.tokens_per_chunk, cap=cap,
                 aborted_counts_computed=aborted_counts_computed)


def _binding_cap(call: StorableCall) -> GuardCap | None:
    """The cap that bound `call.returned`, shown by a variant without it returning more."""
    if call.returned == call.allocated_chunks:
        if call.installed > call.returned:
            return "fixed_logic"
        if call.unpatched > call.returned:
            return "allocated_chunks"
    if call.keys_uncapped is not None and call.keys_uncapped > call.returned == call.keyed_chunks:
        return "offload_keys"
    return None


class ScenarioRun:
    """One recipe, one variant, one fresh scheduler, played by the level that builds it (`kvdoctor.levels`:
    the scheduler level plays this class as it is, the core level swaps in its EngineCore harness).

    `unplayable`: the playing level's reasons it cannot play some of the recipe's steps (its table's
    answer, `levels.table.unexpressible`); the recipe is then not applicable, unless this vLLM lacks
    what it requires (that reason comes first)."""

    harness_class: Any = Harness  # the engine level swaps in its EngineCore harness (kvdoctor.levels.core)

    def __init__(self, api: VllmApi, recipe: Recipe, setup: Setup, logic: str, record_timeline: bool,
                 extra_invariants: tuple[str, ...] = (), timeline_at: frozenset[int] = frozenset(),
                 build_cache: Any = None, unplayable: tuple[str, ...] = ()) -> None:
        self.api = api
        self.build_cache = build_cache  # harness.BuildCache: per-setup build pieces reused (explore)
        self.unplayable = unplayable
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
        with released_on_exit():  # a tier's step clock never outlives the run (compat/step_clock.py)
            return self._run()

    def _run(self) -> RunResult:
        # The trigger impossible at this geometry: untested (never exit 0); this vLLM without the feature
        # the bug needs (a probe): not applicable.
        untested = [self.setup.untested] if self.setup.untested else []
        try:
            untested = untested or check_geometry(self.recipe, self.setup)
            if not untested:
                self.compiled = compile_recipe(self.recipe.steps, self.setup)
        except NotApplicable as exc:
            untested = [str(exc)]
        # a step only another level plays (pause/resume at the scheduler level) is not this level's: say why
        probed = missing(self.api, self.recipe.requires)
        lacking = probed or list(self.unplayable)
        self.result.unplayable = not probed and bool(lacking)  # the level's reason, not a probe's: exit 6
        if lacking or untested:
            self.result.outcome = Outcome.NOT_APPLICABLE if lacking else Outcome.UNTESTED
            self.result.detail = "; ".join(lacking or untested)
            return self.result
        try:
            harness = self.harness_class(self.api, self.setup, self.build_cache)
        except TriggerGroupsMissing as exc:  # a --model over the recipe's own layout: vLLM's planner measured it
            self.result.outcome = Outcome.UNTESTED
            self.result.detail = str(exc)
            return self.result
        except KvdoctorError:
            raise
        except Exception as exc:  # vLLM failed while building the scheduler/connector
            return self._failed_to_build(exc)
        self.result.kv_plan = harness.kv_plan
        self.result.worker = harness.worker.describe()
        self.result.model_runner = harness.model_runner
        try:
            with site_tracer(self.recipe.signature, harness) as coverage:
                self._run_on(harness)
            self.result.coverage = coverage
            return apply_coverage(self.result, self.recipe.signature)
        finally:
            harness.shutdown()

    def _run_on(self, harness: Harness) -> RunResult:
        assert self.compiled is not None  # run() compiled the recipe before building the harness
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
                except Exception as exc:  # every failure is observed, none hidden
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
        wanted = self.recipe.signature.invariant
        accepted = {wanted, CONTENT_FORM_OF.get(wanted) if wanted else None} - {None}
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
        self.result.outcome, why = failure_verdict(self.recipe.signature, failure)
        if why:
            self.result.detail = why
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

