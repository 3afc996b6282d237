"""The step vocabulary: each recipe step kind declared once, with everything every reader needs.

A `@step_kind(...)` declaration is the one place a kind is written. It names:

- `needs`: the capabilities playing it takes (`Need`); an engine level that cannot offer one refuses
  the recipe in one line, naming the step (`levels/table.py` answers each need per level);
- `fields`: its TOML fields, their types, whether required, their bounds or choices (`Field`);
- `validate`: the checks across its fields the recipe loader runs (one line, file:line, exit 2);
- the handler (the decorated function): how it is played on a level's harness (`Harness`, below:
  kvdoctor's scheduler harness and vLLM's EngineCore harness both offer it);
- `serve`: what kvdoctor's serve client sends for it (HTTP events), or None where the serve level
  refuses it by its needs;
- `script`: what the exported standalone script does (a few lines of code run inside its `main`), or
  `Unsupported(why)`: the export is then refused in one line naming the step, never skipped;
- `explore`: the event name `explore`'s generator draws it under, or `Unsupported(why)`;
- `admits` / `repeats`: the kind admits requests (the loader checks their ids, the compiler sizes
  them) / is an engine step the compiler repeats (`count`, `until`).

The loader, the compiler, both harness levels, the serve client, the exported scripts and explore's
generator read `REGISTRY`; `docs/steps.md` is generated from it (`markdown_table`). Nothing heavy
is imported here, and nothing from `kvdoctor.recipes` (which reads this module).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol

from kvdoctor.engine.step_loop import EOS_TOKEN
from kvdoctor.errors import InternalError, UsageError
from kvdoctor.expectation import unmet

if TYPE_CHECKING:
    from kvdoctor.engine.harness import StepEvents
    from kvdoctor.engine.workers.base import Worker
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
    P2P_PAIR = "p2p_pair"
    PD_DECODE = "pd_decode"

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
                       "resume_scheduler: requests queue while paused, caches optionally cleared; its sleep mode, "
                       "EngineCore.sleep / wake_up, pauses it the same way and puts the executor to sleep)",
    Need.P2P_PAIR: "a second engine beside the recipe's, both on vLLM's P2P tier over kvdoctor's in-memory "
                   "fabric ([setup] p2p = true): drive the producer, the fabric, a peer's death",
    Need.PD_DECODE: "a P/D decode node ([setup] pd_decode = true): vLLM's MultiConnector with kvdoctor's stand-in "
                    "for NIXL's remote-prefill loads first, whose loads the recipe can fail",
}


# -- what a level's harness offers -------------------------------------------------------------------------

class Harness(Protocol):
    """What an engine level's harness offers the handlers: one method (or the worker) per need.

    `kvdoctor.engine.harness.Harness` (kvdoctor calls the scheduler) and
    `kvdoctor.engine.core.harness.CoreHarness` (vLLM's EngineCore calls it) both offer all of it; what
    a level cannot do it refuses through its needs before anything is played (`levels.unexpressible`),
    and its method, if ever reached, raises a usage error naming the level (never a silent no-op)."""

    requests: dict[str, Any]  # request id -> vLLM's Request, as admitted
    worker: Worker  # TRANSFER_CONTROL: what stands where vLLM's GPU worker runs

    def add(self, req_id: str, prompt: list[int], max_tokens: int, kv_transfer_params: dict[str, Any] | None = None,
            priority: int = 0) -> None: ...  # ENGINE_INPUT

    def abort(self, req_id: str) -> None: ...  # ENGINE_INPUT

    def step(self) -> StepEvents: ...  # ENGINE_STEP

    def drain(self) -> bool: ...  # IN_FLIGHT_OUTPUT

    def finish_by_eos(self, req_id: str) -> None: ...  # MODEL_OUTPUT

    def reset_prefix_cache(self, reset_running_requests: bool, reset_connector: bool) -> bool: ...  # ENGINE_UTILITY

    def delay_block_hashes(self, req_id: str) -> None: ...  # SCHEDULER_CONTROL

    def release_block_hashes(self, req_id: str) -> None: ...  # SCHEDULER_CONTROL

    def pause(self, mode: str, clear_cache: bool) -> None: ...  # ENGINE_PAUSE

    def resume(self) -> None: ...  # ENGINE_PAUSE

    def sleep(self, level: int, mode: str, reset_connector: bool | None) -> None: ...  # ENGINE_PAUSE

    def wake_up(self, tags: list[str] | None) -> None: ...  # ENGINE_PAUSE
    def p2p(self, action: str, args: dict[str, Any]) -> None: ...  # P2P_PAIR

    def pd_fail(self, req_id: str, blocks: int | None) -> None: ...  # PD_DECODE


class StateReader(Protocol):
    """SCHEDULER_STATE: what reads the scheduler's and connector's per-request state (`observe.Observer`)."""

    def snapshot(self) -> list[RequestSnapshot]: ...


@dataclass(frozen=True)
class StepTarget:
    """What a handler plays on: the run's harness, and the observer that reads its state."""

    harness: Harness
    observer: StateReader | None = None  # needed by SCHEDULER_STATE kinds


# -- the declaration ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Field:
    """One TOML field of a step kind: its types, whether required, and the values it may take."""

    types: tuple[type, ...]
    required: bool = False
    minimum: int | None = None
    maximum: int | None = None  # kvdoctor's bound: a run at such a size would take minutes
    choices: tuple[str, ...] = ()


def f(*types: type, required: bool = False, minimum: int | None = None, maximum: int | None = None,
      choices: tuple[str, ...] = ()) -> Field:
    return Field(tuple(types), required, minimum, maximum, choices)


@dataclass(frozen=True)
class Unsupported:
    """An interface that does without a kind (the exported script, explore's draws), and why."""

    why: str


Fail = Callable[[str | None, str], Exception]  # (the field, or None: the step; text) -> the loader's error
Validator = Callable[[dict[str, Any], Fail], None]
Handler = Callable[[StepTarget, "ConcreteStep"], "StepEvents | None"]
ServeEvents = Callable[["ConcreteStep"], list[dict[str, Any]]]  # the serve client's events for one play


def _no_checks(args: dict[str, Any], fail: Fail) -> None:
    """A kind whose fields need no check beyond their types, bounds and choices."""


@dataclass(frozen=True)
class StepKind:
    name: str
    needs: tuple[Need, ...]
    summary: str
    handler: Handler
    fields: dict[str, Field]
    validate: Validator
    serve: ServeEvents | None  # None: the serve level refuses the kind by its needs
    script: str | Unsupported  # the exported script's code for it (inside `main`), or why it has none
    explore: str | Unsupported  # the event explore's generator draws it under, or why none
    admits: bool = False  # it admits requests (its `request` is a new id)
    repeats: bool = False  # an engine step the compiler repeats (`count` / `until`)


REGISTRY: dict[str, StepKind] = {}


def step_kind(name: str, *needs: Need, summary: str, fields: dict[str, Field], script: str | Unsupported,
              explore: str | Unsupported, validate: Validator = _no_checks, serve: ServeEvents | None = None,
              admits: bool = False, repeats: bool = False) -> Callable[[Handler], Handler]:
    """Declare `name` with its handler; a kind declared twice, or without needs, is kvdoctor's bug, at import."""
    def register(handler: Handler) -> Handler:
        if name in REGISTRY:
            raise InternalError(f"step kind {name!r} registered twice")
        if not needs:
            raise InternalError(f"step kind {name!r} declares no needs")
        REGISTRY[name] = StepKind(name, tuple(needs), summary, handler, dict(fields), validate, serve,
                                  script, explore, admits, repeats)
        return handler
    return register


def kind_of(action: str) -> StepKind:
    """The declaration of `action`; a kind nobody declared is kvdoctor's own bug (exit 5)."""
    kind = REGISTRY.get(action)
    if kind is None:
        raise InternalError(f"step kind {action!r} is not declared: it has no handler in kvdoctor.steps")
    return kind


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


def shown(value: Any) -> str:
    """A value as a message shows it: its repr (so never a raw newline), at most 40 characters."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


class ExpectationFailed(Exception):
    """An `expect` step's precondition did not hold (the run ends in setup_error)."""


def check_expectation(step: Any, snapshots: list[RequestSnapshot]) -> tuple[bool, str]:
    """Compare one `expect`/`check` with the observed state (`kvdoctor.expectation`, the exported scripts'
    definition too); returns (held, observed)."""
    args = step.args
    snap = next(s for s in snapshots if s.request == args["request"])
    observed = {"status": snap.status,
                "allocated_blocks": sum(g.allocated_blocks for g in snap.groups) if snap.groups else 0,
                "connector_state": "present" if snap.connector_state else "released",
                "in_flight_jobs": len(snap.in_flight_jobs), "store_jobs_built": snap.store_jobs_built}
    text = (f"{snap.request}: status={snap.status} allocated_blocks={observed['allocated_blocks']} "
            f"connector_state={observed['connector_state']} in_flight_jobs={observed['in_flight_jobs']} "
            f"store_jobs_built={snap.store_jobs_built}")
    return not unmet(args, observed), text


# -- the kinds ------------------------------------------------------------------------------------------

TOKENS_BOUND = 1 << 24  # tokens past any model's context
CHUNKS_BOUND = 1 << 20
TRANSFER_KINDS = ("store", "load")
# pause modes an in-process EngineCore takes ("wait" is refused there: it needs the engine's own loop)
PAUSE_MODES = ("keep", "abort")
CONNECTOR_STATES = ("present", "released")
ADD_EXTRA_KEYS = ("kv_transfer_params", "priority")  # an add's per-request fields, sent as a client sends them


def add_extras(args: dict[str, Any]) -> dict[str, Any]:
    """The add step's per-request fields that are given (every level passes them on as they are)."""
    return {key: args[key] for key in ADD_EXTRA_KEYS if key in args}


def _validate_add(args: dict[str, Any], fail: Fail) -> None:
    sizes = [k for k in ("prompt_tokens", "prompt_chunks", "prompt", "fill_pool", "prompt_rest_of_pool") if k in args]
    if len(sizes) != 1 or args.get("fill_pool") is False or args.get("prompt_rest_of_pool") is False:
        raise fail(None, "needs exactly one of 'prompt_tokens', 'prompt_chunks', 'prompt', 'fill_pool = true', "
                         "'fill_pool = \"preempt_next\"' or 'prompt_rest_of_pool = true'")
    if isinstance(args.get("fill_pool"), str) and args["fill_pool"] != "preempt_next":
        raise fail("fill_pool", f"fill_pool must be true (queue the next request) or \"preempt_next\" (preempt it "
                                f"mid-prefill), got {shown(args['fill_pool'])}")
    if "prompt" in args and (not args["prompt"] or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1024 for t in args["prompt"])):
        raise fail("prompt", "prompt must be a non-empty array of token ids in [0, 1024)")
    prefix_sizes = [k for k in ("shared_prefix_tokens", "shared_prefix_chunks") if k in args]
    if ("shared_prefix_with" in args) != bool(prefix_sizes) or len(prefix_sizes) > 1:
        raise fail(None, "needs both 'shared_prefix_with' and one of 'shared_prefix_tokens' or "
                         "'shared_prefix_chunks'")
    if "trim_tokens" in args and "prompt_chunks" not in args:
        raise fail("trim_tokens", "trim_tokens shortens a prompt_chunks prompt; give prompt_chunks")


