"""The step registry: each recipe step kind's one handler, and what playing it needs.

A recipe's steps are data (`kvdoctor.recipes.model.ACTIONS`); this module says
how each kind is played on a run's harness. Every kind is registered here, once,
with the capabilities it needs from whatever plays it (`Need`): an engine level
that cannot offer a need cannot play the kinds that declare it (issue 25 reads
this to decide which recipes each level can run). Dispatch goes through the
registry only: a kind without a handler is kvdoctor's own bug (InternalError,
exit 5), never a step that silently does nothing. `docs/steps.md` is generated
from it (`markdown_table`). Nothing heavy is imported here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

from kvdoctor.errors import InternalError, UsageError
from kvdoctor.recipes.model import ACTIONS

if TYPE_CHECKING:
    from kvdoctor.engine.harness import StepEvents
    from kvdoctor.observe.snapshot import RequestSnapshot
    from kvdoctor.recipes.compile import ConcreteStep


class Need(str, Enum):
    """A capability a step kind needs from the engine that plays it."""

    ENGINE_INPUT = "engine_input"
    ENGINE_STEP = "engine_step"
    IN_FLIGHT_OUTPUT = "in_flight_output"
    MODEL_OUTPUT = "model_output"
    TRANSFER_CONTROL = "transfer_control"
    SCHEDULER_CONTROL = "scheduler_control"
    ENGINE_UTILITY = "engine_utility"
    SCHEDULER_STATE = "scheduler_state"
    ENGINE_PAUSE = "engine_pause"

    @property
    def meaning(self) -> str:
        return _MEANINGS[self]


_MEANINGS = {
    Need.ENGINE_INPUT: "requests enter and leave through the engine's input path (add a request, abort one)",
    Need.ENGINE_STEP: "the engine runs one step of its scheduler: schedule() and update_from_output()",
    Need.IN_FLIGHT_OUTPUT: "apply the output of the batch still in flight (async scheduling) between steps, "
                           "without scheduling",
    Need.MODEL_OUTPUT: "choose the token the model samples for a request (EOS, to finish it)",
    Need.TRANSFER_CONTROL: "hold, complete or fail the worker's KV transfers at a chosen step",
    Need.SCHEDULER_CONTROL: "an intervention inside the scheduler, with no request-level API (block hashes "
                            "withheld from a request, then released)",
    Need.ENGINE_UTILITY: "one of the engine's utility calls (reset_prefix_cache)",
    Need.SCHEDULER_STATE: "read the scheduler's and connector's per-request state (a precondition)",
    Need.ENGINE_PAUSE: "the engine pauses and resumes its scheduler (EngineCore.pause_scheduler / "
                       "resume_scheduler: requests queue while paused, caches optionally cleared)",
}


@dataclass(frozen=True)
class StepTarget:
    """What a handler plays on: the run's harness, and the observer that reads its state."""

    harness: Any  # engine.harness.Harness
    observer: Any = None  # observe.snapshot.Observer; needed by SCHEDULER_STATE kinds


Handler = Callable[[StepTarget, "ConcreteStep"], "StepEvents | None"]


@dataclass(frozen=True)
class StepKind:
    name: str
    needs: tuple[Need, ...]
    summary: str
    handler: Handler


REGISTRY: dict[str, StepKind] = {}


def step_kind(name: str, *needs: Need, summary: str) -> Callable[[Handler], Handler]:
    """Register `name`'s handler; a kind registered twice is kvdoctor's bug, at import."""
    def register(handler: Handler) -> Handler:
        if name in REGISTRY:
            raise InternalError(f"step kind {name!r} registered twice")
        if not needs:
            raise InternalError(f"step kind {name!r} declares no needs")
        REGISTRY[name] = StepKind(name, tuple(needs), summary, handler)
        return handler
    return register


def kinds_needing(need: Need) -> tuple[str, ...]:
    """The step kinds that declare `need` (e.g. TRANSFER_CONTROL: what only kvdoctor's copy engine can play)."""
    return tuple(name for name, kind in REGISTRY.items() if need in kind.needs)