def _serve_add(play: ConcreteStep) -> list[dict[str, Any]]:
    """POST /v1/completions per request, token-id prompt (a fill: each of its requests), stopping at kvdoctor's
    EOS; `continues`: the client sends that request's prompt and the completion it received first."""
    extra = {**add_extras(play.args), "stop_token_ids": [EOS_TOKEN]}
    return [{"kind": "add", "request": new.request, "prompt": list(new.prompt), "max_tokens": new.max_tokens,
             "extra": extra, "continues": play.args.get("continues", "")} for new in play.requests]


@step_kind("add", Need.ENGINE_INPUT, summary="admit a request (a fill admits several)", admits=True, fields={
    "request": f(str, required=True),
    "prompt_tokens": f(int, minimum=1, maximum=TOKENS_BOUND),
    "prompt": f(list),
    "prompt_chunks": f(int, minimum=1, maximum=CHUNKS_BOUND),
    "fill_pool": f(bool, str),  # true | "preempt_next"
    "prompt_rest_of_pool": f(bool),  # the blocks a fill_pool = "preempt_next" before it leaves
    "max_tokens": f(int, minimum=1, maximum=TOKENS_BOUND),
    "shared_prefix_with": f(str),
    "shared_prefix_tokens": f(int, minimum=1, maximum=TOKENS_BOUND),
    # geometry-relative sizes: a prompt_chunks prompt N tokens short; a prefix of N chunks
    "trim_tokens": f(int, minimum=1, maximum=TOKENS_BOUND),
    "shared_prefix_chunks": f(int, minimum=1, maximum=CHUNKS_BOUND),
    # what a client sends with the request: vLLM's `kv_transfer_params` (0.34's offloading connector reads
    # max_load_tokens / max_offload_tokens from it) and its priority (lower is served first, under
    # [setup] scheduling_policy = "priority")
    "kv_transfer_params": f(dict),
    "priority": f(int),
    # the next turn of a conversation: the prompt starts with that request's tokens as its client has them
    # when this step plays (its prompt and completion), then this add's own tokens
    "continues": f(str),
}, validate=_validate_add, serve=_serve_add, explore="add", script="""
# a client's kv_transfer_params travel in the sampling params' extra_args, where vLLM reads them
extra = ({"extra_args": {"kv_transfer_params": args["kv_transfer_params"]}}
         if args.get("kv_transfer_params") else {})
prompt = (list(requests[args["continues"]].all_token_ids) if args.get("continues") else []) + args["prompt"]
req = Request(request_id=args["request"], prompt_token_ids=prompt,
              sampling_params=SamplingParams(max_tokens=args.get("max_tokens", 8),
                                             stop_token_ids=[EOS_TOKEN], **extra),
              pooling_params=None, block_hasher=hasher, priority=args.get("priority", 0))
requests[req.request_id] = req
scheduler.add_request(req)
""")
def _add(target: StepTarget, step: ConcreteStep) -> None:
    extra = add_extras(step.args)
    earlier = continued_tokens(target.harness.requests, step.args) if step.args.get("continues") else []
    for request in step.requests:
        target.harness.add(request.request, earlier + list(request.prompt), request.max_tokens, **extra)


def continued_tokens(requests: dict[str, Any], args: dict[str, Any]) -> list[int]:
    """An add's `continues`: that request's tokens now (its prompt and what its client received)."""
    name = args["continues"]
    if name not in requests:
        raise UsageError(f"add {args['request']}: continues {name!r}, which no earlier step added")
    return list(requests[name].all_token_ids)


def _validate_schedule(args: dict[str, Any], fail: Fail) -> None:
    if "until" in args:
        if args["until"] not in ("filled", "prefilled"):
            raise fail("until", f"until must be \"filled\" (the steps the fill_pool before it needs) or \"prefilled\" "
                                f"(with request: the steps its prompt needs at the step budget), got "
                                f"{shown(args['until'])}")
        if "count" in args:
            raise fail(None, "takes 'count' or 'until', not both")
        if (args["until"] == "prefilled") != ("request" in args):
            raise fail(None, "takes 'request' with until = \"prefilled\", and only then")
    elif "request" in args:
        raise fail("request", "takes 'request' only with until = \"prefilled\"")


# until = "filled": as many steps as the fill_pool before it needs at this geometry
# until = "prefilled" (with request): ceil(its prompt / max_num_batched_tokens) steps
@step_kind("schedule", Need.ENGINE_STEP, summary="one engine step (repeated `count` / `until` times)", repeats=True,
           fields={"count": f(int, minimum=1, maximum=100_000), "until": f(str), "request": f(str)},
           validate=_validate_schedule, serve=lambda play: [{"kind": "step"}], explore="schedule",
           script="""
for _ in range(args.get("count", 1)):
    loop.step(worker_side)
""")
def _schedule(target: StepTarget, step: ConcreteStep) -> StepEvents:
    return target.harness.step()