def play(step: ConcreteStep, target: StepTarget) -> StepEvents | None:
    """Play one concrete step; `schedule` returns the step's events. An unregistered kind raises."""
    kind = REGISTRY.get(step.action)
    if kind is None:
        raise InternalError(f"step kind {step.action!r} (line {step.step.line}) has no handler in "
                            f"kvdoctor.steps")
    return kind.handler(target, step)


class ExpectationFailed(Exception):
    """An `expect` step's precondition did not hold (the run ends in setup_error)."""


def check_expectation(step: Any, snapshots: list[RequestSnapshot]) -> tuple[bool, str]:
    """Compare one `expect`/`check` with the observed state; returns (held, observed)."""
    args = step.args
    snap = next(s for s in snapshots if s.request == args["request"])
    allocated = sum(g.allocated_blocks for g in snap.groups) if snap.groups else 0
    observed = (f"{snap.request}: status={snap.status} allocated_blocks={allocated} "
                f"connector_state={'present' if snap.connector_state else 'released'} "
                f"in_flight_jobs={len(snap.in_flight_jobs)} store_jobs_built={snap.store_jobs_built}")
    statuses = args.get("status")
    if statuses is not None:
        wanted = statuses if isinstance(statuses, list) else [statuses]
        if snap.status not in wanted:
            return False, observed
    comparisons = [
        ("allocated_blocks", allocated, "=="), ("min_allocated_blocks", allocated, ">="),
        ("in_flight_jobs", len(snap.in_flight_jobs), "=="), ("min_in_flight_jobs", len(snap.in_flight_jobs), ">="),
        ("store_jobs_built", snap.store_jobs_built, "=="), ("min_store_jobs_built", snap.store_jobs_built, ">="),
    ]
    for key, value, op in comparisons:
        if key in args and not (value == args[key] if op == "==" else value >= args[key]):
            return False, observed
    if "connector_state" in args and (args["connector_state"] == "present") != snap.connector_state:
        return False, observed
    return True, observed


# -- the handlers: one per kind --------------------------------------------------------------------------

ADD_EXTRA_KEYS = ("kv_transfer_params", "priority")  # an add's per-request fields, sent as a client sends them


def add_extras(args: dict[str, Any]) -> dict[str, Any]:
    """The add step's per-request fields that are given (every level passes them on as they are)."""
    return {key: args[key] for key in ADD_EXTRA_KEYS if key in args}


@step_kind("add", Need.ENGINE_INPUT, summary="admit a request (a fill admits several)")
def _add(target: StepTarget, step: ConcreteStep) -> None:
    extra = add_extras(step.args)
    for request in step.requests:
        target.harness.add(request.request, list(request.prompt), request.max_tokens, **extra)


@step_kind("schedule", Need.ENGINE_STEP, summary="one engine step (repeated `count` / `until` times)")
def _schedule(target: StepTarget, step: ConcreteStep) -> StepEvents:
    return target.harness.step()


@step_kind("drain", Need.IN_FLIGHT_OUTPUT, summary="apply the output still in flight, without scheduling")
def _drain(target: StepTarget, step: ConcreteStep) -> None:
    target.harness.drain()


@step_kind("abort", Need.ENGINE_INPUT, summary="abort a request (a client disconnect)")
def _abort(target: StepTarget, step: ConcreteStep) -> None:
    target.harness.abort(step.args["request"])


@step_kind("finish", Need.MODEL_OUTPUT, summary="the request's next sampled token is EOS")
def _finish(target: StepTarget, step: ConcreteStep) -> None:
    target.harness.finish_by_eos(step.args["request"])


@step_kind("complete_transfers", Need.TRANSFER_CONTROL, summary="complete held transfers")
def _complete_transfers(target: StepTarget, step: ConcreteStep) -> None:
    target.harness.worker.complete(step.args.get("request"), step.args.get("kind"))