# At serve (sync scheduling only, by its need): nothing is in flight between the engine's steps, nothing to send.
@step_kind("drain", Need.IN_FLIGHT_OUTPUT, summary="apply the output still in flight, without scheduling",
           fields={}, explore="drain", serve=lambda play: [],
           script="loop.drain()  # async: apply the output still in flight\n")
def _drain(target: StepTarget, step: ConcreteStep) -> None:
    target.harness.drain()


@step_kind("abort", Need.ENGINE_INPUT, summary="abort a request (a client disconnect)",
           fields={"request": f(str, required=True)}, explore="abort",
           serve=lambda play: [{"kind": "abort", "request": play.args["request"]}],
           script='scheduler.finish_requests(args["request"], RequestStatus.FINISHED_ABORTED)\n')
def _abort(target: StepTarget, step: ConcreteStep) -> None:
    target.harness.abort(step.args["request"])


# At serve the client sends the EOS with the request (its vllm_xargs, read by kvdoctor's executor): the serve
# level folds a `finish` into the add before it, and refuses one that comes after the request was scheduled.
@step_kind("finish", Need.MODEL_OUTPUT, summary="the request's next sampled token is EOS",
           fields={"request": f(str, required=True)}, explore="finish",
           serve=lambda play: [{"kind": "finish", "request": play.args["request"]}],
           script='finish_next.add(args["request"])\n')
def _finish(target: StepTarget, step: ConcreteStep) -> None:
    target.harness.finish_by_eos(step.args["request"])


_TRANSFER_FIELDS = {"request": f(str), "kind": f(str, choices=TRANSFER_KINDS)}


@step_kind("complete_transfers", Need.TRANSFER_CONTROL, summary="complete held transfers", fields=_TRANSFER_FIELDS,
           explore="complete", script='worker.complete(args.get("request"), args.get("kind"))\n')
def _complete_transfers(target: StepTarget, step: ConcreteStep) -> None:
    target.harness.worker.complete(step.args.get("request"), step.args.get("kind"))


@step_kind("hold_transfers", Need.TRANSFER_CONTROL, summary="keep transfers in flight until completed or failed",
           fields=_TRANSFER_FIELDS, explore="hold", script='worker.hold(args.get("request"), args.get("kind"))\n')
def _hold_transfers(target: StepTarget, step: ConcreteStep) -> None:
    target.harness.worker.hold(step.args.get("request"), step.args.get("kind"))


# worker = i (num_workers > 1): only worker i fails the jobs, the others complete them
@step_kind("fail_transfers", Need.TRANSFER_CONTROL, summary="report held transfers as failed",
           fields={**_TRANSFER_FIELDS, "worker": f(int)}, explore="fail",
           script='worker.fail(args.get("request"), args.get("kind"))\n')
def _fail_transfers(target: StepTarget, step: ConcreteStep) -> None:
    worker = step.args.get("worker")
    if worker is None:
        target.harness.worker.fail(step.args.get("request"), step.args.get("kind"))
        return
    if getattr(target.harness.worker, "num_workers", 1) < 2:  # one worker: it is the one that fails
        raise UsageError(f"fail_transfers worker = {worker} (line {step.step.line}) needs [setup] num_workers >= 2")
    several: Any = target.harness.worker  # the several-workers stand-in (engine/workers/multi.py) takes `worker`
    several.fail(step.args.get("request"), step.args.get("kind"), worker=worker)


def _serve_reset(play: ConcreteStep) -> list[dict[str, Any]]:
    """POST /reset_prefix_cache (vLLM's development endpoint), its query as the step's fields."""
    return [{"kind": "reset", "extra": {"reset_running_requests": bool(play.args.get("reset_running_requests", False)),
                                        "reset_external": bool(play.args.get("reset_connector", False))}}]


@step_kind("reset_prefix_cache", Need.ENGINE_UTILITY, summary="reset the prefix cache (and the connector's)",
           fields={"reset_running_requests": f(bool), "reset_connector": f(bool)}, explore="reset",
           serve=_serve_reset, script="""
scheduler.reset_prefix_cache(reset_running_requests=args.get("reset_running_requests", False),
                             reset_connector=args.get("reset_connector", False))
if args.get("reset_connector", False):
    worker.forget()
""")
def _reset_prefix_cache(target: StepTarget, step: ConcreteStep) -> None:
    target.harness.reset_prefix_cache(step.args.get("reset_running_requests", False),
                                      step.args.get("reset_connector", False))


def _validate_expect(args: dict[str, Any], fail: Fail) -> None:
    if "status" in args:
        statuses = args["status"] if isinstance(args["status"], list) else [args["status"]]
        if not statuses:
            raise fail("status", "status must name at least one RequestStatus")
        for status in statuses:
            if not isinstance(status, str) or not re.fullmatch(r"[A-Z_]+", status):
                raise fail("status", f"status must be a RequestStatus name such as WAITING or PREEMPTED, "
                                     f"got {shown(status)}")


# State a step of kind `expect` (a precondition) or a `[[check]]` (a post-condition) can assert.
EXPECT_FIELDS = {
    "request": f(str, required=True),
    "status": f(str, list),
    "allocated_blocks": f(int, minimum=0),
    "min_allocated_blocks": f(int, minimum=0),
    "in_flight_jobs": f(int, minimum=0),
    "min_in_flight_jobs": f(int, minimum=0),
    "store_jobs_built": f(int, minimum=0),
    "min_store_jobs_built": f(int, minimum=0),
    "connector_state": f(str, choices=CONNECTOR_STATES),
    "description": f(str),
}


# The serve level reads no scheduler state from outside the server: its client checks its own precondition
# instead (an aborted request was still queued, from the executor's step log), so `expect` sends nothing.
@step_kind("expect", Need.SCHEDULER_STATE, summary="a precondition on a request's state", fields=EXPECT_FIELDS,
           validate=_validate_expect, serve=lambda play: [], script="expect(args)\n",
           explore=Unsupported("explore judges invariants after every step, not a recipe's preconditions"))