@step_kind("hold_transfers", Need.TRANSFER_CONTROL, summary="keep transfers in flight until completed or failed")
def _hold_transfers(target: StepTarget, step: ConcreteStep) -> None:
    target.harness.worker.hold(step.args.get("request"), step.args.get("kind"))


@step_kind("fail_transfers", Need.TRANSFER_CONTROL, summary="report held transfers as failed")
def _fail_transfers(target: StepTarget, step: ConcreteStep) -> None:
    worker = step.args.get("worker")
    if worker is None:
        target.harness.worker.fail(step.args.get("request"), step.args.get("kind"))
        return
    if getattr(target.harness.worker, "num_workers", 1) < 2:  # one worker: it is the one that fails
        raise UsageError(f"fail_transfers worker = {worker} (line {step.step.line}) needs [setup] num_workers >= 2")
    target.harness.worker.fail(step.args.get("request"), step.args.get("kind"), worker=worker)


@step_kind("reset_prefix_cache", Need.ENGINE_UTILITY, summary="reset the prefix cache (and the connector's)")
def _reset_prefix_cache(target: StepTarget, step: ConcreteStep) -> None:
    target.harness.reset_prefix_cache(step.args.get("reset_running_requests", False),
                                      step.args.get("reset_connector", False))


@step_kind("expect", Need.SCHEDULER_STATE, summary="a precondition on a request's state")
def _expect(target: StepTarget, step: ConcreteStep) -> None:
    if target.observer is None:
        raise InternalError(f"expect (line {step.step.line}) played without an observer to read state")
    held, observed = check_expectation(step.step, target.observer.snapshot())
    if not held:
        raise ExpectationFailed(f"expected {step.args.get('description', step.step.describe())}; "
                                f"observed {observed}")


@step_kind("delay_block_hashes", Need.SCHEDULER_CONTROL,
           summary="the request's new full blocks get no block hash (no offload key) until released")
def _delay_block_hashes(target: StepTarget, step: ConcreteStep) -> None:
    target.harness.delay_block_hashes(step.args["request"])


@step_kind("release_block_hashes", Need.SCHEDULER_CONTROL, summary="the withheld block hashes arrive")
def _release_block_hashes(target: StepTarget, step: ConcreteStep) -> None:
    target.harness.release_block_hashes(step.args["request"])


@step_kind("pause", Need.ENGINE_PAUSE,
           summary="pause the engine's scheduler (mode keep or abort; clear_cache resets the caches)")
def _pause(target: StepTarget, step: ConcreteStep) -> None:
    target.harness.pause(step.args.get("mode", "keep"), step.args.get("clear_cache", False))


@step_kind("resume", Need.ENGINE_PAUSE, summary="resume the paused scheduler (queued requests flow again)")
def _resume(target: StepTarget, step: ConcreteStep) -> None:
    target.harness.resume()


def markdown_table() -> str:
    """`docs/steps.md`: step kind x need, from the registry (a test fails when the file drifts)."""
    needs = list(Need)
    lines = [
        "# Step kinds and what they need",
        "",
        "Generated from `kvdoctor/steps.py` (the step registry); do not edit by hand. Regenerate with",
        "`KVDOCTOR_UPDATE_DOCS=1 pytest tests/test_steps.py`. An engine that cannot offer a need cannot",
        "play the step kinds marked for it.",
        "",
        "| step kind | " + " | ".join(f"`{need.value}`" for need in needs) + " | what it does |",
        "|---|" + "---|" * len(needs) + "---|",
    ]

    order = {name: i for i, name in enumerate(ACTIONS)}  # the loader's vocabulary order
    for kind in sorted(REGISTRY.values(), key=lambda k: (order.get(k.name, len(order)), k.name)):
        marks = " | ".join("x" if need in kind.needs else "" for need in needs)
        lines.append(f"| `{kind.name}` | {marks} | {kind.summary} |")
    lines += ["", "Needs:", ""]
    lines += [f"- `{need.value}`: {need.meaning}" for need in needs]
    return "\n".join(lines) + "\n"