def _expect(target: StepTarget, step: ConcreteStep) -> None:
    if target.observer is None:
        raise InternalError(f"expect (line {step.step.line}) played without an observer to read state")
    held, observed = check_expectation(step.step, target.observer.snapshot())
    if not held:
        raise ExpectationFailed(f"expected {step.args.get('description', step.step.describe())}; "
                                f"observed {observed}")


_LATE_HASHES = Unsupported("late block hashes are an intervention inside kvdoctor's scheduler harness yet: "
                           "attach `kvdoctor repro --report` instead")


# block hashes (and so offload keys) that arrive later than blocks, as in P/D and hybrid deployments
@step_kind("delay_block_hashes", Need.SCHEDULER_CONTROL,
           summary="the request's new full blocks get no block hash (no offload key) until released",
           fields={"request": f(str, required=True)}, script=_LATE_HASHES, explore="delay")
def _delay_block_hashes(target: StepTarget, step: ConcreteStep) -> None:
    target.harness.delay_block_hashes(step.args["request"])


@step_kind("release_block_hashes", Need.SCHEDULER_CONTROL, summary="the withheld block hashes arrive",
           fields={"request": f(str, required=True)}, script=_LATE_HASHES, explore="release")
def _release_block_hashes(target: StepTarget, step: ConcreteStep) -> None:
    target.harness.release_block_hashes(step.args["request"])


_ENGINE_PAUSE = Unsupported("it drives vLLM's scheduler, not its EngineCore, and pausing is the engine's: attach "
                            "`kvdoctor repro --engine core --report`")
_NOT_DRAWN_PAUSE = Unsupported("explore plays the scheduler level, where pausing is refused (the engine's)")


# the engine pauses its scheduler (EngineCore.pause_scheduler): "keep" its requests or "abort" them;
# clear_cache resets the prefix cache (and the connector's) as vLLM's pause does
@step_kind("pause", Need.ENGINE_PAUSE,
           summary="pause the engine's scheduler (mode keep or abort; clear_cache resets the caches)",
           fields={"mode": f(str, choices=PAUSE_MODES), "clear_cache": f(bool)}, script=_ENGINE_PAUSE,
           explore=_NOT_DRAWN_PAUSE)
def _pause(target: StepTarget, step: ConcreteStep) -> None:
    target.harness.pause(step.args.get("mode", "keep"), step.args.get("clear_cache", False))


@step_kind("resume", Need.ENGINE_PAUSE, summary="resume the paused scheduler (queued requests flow again)",
           fields={}, script=_ENGINE_PAUSE, explore=_NOT_DRAWN_PAUSE)
def _resume(target: StepTarget, step: ConcreteStep) -> None:
    target.harness.resume()


SLEEP_TAGS = ("weights", "kv_cache", "scheduling")  # what EngineCore.wake_up takes ("scheduling": level 0)


def _validate_wake_up(args: dict[str, Any], fail: Fail) -> None:
    tags = args.get("tags")
    if tags is not None and (not tags or not all(isinstance(t, str) and t in SLEEP_TAGS for t in tags)):
        raise fail("tags", f"tags must be a non-empty array of {', '.join(SLEEP_TAGS)}, got {shown(tags)}")


# vLLM's sleep mode (EngineCore.sleep): the scheduler is paused as `pause` pauses it ("abort" by default, as vLLM's);
# level >= 1 also resets the prefix cache and the connector's (reset_connector = false keeps the connector's where
# the release's sleep takes it: a probe) and puts the executor to sleep (kvdoctor's executor stands in for the
# model's memory: it records the sleep and answers the next step as a woken one); wake_up resumes the scheduler once
# the executor is fully awake (a partial wake, `tags`, keeps it paused). Explore draws both only under `--force
# sleep-wake` (explore/generate.py SLEEP_DRAW) and plays those examples at --engine core.
@step_kind("sleep", Need.ENGINE_PAUSE,
           summary="put the engine to sleep (level 0: pause; 1-2: also reset the caches, the executor sleeps)",
           fields={"level": f(int, minimum=0, maximum=2), "mode": f(str, choices=PAUSE_MODES),
                   "reset_connector": f(bool)}, script=_ENGINE_PAUSE,
           explore="sleep")
def _sleep(target: StepTarget, step: ConcreteStep) -> None:
    target.harness.sleep(step.args.get("level", 1), step.args.get("mode", "abort"), step.args.get("reset_connector"))


@step_kind("wake_up", Need.ENGINE_PAUSE, summary="wake the engine (EngineCore.wake_up; all of it unless `tags`)",
           fields={"tags": f(list)}, validate=_validate_wake_up, script=_ENGINE_PAUSE,
           explore="wake_up")
def _wake_up(target: StepTarget, step: ConcreteStep) -> None:
    target.harness.wake_up(step.args.get("tags"))
# -- the P2P pair (issue 36): [setup] p2p = true plays the recipe's engine as the consumer (decode) of a
# producer (prefill) engine beside it, both on vLLM's P2P tier over kvdoctor's in-memory fabric
# (engine/p2p.py). `schedule` steps both engines; these kinds drive what only the pair has.
P2P_SIDES = ("producer", "consumer")
P2P_ROLES = ("pd", "symmetric", "none")  # how the request names its peer (kv_transfer_params)
_P2P_SCRIPT = Unsupported("the exported script drives one scheduler; the P2P pair is two engines on kvdoctor's "
                          "in-memory fabric: attach `kvdoctor repro --report`")
_P2P_EXPLORE = Unsupported("explore draws the P2P pair as a whole plan from its probe-gated branch "
                           "(explore/tier_draw.p2p_plan_fields), not as single events")


def _validate_p2p_fabric(args: dict[str, Any], fail: Fail) -> None:
    drop = args.get("drop", [])
    if not all(isinstance(kind, str) and kind for kind in drop):
        raise fail("drop", f"drop must be an array of P2P control message types (e.g. \"fetch\"), got {shown(drop)}")


def _validate_p2p_add(args: dict[str, Any], fail: Fail) -> None:
    if ("shared_prefix_with" in args) != ("shared_prefix_tokens" in args):
        raise fail(None, "needs both 'shared_prefix_with' and 'shared_prefix_tokens', or neither")


# the prompt is the compiler's (distinct per request, or sharing `shared_prefix_tokens` with another's: the
# consumer's request shares the producer's prefix to fetch it)
@step_kind("p2p_add", Need.P2P_PAIR, summary="admit a request on the producer or the consumer of the P2P pair",
           admits=True, fields={"side": f(str, required=True, choices=P2P_SIDES), "request": f(str, required=True),
                                "prompt_tokens": f(int, required=True, minimum=1, maximum=TOKENS_BOUND),
                                "max_tokens": f(int, minimum=1, maximum=TOKENS_BOUND),
                                "shared_prefix_with": f(str),
                                "shared_prefix_tokens": f(int, minimum=1, maximum=TOKENS_BOUND),
                                "role": f(str, choices=P2P_ROLES), "kv_request_id": f(str)},
           validate=_validate_p2p_add, script=_P2P_SCRIPT, explore=_P2P_EXPLORE)
def _p2p_add(target: StepTarget, step: ConcreteStep) -> None:
    for request in step.requests:
        target.harness.p2p("add", {**step.args, "request": request.request, "prompt": list(request.prompt),
                                   "max_tokens": request.max_tokens})


@step_kind("p2p_abort", Need.P2P_PAIR, summary="abort a request on one side of the P2P pair",
           fields={"side": f(str, required=True, choices=P2P_SIDES), "request": f(str, required=True)},
           script=_P2P_SCRIPT, explore=_P2P_EXPLORE)
def _p2p_abort(target: StepTarget, step: ConcreteStep) -> None:
    target.harness.p2p("abort", step.args)


@step_kind("p2p_kill", Need.P2P_PAIR,
           summary="a side of the P2P pair dies (its connections read dead at the next poll; the consumer's engine "
                   "steps on, its P2P tier cut off)",
           fields={"side": f(str, required=True, choices=P2P_SIDES)}, script=_P2P_SCRIPT, explore=_P2P_EXPLORE)
def _p2p_kill(target: StepTarget, step: ConcreteStep) -> None:
    target.harness.p2p("kill", step.args)


@step_kind("p2p_fabric", Need.P2P_PAIR, summary="the fabric's faults from now on: dropped message types, delays, "
                                               "failed transfers",
           fields={"drop": f(list), "delay_polls": f(int, minimum=0, maximum=1000), "fail_transfers": f(bool)},
           validate=_validate_p2p_fabric, script=_P2P_SCRIPT, explore=_P2P_EXPLORE)
def _p2p_fabric(target: StepTarget, step: ConcreteStep) -> None:
    target.harness.p2p("fabric", step.args)


@step_kind("p2p_clock", Need.P2P_PAIR, summary="advance the clock vLLM's P2P tier reads (its timeouts) by seconds",
           fields={"advance_s": f(int, required=True, minimum=1, maximum=3600)}, script=_P2P_SCRIPT,
           explore=_P2P_EXPLORE)
def _p2p_clock(target: StepTarget, step: ConcreteStep) -> None:
    target.harness.p2p("clock", step.args)


# -- a P/D decode node (issue 35, vllm#52170): [setup] pd_decode = true puts kvdoctor's stand-in for NIXL first in
# vLLM's MultiConnector (engine/compat/pd_connector.py); an `add` whose kv_transfer_params say do_remote_prefill
# is loaded by it (every prompt token external, asynchronously). `pd_fail` fails that request's load when it ends
# (the step after it is issued): its blocks are reported as vLLM's NIXL reports a failed load.
@step_kind("pd_fail", Need.PD_DECODE, summary="the remote-prefill load of a request fails (all or its first "
                                               "`blocks` blocks), as NIXL reports a failed load",
           fields={"request": f(str, required=True), "blocks": f(int, minimum=1)},
           script=Unsupported("the exported script drives vLLM's OffloadingConnector alone; the P/D stand-in is "
                              "kvdoctor's: attach `kvdoctor repro --report`"),
           explore=Unsupported("not a drawn event: explore's forced pd-decode branch (`--force pd-decode`) adds it "
                               "after every fourth request"))
def _pd_fail(target: StepTarget, step: ConcreteStep) -> None:
    target.harness.pd_fail(step.args["request"], step.args.get("blocks"))


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
    for kind in REGISTRY.values():  # declaration order: the loader's vocabulary order
        marks = " | ".join("x" if need in kind.needs else "" for need in needs)
        lines.append(f"| `{kind.name}` | {marks} | {kind.summary} |")
    lines += ["", "Needs:", ""]
    lines += [f"- `{need.value}`: {need.meaning}" for need in needs]
    lines += ["", "Fields, the exported script and explore:", "",
              "| step kind | fields (* required) | exported script | explore draws it as |", "|---|---|---|---|"]
    for kind in REGISTRY.values():
        names = ", ".join(f"`{name}`{'*' if spec.required else ''}" for name, spec in kind.fields.items()) or "none"
        script = kind.script.why if isinstance(kind.script, Unsupported) else "yes"
        drawn = kind.explore.why if isinstance(kind.explore, Unsupported) else f"`{kind.explore}`"
        lines.append(f"| `{kind.name}` | {names} | {script} | {drawn} |")
    lines += ["", ADDING]
    return "\n".join(lines) + "\n"


ADDING = """## Adding a step kind

One declaration in `kvdoctor/steps.py`: `@step_kind(name, needs..., summary=, fields=, validate=, serve=,
script=, explore=)` on its handler. The recipe loader then accepts it (its fields, types, bounds and checks),
the compiler plays it, both engine levels play it through the `Harness` protocol (or refuse it by its
needs, naming the step), the serve level sends its events (or refuses it), the exported script runs its
`script` lines (or refuses the export, naming the step) and explore draws it (or says why not).

1. If the handler needs a harness call that does not exist yet, add it to the `Harness` protocol and to
   `kvdoctor/engine/harness.py` (and `kvdoctor/engine/core/harness.py` where the engine does it its own way).
2. If it needs a capability no `Need` names, add the need here and each level's answer in
   `kvdoctor/levels/table.py`.
3. To have explore draw it (`explore="event"`), add the event to `EVENT_TABLE` and its translation to
   `event_steps` in `kvdoctor/explore/generate.py` (this changes what every seed draws); else
   `explore=Unsupported(why)`. The generator refuses, at import, an event table and declarations that differ.
4. Regenerate this file (`KVDOCTOR_UPDATE_DOCS=1 pytest tests/test_steps.py`) and the step table of
   `docs/engine-levels.md` (`levels.table.markdown_table()`, checked by `tests/test_engine_core.py`);
   `tests/test_steps.py` fails until every level, the exported scripts and explore have an answer for it.

Measured on a throw-away kind (`unfinish`: a `finish` not yet sampled is called off; one new harness
call; its test on the real scheduler), then reverted: 5 files, `kvdoctor/steps.py` (declaration, handler,
the protocol's new call), `kvdoctor/engine/harness.py` (the call; vLLM's EngineCore harness inherits it),
`tests/test_steps.py` (its test; the recorder's call-to-need table), `docs/steps.md` and
`docs/engine-levels.md` (both regenerated tables). The loader, compiler, serve level, exported scripts and
explore needed no edit: they read the declaration."""
