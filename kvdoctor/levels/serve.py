"""`--engine serve`: the recipe as HTTP traffic to a real `vllm serve` child on 127.0.0.1.

kvdoctor starts `python -m vllm.entrypoints.cli.main serve` (the installed vLLM) in its own
process group on a free loopback port, with kvdoctor's platform plugin switched on for that child
only (`KVDOCTOR_ENGINE_PLATFORM=1`) and kvdoctor's executor (`--distributed-executor-backend`),
which paces the engine (`KVDOCTOR_ENGINE_STEP_SECONDS`) so that each client event lands between
the steps the recipe names. The recipe's steps become traffic, each kind's as its declaration says
(`serve` in `kvdoctor.steps`): `add` is a `/v1/completions` request with a token-id prompt (its
`X-Request-Id` names the recipe's request; `continues`: the prompt and completion its client received
first), `schedule` is one paced step of waiting, `abort` is the client closing its connection,
`finish` travels with its request (an EOS schedule in its `vllm_xargs`). `expect` is not played (the
server's scheduler cannot be read from outside).

The verdict of a crash recipe comes from what the server did: its log read with `diagnose`'s reader
(exception, function, frames) matched against the recipe's signature, or, when it survived, `/health`
and a fresh request served; its precondition (an aborted request was never scheduled) from the
executor's step log. A silent bug's verdict is what its clients received: the server's executor runs
vLLM's worker on fingerprint KV and the stand-in model answers from the KV bytes it reads; each
completion is compared with the same traffic's on a second server with offloading off. Each child is
always stopped by its process group, bounded in time, also when kvdoctor fails or is interrupted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvdoctor.engine.compat import VllmApi
from kvdoctor.engine.connector_config import MULTI_CONNECTOR, multi_offloading_extra_config
from kvdoctor.engine.core.names import (
    ADMISSION_ENV,
    EOS_AFTER_ARG,
    EXECUTOR_QUALNAME,
    PACE_STEPS_ENV,
    PLAN_ENV,
    STEP_SECONDS_ENV,
    UNANSWERED_LOG_PREFIX,
    WORKER_ENV,
)
from kvdoctor.engine.core.platform import ENV as PLATFORM_ENV
from kvdoctor.engine.overrides import Overrides
from kvdoctor.engine.serve_args import serve_command_flags
from kvdoctor.engine.setup import Setup
from kvdoctor.engine.step_loop import EOS_TOKEN
from kvdoctor.engine.tiny_model import tiny_model_dir
from kvdoctor.errors import InternalError, UsageError
from kvdoctor.installed import vllm_version
from kvdoctor.levels.core import setup_unexpressible as core_setup_unexpressible
from kvdoctor.levels.in_process import Progress
from kvdoctor.levels.table import unexpressible
from kvdoctor.matrix.known import FixedIn
from kvdoctor.observe.failure import Failure, Frame
from kvdoctor.observe.verdict import ClientAnswers, Outcome, compare_completions, failure_verdict
from kvdoctor.recipes.compile import compile_recipe
from kvdoctor.recipes.geometry import cpu_tier_chunks, tier_bytes
from kvdoctor.recipes.model import Recipe
from kvdoctor.results import AuditRow, ReproReport, RunResult
from kvdoctor.steps import kind_of

if TYPE_CHECKING:
    from kvdoctor.diagnose.reader import LogSummary
    from kvdoctor.diagnose.traceback import LogTraceback

NAME = "serve"

STEP_SECONDS = float(os.environ.get("KVDOCTOR_SERVE_STEP_SECONDS", "1.0"))  # engine step pacing
STARTUP_LIMIT_S = float(os.environ.get("KVDOCTOR_SERVE_STARTUP_S", "420"))


@dataclass
class Event:
    kind: str  # "add" | "step" | "abort"
    request: str = ""
    prompt: list[int] = field(default_factory=list)
    max_tokens: int = 0
    # the add's body fields as a client sends them: kv_transfer_params, priority, stop_token_ids, vllm_xargs
    extra: dict[str, Any] = field(default_factory=dict)
    continues: str = ""  # the add continues this request's conversation (its prompt and completion first)


class Unexpressible(Exception):
    """A step the serve client cannot send as the recipe schedules it (the recipe is not_applicable)."""


# Steps the executor inside the server plays on the recipe's schedule (its plan, `executor_plan`), where the
# server runs vLLM's worker on kvdoctor's copy engine (a silent recipe): transfer holds, completions, failures.
EXECUTOR_PLAYED = frozenset({"hold_transfers", "complete_transfers", "fail_transfers"})


def plan_traffic(recipe: Recipe, setup: Setup) -> list[Event]:
    """The recipe's steps as client events, each kind's as its declaration says (`serve` in `kvdoctor.steps`),
    compiled exactly as the scheduler level plays them (the same fill plan, prompts and repeats:
    `recipes.compile.compile_recipe`). A kind without serve events is refused first (`unplayable`); reaching
    one here is kvdoctor's bug, never a step left out of the traffic. A `finish` travels with its request
    (the EOS schedule in its vllm_xargs, read by kvdoctor's executor) before the request's first engine step;
    a later one, and the transfer steps, are the executor's plan (`executor_plan`)."""
    return _plan(recipe, setup)[0]


def executor_plan(recipe: Recipe, setup: Setup) -> list[dict[str, Any]]:
    """What kvdoctor's executor inside the server plays itself, keyed by its engine step (1: the step the
    first request arrives in; the client's events are paced to the same count): {"step": N, "action":
    "hold" | "complete" | "fail" | "eos", "request": the recipe's name or None, "tag": what the server's request
    id holds for it (`serve_client.request_tag`), "kind": store | load | None}."""
    return _plan(recipe, setup)[1]


def _plan(recipe: Recipe, setup: Setup) -> tuple[list[Event], list[dict[str, Any]]]:
    from kvdoctor.levels.serve_client import request_tag  # deferred with the HTTP client (see serve_all)

    events: list[Event] = []
    plan: list[dict[str, Any]] = []
    for play in compile_recipe(recipe.steps, setup).steps:
        step = sum(1 for e in events if e.kind == "step") + 1  # the engine step the next one lands in
        if play.action in EXECUTOR_PLAYED:
            if play.args.get("worker") is not None:
                raise Unexpressible(f"step {play.counter} (line {play.step.line}) `{play.action}` worker = "
                                    f"{play.args['worker']}: the served executor runs one worker")
            request = play.args.get("request")
            plan.append({"step": step, "action": play.action.split("_")[0], "request": request,
                         "tag": request_tag(request) if request else None, "kind": play.args.get("kind")})
            continue
        serve_events = kind_of(play.action).serve
        if serve_events is None:
            raise InternalError(f"step kind {play.action!r} (line {play.step.line}) has no serve events and was "
                                f"not refused")
        for event in (Event(**e) for e in serve_events(play)):
            if event.kind != "finish":
                events.append(event)
            elif not _send_eos_with_the_request(events, event.request):
                if not recipe.signature.invariant:
                    raise Unexpressible(f"step {play.counter} (line {play.step.line}) `finish` cannot be played "
                                        f"through vllm serve: a client sends a request's EOS schedule with the "
                                        f"request (vllm_xargs), so only a finish before {event.request}'s first "
                                        f"engine step can be expressed (a silent recipe's executor plays a later "
                                        f"one on its schedule)")
                plan.append({"step": step, "action": "eos", "request": event.request,
                             "tag": request_tag(event.request), "kind": None})
    return events, plan


def _send_eos_with_the_request(events: list[Event], request: str) -> bool:
    """The add of `request` gets its EOS schedule (its first sampled token is EOS) when no engine step came
    between them (True); else False: the client cannot tell the server when."""
    adds = [i for i, e in enumerate(events) if e.kind == "add" and e.request == request]
    if not adds or any(e.kind == "step" for e in events[adds[-1]:]):
        return False
    add = events[adds[-1]]
    add.extra = {**add.extra, "vllm_xargs": {EOS_AFTER_ARG: 0}}
    return True


def admission_len(setup: Setup) -> int:
    """The max_model_len vLLM's start-up check is run with (halved until one request fits the tiny
    pool; `compat._within_admission_check` does the same at the scheduler level)."""
    length = setup.max_model_len
    while length > 1 and length > (setup.gpu_blocks - 1) * setup.block_size:
        length //= 2
    return length


def served_tiers(setup: Setup, model_dir: str) -> Setup:
    """The CPU tiers in the served model's bytes: as many chunks as the in-process levels' tiers hold. Those
    size a chunk by kvdoctor's tiny KV spec (64 bytes a token); the served tiny Llama keeps every layer's K and V
    (256 bytes a token), so a recipe's one-chunk tier (K9's watched connector: 4 KiB) held no chunk at serve and
    its connector stored nothing (measured on 0.26.0: no store job of the watched connector in any step)."""
    if not setup.offloading or setup.model is not None:
        return setup
    served = dataclasses.replace(setup, model=model_dir)
    second = dataclasses.replace(setup, cpu_bytes_to_use=setup.second_cpu_bytes_to_use)
    return dataclasses.replace(setup, cpu_bytes_to_use=tier_bytes(served, cpu_tier_chunks(setup)),
                               second_cpu_bytes_to_use=tier_bytes(served, cpu_tier_chunks(second)))


def serve_command(setup: Setup, model_dir: str, port: int) -> list[str]:
    """The `vllm serve` command of a setup (offloading off: no --kv-transfer-config; vLLM's worker: kvdoctor's
    copy-engine spec named in the connector's config, as `--engine core` runs it), its CPU tiers in the served
    model's bytes (`served_tiers`). The exported serve script takes its flags from here too."""
    setup = served_tiers(setup, model_dir)
    kv_flags: list[str] = []
    if setup.offloading:
        served = dataclasses.replace(setup, device=None)
        extra = served.kv_connector_extra_config()
        connector = "OffloadingConnector"
        second = served.second_connector_extra_config()
        if second is not None:  # multi_connector: the same two sub-connectors `--engine core` runs
            role = str(setup.kv_transfer_fields.get("kv_role", "kv_both"))
            extra, connector = multi_offloading_extra_config(extra, second, role), MULTI_CONNECTOR
        kv_transfer = {"kv_connector": connector, "kv_role": "kv_both",
                       "kv_connector_extra_config": extra, **setup.kv_transfer_fields}
        kv_flags = ["--kv-transfer-config", json.dumps(kv_transfer)]
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model_dir, "--host", "127.0.0.1",
            "--port", str(port), "--skip-tokenizer-init", "--dtype", "float16", "--seed", "0",
            *serve_command_flags(setup),  # the geometry, from the one serve-flag table
            "--enforce-eager", "--enable-prompt-tokens-details",  # a client sees its prefix hits (cached_tokens)
            *kv_flags, "--distributed-executor-backend", EXECUTOR_QUALNAME]


# Engine steps paced past the client's last event: its arrival needs up to two (the client's own wait before an
# event), and two more keep a loaded machine's late arrival inside the paced steps.
PACE_MARGIN_STEPS = 4


def paced_steps(events: list[Event]) -> int:
    """How many engine steps the executor paces (`STEP_SECONDS` each): up to the client's last event's step and
    `PACE_MARGIN_STEPS` more. Later steps have nothing to land between them (the recipe's trailing `schedule`
    steps only let the engine run, and the executor's plan is keyed by engine step, not by the clock): the
    engine runs them at full speed (K11: 8 paced steps of ~150)."""
    last = max((i for i, e in enumerate(events) if e.kind != "step"), default=-1)
    return sum(e.kind == "step" for e in events[:last + 1]) + 1 + PACE_MARGIN_STEPS


def serve_env(setup: Setup, plan: list[dict[str, Any]] | None = None, pace_steps: int | None = None) -> dict[str, str]:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])  # kvdoctor's own code first, in both server processes
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update({PLATFORM_ENV: "1", STEP_SECONDS_ENV: str(STEP_SECONDS), ADMISSION_ENV:
                str(admission_len(setup)), WORKER_ENV: setup.worker, "KVDOCTOR_VERBOSE_IMPORT": "1",
                "VLLM_LOGGING_LEVEL": "INFO", "VLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1",
                PLAN_ENV: json.dumps(plan or [])})  # the executor's own steps (`executor_plan`)
    if pace_steps is not None:
        env[PACE_STEPS_ENV] = str(pace_steps)
    return env


def plugin_registered() -> bool:
    """Whether this environment's kvdoctor distribution registers the platform plugin (pyproject)."""
    from importlib.metadata import entry_points

    return any(ep.value == "kvdoctor.engine.core.platform:register"
               for ep in entry_points(group="vllm.platform_plugins"))


def check_plugin() -> None:
    """A usage error (before vLLM is imported) where the serve level cannot start its server."""
    if not plugin_registered():
        raise UsageError("--engine serve: kvdoctor's vLLM platform plugin is not registered in this environment "
                         "(the entry point `vllm.platform_plugins: kvdoctor_cpu` of kvdoctor's pyproject); "
                         "reinstall kvdoctor here (pip install -e . / uv sync)")


def engine_crash(summary: LogSummary) -> LogTraceback | None:
    """The engine core's fatal traceback, if the log has one. Not the API server's re-raise, and not a
    traceback the API server logs and survives (0.34's chat-template warm-up without a tokenizer)."""
    for tb in summary.tracebacks:
        if tb.is_reraise:
            continue
        if tb.after_fatal_marker or "EngineCore" in (tb.process or ""):
            return tb
    return None


def _failure_from_log(crash: LogTraceback) -> Failure:
    from kvdoctor.diagnose.traceback import display_path  # deferred with the log reader (run_serve)

    frame = crash.vllm_frames[-1] if crash.vllm_frames else None  # the innermost vLLM frame
    frames = []
    for f in crash.vllm_frames:
        try:
            frames.append(Frame(file=display_path(f.file), line=f.line, function=f.function, code=f.code))
        except TypeError:
            break
    return Failure(exception=crash.exception or "?", message=crash.message, file=display_path(frame.file) if frame
                   else None, line=frame.line if frame else None, function=frame.function if frame else None,
                   code=frame.code if frame else None, vllm_frames=frames, in_vllm=frame is not None)


def unplayable(recipe: Recipe, setup: Setup, client: str) -> list[str]:
    """Why this recipe cannot be played through `vllm serve` (empty: it can), for kvdoctor's serve level and
    the exported serve script alike: the kinds without serve events, by their needs; a step the client
    cannot send as the recipe schedules it (`plan_traffic`). `expect` sends nothing (the server's scheduler
    cannot be read from outside): a silent bug's verdict is what its clients received; a crash recipe's is
    whether the engine died, and for an aborted request its client checks its own precondition, that the
    request was still queued, from the executor's step log (`judge_run`). A silent recipe's transfer steps and
    late finishes are the executor's plan (`executor_plan`: its server runs vLLM's worker on kvdoctor's copy
    engine, which holds, completes and fails jobs)."""
    otherwise = frozenset({"expect"}) | (EXECUTOR_PLAYED if recipe.signature.invariant else frozenset())
    reasons = unexpressible(list(recipe.steps), "serve", setup.async_scheduling, played_otherwise=otherwise)
    if not reasons:
        try:
            plan_traffic(recipe, setup)
        except Unexpressible as exc:
            reasons = [str(exc)]
    return reasons


def setup_unexpressible(setup: Setup) -> list[str]:
    """Geometry the served engine does not build: `vllm serve` runs kvdoctor's tiny full-attention model (its
    executor gives every decoder layer a full-attention spec), not another model's or a shipped layout."""
    if setup.model is not None or setup.layout is not None:
        return [f"the served engine runs kvdoctor's tiny full-attention model; {setup.model or setup.layout}'s KV "
                f"layout is not built at --engine serve (play it with --engine core)"]
    if setup.p2p:
        return ["[setup] p2p: the served engine is one `vllm serve`; the P2P pair is two engines on kvdoctor's "
                "in-memory fabric (play it with --engine core)"]
    if setup.kv_events:
        return ["kv_events: the served engine's KV events go to a ZMQ publisher kvdoctor's serve client does not "
                "subscribe to, and no client's answer shows a lost event (play it with --engine core)"]
    return []


def answers_unexpressible(recipe: Recipe, setup: Setup) -> list[str]:
    """Why a silent recipe's clients cannot get a wrong answer from this served setup (empty: they can)."""
    if not recipe.signature.invariant:
        return []
    why = setup.vllm_worker_unsupported()
    if why:
        return [f"a silent bug is judged at serve by its clients' answers, which need vLLM's worker moving KV "
                f"bytes in the server's executor: {why}; --engine core plays it on kvdoctor's simulated worker "
                f"for the same reason and compares no client's completion there (no KV bytes move, so every "
                f"client gets right KV's answer): no answer differs at core, so none could at serve (play it "
                f"with --engine core: its invariant is the verdict)"]
    return core_setup_unexpressible(setup)


@dataclass
class Served:
    """One server's run of the traffic: what its clients got, and its log."""

    ready: bool
    played: Any  # serve_client.Played
    text: str
    lines: list[str]
    crash: LogTraceback | None
    returncode: int | None


Run = tuple[Setup, list[Event], list[dict[str, Any]]]  # a server's setup, its clients' traffic, its executor's plan


def serve_all(runs: list[Run]) -> list[Served]:
    """Start a fresh server per (setup, traffic), all at once (their start-ups, mostly `import vllm`, and
    their paced traffic overlap), play each its traffic, stop them all (each its process group, bounded),
    also when kvdoctor fails or is interrupted."""
    # Deferred to a served run: the HTTP client (asyncio) and diagnose's log reader cost ~0.2 s that every
    # in-process repro would pay when `levels.runners` imports this module.
    import asyncio

    from kvdoctor.diagnose.reader import read_stream
    from kvdoctor.levels.serve_client import Played, Server, free_port, play, wait_ready

    model = tiny_model_dir()
    started: list[tuple[Server, int, Path]] = []
    outcomes: list[tuple[bool, Any]] = [(False, Played()) for _ in runs]

    async def one(index: int, server: Server, port: int, events: list[Event], plan: list[dict[str, Any]]) -> None:
        ready = await wait_ready(port, server, STARTUP_LIMIT_S)
        outcomes[index] = (ready, Played())
        if ready:  # a plan's engine steps lag the client's clock on a loaded machine (measured ~25% over 150
            # steps at load 10): its requests get half the recipe's steps more to finish (ends when they have)
            settle = 30 + sum(e.kind == "step" for e in events) // 2 if plan else 4
            outcomes[index] = (True, await play(port, model, [dataclasses.asdict(e) for e in events], STEP_SECONDS,
                                                settle_steps=settle))

    async def every(jobs: list[Any]) -> None:
        await asyncio.gather(*jobs)

    texts: list[str] = []
    with _terminate_as_interrupt():
        try:
            ports: set[int] = set()
            for setup, events, plan in runs:
                workdir = Path(tempfile.mkdtemp(prefix="kvdoctor-serve-"))
                port = free_port()
                while port in ports:
                    port = free_port()
                ports.add(port)
                server = Server(serve_command(setup, model, port),
                                serve_env(setup, plan, paced_steps(events)), str(workdir / "server.log"))
                started.append((server, port, workdir))
                print(f"kvdoctor: `vllm serve` child PID {server.pid} on 127.0.0.1:{port} (stopped by its process "
                      f"group when the run ends)", file=sys.stderr, flush=True)
            asyncio.run(every([one(i, server, port, runs[i][1], runs[i][2])
                               for i, (server, port, _) in enumerate(started)]))
            time.sleep(1.0)
        finally:
            for server, _port, _workdir in started:  # all at once: each shutdown takes seconds on a loaded machine
                server.terminate()
            for server, _port, workdir in started:
                server.stop()
                texts.append((workdir / "server.log").read_text(errors="replace"))
                shutil.rmtree(workdir, ignore_errors=True)
    served = []
    for (server, _port, _workdir), text, (ready, played) in zip(started, texts, outcomes, strict=True):
        summary = read_stream(io.BytesIO(text.encode()), "server.log")
        served.append(Served(ready, played, text, text.splitlines(), engine_crash(summary), server.proc.returncode))
    return served


@dataclass
class Planned:
    """A recipe the serve client can play: its result so far, and the servers it needs (setup, traffic):
    one, and for a silent bug a second with offloading off (its reference)."""

    recipe: Recipe
    result: RunResult
    events: list[Event]
    runs: list[Run]


def plan_run(recipe: Recipe, setup: Setup) -> Planned | RunResult:
    """The recipe's servers and traffic, or its not_applicable result (no server started)."""
    result = RunResult(logic="installed", outcome=Outcome.NOT_REPRODUCED)
    result.worker = ("kvdoctor's simulated worker inside kvdoctor's executor in a `vllm serve` child "
                     "(EngineCoreProc's busy loop calls the scheduler); kvdoctor is its HTTP client")
    reasons = (unplayable(recipe, setup, "kvdoctor's serve client") or setup_unexpressible(setup)
               or answers_unexpressible(recipe, setup))
    if reasons:
        result.outcome = Outcome.NOT_APPLICABLE
        result.detail = "; ".join(reasons)
        result.unplayable = True
        return result
    silent = bool(recipe.signature.invariant)
    if silent:
        setup = dataclasses.replace(setup, worker="vllm", device=None, worker_fallback=None)
        result.worker = ("vLLM's worker-role OffloadingConnector on fingerprint KV (kvdoctor's copy engine, the "
                         "stand-in model reading each answer from the KV bytes) inside kvdoctor's executor in a "
                         "`vllm serve` child (EngineCoreProc's busy loop calls the scheduler); kvdoctor is its "
                         "HTTP client")
    events, plan = _plan(recipe, setup)
    # a silent bug's reference: the same traffic (and the same finishes) on a server with offloading off
    return Planned(recipe, result, events,
                   [(setup, events, plan)] + ([(reference_setup(setup), events, plan)] if silent else []))


def run_many(items: list[tuple[Recipe, Setup]]) -> list[tuple[RunResult, str]]:
    """Every recipe's servers started at once (`serve_all`: their start-ups and paced traffic overlap), each
    judged from its own servers; returns (result, the offloading-on server's log text) per recipe."""
    plans = [plan_run(recipe, setup) for recipe, setup in items]
    runs = [run for plan in plans if isinstance(plan, Planned) for run in plan.runs]
    if runs:
        check_plugin()
    served = serve_all(runs)
    out: list[tuple[RunResult, str]] = []
    for plan in plans:
        if not isinstance(plan, Planned):
            out.append((plan, ""))
            continue
        mine, served = served[:len(plan.runs)], served[len(plan.runs):]
        out.append((judge_run(plan, mine), mine[0].text))
    return out


def run_serve(recipe: Recipe, setup: Setup) -> tuple[RunResult, str]:
    """Play the recipe against fresh servers; returns (its result, the server's log text). A silent bug's
    verdict is its clients' answers against a second server's with offloading off (`_judge_answers`)."""
    return run_many([(recipe, setup)])[0]


def judge_run(plan: Planned, servers: list[Served]) -> RunResult:
    """The verdict from what the recipe's servers did (the first: offloading on)."""
    from kvdoctor.levels.serve_client import aborted_while_queued, ever_scheduled, step_log

    recipe, result, events = plan.recipe, plan.result, plan.events
    served, *reference = servers
    silent = bool(reference)
    aborted = [e.request for e in events if e.kind == "abort"]
    lines, played = served.lines, served.played
    engine_steps = len(step_log(lines))
    if not served.ready:
        result.outcome = Outcome.OTHER_FAILURE
        result.detail = (f"the server did not become ready within {STARTUP_LIMIT_S:.0f} s (exit code "
                         f"{served.returncode}); its log: {_tail(lines)}")
        if served.crash is not None:
            result.failure = _failure_from_log(served.crash)
        return result
    queued = {name: aborted_while_queued(lines, name) for name in aborted}
    if served.crash is not None:
        failure = _failure_from_log(served.crash)
        result.failure = failure
        result.failure_step = engine_steps + 1  # the engine step that raised (steps logged before it)
        # the server's traceback does not name the request: the signature's request cannot be checked
        result.outcome, why = failure_verdict(recipe.signature, failure, names_request=False)
        if result.outcome is Outcome.REPRODUCED and aborted:
            seen = ", ".join(f"{name} {'was scheduled before' if ever_scheduled(lines, name) else 'never scheduled'}"
                             for name in aborted)
            result.detail = (f"the engine died ({seen}, per the executor's step log; the server's traceback "
                             f"does not name the request)")
        elif result.outcome is Outcome.REPRODUCED:
            result.detail = (f"the engine died at its step {engine_steps + 1} (the server's traceback does not name "
                             f"the request; the recipe's expect steps are not checked at serve)")
        else:
            result.detail = f"the engine died with {why}"
        return result
    if not (played.healthy and played.fresh_served):
        result.outcome = Outcome.OTHER_FAILURE
        result.detail = ("the server stopped serving without a traceback kvdoctor could read: "
                         + "; ".join(played.notes[-4:]))
        return result
    if silent:
        unanswered = [line.strip() for line in lines if UNANSWERED_LOG_PREFIX in line]
        if unanswered:  # kvdoctor's stand-in gave no answer: the comparison is void, never a vLLM finding
            result.outcome = Outcome.OTHER_FAILURE
            result.detail = (f"kvdoctor's stand-in model gave no answer for a sampled token (kvdoctor's bug, not a "
                             f"client's wrong answer; the comparison is void): "
                             f"{unanswered[0].split(UNANSWERED_LOG_PREFIX, 1)[1].strip()} (engine step: requests)")
            return result
        return _judge_answers(result, events, played, reference[0])
    if not aborted:
        result.detail = ("the server survived the recipe's traffic: /health 200 and a fresh request served (the "
                         "recipe's expect steps are not checked at serve: a client cannot read the scheduler)")
        return result
    missed = [name for name, was in queued.items() if not was]
    if missed:
        result.outcome = Outcome.NOT_REACHED
        result.detail = (f"the server survived, but {', '.join(missed)} was not aborted while queued (the "
                         f"executor's step log shows it scheduled first, or never finished): the run did not "
                         f"test the bug")
    else:
        result.detail = (f"the server survived: {', '.join(aborted)} aborted while queued (never scheduled, "
                         f"per the executor's step log); /health 200 and a fresh request served")
    return result


REFERENCE = "offloading off, a second server"


def reference_setup(setup: Setup) -> Setup:
    """The run's own reference: the same geometry with offloading off (the engine computes every token's KV
    itself; the stand-in model's answer is then the tokens' own), as `--engine core` makes it."""
    return dataclasses.replace(setup, offloading=False, multi_connector=False, worker="simulated", device=None)


def _judge_answers(result: RunResult, events: list[Event], played: Any, reference: Served) -> RunResult:
    """A silent bug at serve: reproduced when a client's completion differs from the one the same traffic gets
    from a server with offloading off (the run's own reference; `verdict.compare_completions`, the
    comparison `--engine core` makes). The recipe's `expect` steps are not checked (the server's scheduler
    is not readable from outside): a run whose requests were not all answered did not test the bug."""
    if not (reference.ready and reference.crash is None and reference.played.healthy):
        result.outcome = Outcome.OTHER_FAILURE
        result.answers = ClientAnswers(REFERENCE, not_compared="the reference server did not serve the traffic: "
                                       + "; ".join(reference.played.notes[-3:] or [_tail(reference.lines)]))
        result.detail = result.answers.line
        return result

    def answer(tokens: list[int]) -> list[int]:
        return [t for t in tokens if t != EOS_TOKEN]  # the recipe's EOS is the recipe's, not the model's

    answers = compare_completions({k: answer(v) for k, v in played.completions.items()},
                                  {k: answer(v) for k, v in reference.played.completions.items()}, REFERENCE)
    result.answers = answers
    sent = [e.request for e in events if e.kind == "add"]
    unanswered = [name for name in sent if name not in played.completions]
    if answers.reproduced:
        result.outcome = Outcome.REPRODUCED
        result.detail = f"a client got another answer: {answers.line}"
    elif unanswered or answers.missing:
        result.outcome = Outcome.NOT_REACHED
        result.detail = (f"not every request was answered (offloading on, unanswered: {', '.join(unanswered) or 'none'}"
                         f"; answered by one server only: {', '.join(answers.missing) or 'none'}): the run did not "
                         f"test the bug")
    else:
        result.outcome = Outcome.NOT_REPRODUCED
        result.detail = f"no client got another answer: {answers.line}"
    cached = cached_tokens_line(played, reference.played)
    if cached:
        result.detail += f"; {cached}"
    result.detail += " (the recipe's expect steps are not checked at serve: a client cannot read the scheduler)"
    return result


def cached_tokens_line(played: Any, reference: Any) -> str:
    """What each client saw of its prefix hits: usage.prompt_tokens_details.cached_tokens, offloading on / off
    (the reference computes from its GPU prefix cache only): a hole in the CPU tier shows as fewer."""
    names = [name for name in played.cached_tokens if name in reference.cached_tokens]
    if not names:
        return ""
    return "cached prompt tokens (offloading on / off): " + ", ".join(
        f"{name} {played.cached_tokens[name]} / {reference.cached_tokens[name]}" for name in names)


@contextlib.contextmanager
def _terminate_as_interrupt() -> Any:
    """SIGTERM (a `timeout`, a CI runner) ends kvdoctor as Ctrl-C does, so the server is still stopped."""
    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    if signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None):  # the console script's (cli/teardown)
        yield
        return
    try:
        previous = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _tail(lines: list[str], count: int = 5) -> str:
    return " | ".join(line.strip() for line in lines[-count:])


def serve_setup(setup: Setup, recipe: Recipe | None = None) -> Setup:
    """The setup as the serve level runs it: kvdoctor's simulated worker inside the server's executor; for a
    silent recipe vLLM's worker on fingerprint KV (its clients' answers read the KV bytes), where it can run."""
    if recipe is not None and recipe.signature.invariant and setup.vllm_worker_unsupported() is None:
        return dataclasses.replace(setup, worker="vllm", device=None, model_runner=None, worker_fallback=None)
    return dataclasses.replace(setup, worker="simulated", device=None, model_runner=None,
                               worker_fallback=(None if setup.worker == "simulated" else
                                                "the serve level runs kvdoctor's simulated worker inside the "
                                                "server's executor"))


def groups_untested(setup: Setup, api: VllmApi | None = None) -> RunResult | None:
    """A `--model` over the recipe's own layout (`Setup.layout_replaced`) where no in-process harness is built
    (a `vllm serve` child, an exported script): vLLM's planner groups both layouts here, once, as the harness
    build does for the in-process levels; the untested result naming both groupings, or None where the model's
    groups hold every kind the trigger needs."""
    if setup.layout_replaced is None:
        return None
    from kvdoctor.engine import compat
    from kvdoctor.engine.harness import build_pieces
    from kvdoctor.engine.kv_layout import TriggerGroupsMissing

    try:
        build_pieces(api or compat.load(), setup)
    except TriggerGroupsMissing as exc:
        return RunResult("installed", Outcome.UNTESTED, detail=str(exc))
    return None


UNPATCHED = "the served engine runs the installed vLLM unpatched: kvdoctor's fixed logic is not played at serve"


class ServeLevel:
    """The served level: one `vllm serve` child per recipe (a silent recipe: two, offloading on and off),
    installed logic only (the server runs vLLM unpatched); vLLM is not imported in this process to play it."""

    name = NAME

    def check_logic(self, logic: str) -> None:
        if logic not in ("all", "installed"):
            raise UsageError(f"--logic {logic}: the served engine runs the installed vLLM unpatched (--engine serve "
                             f"runs --logic installed only)")

    def check_ready(self) -> None:
        check_plugin()  # before vLLM is imported: one line, exit 2

    def repro(self, recipe: Recipe, setup: Setup, variants: list[str], *, overrides: Overrides, command: str,
              fixed_in: FixedIn | None, record_timeline: bool, progress: Progress) -> ReproReport:
        """`kvdoctor repro RECIPE --engine serve`: one installed-logic run (the server runs vLLM unpatched)."""
        setup = serve_setup(setup, recipe)
        untested = groups_untested(setup)
        result, log_text = (untested, "") if untested is not None else run_serve(recipe, setup)
        return ReproReport(recipe=recipe, setup=setup, vllm_version=vllm_version() or "?", command=command,
                           fixed_in=fixed_in, results=[result], server_log=log_text)

    def audit_row(self, api: VllmApi, recipe: Recipe, setup: Setup, fixed_in: FixedIn | None) -> AuditRow:
        """One recipe through a `vllm serve` child; the fixed logic cannot be played there."""
        return self.audit_rows(api, [(recipe, setup, fixed_in)], lambda done, total, what: None)[0]

    def audit_rows(self, api: VllmApi, jobs: list[tuple[Recipe, Setup, FixedIn | None]],
                   progress: Progress) -> list[AuditRow]:
        """Every recipe's servers at once (`run_many`): the audit costs about one server's start-up and the
        longest traffic, not their sum; the fixed logic cannot be played there."""
        setups = [serve_setup(setup, recipe) for recipe, setup, _ in jobs]
        untested = [groups_untested(setup, api) for setup in setups]
        progress(0, len(jobs), f"{len(jobs)} recipes through `vllm serve` children started at once")
        played = iter(run_many([(recipe, setup) for (recipe, _, _), setup, why in zip(jobs, setups, untested,
                                                                                      strict=True) if why is None]))
        rows = []
        for (recipe, _, fixed_in), setup, why in zip(jobs, setups, untested, strict=True):
            installed, log_text = (why, "") if why is not None else next(played)
            fixed = RunResult("fixed", Outcome.NOT_APPLICABLE, detail=UNPATCHED)
            rows.append(AuditRow(recipe.bug or "-", recipe, setup, installed, fixed, fixed_in, server_log=log_text))
        return rows


SERVE = ServeLevel()
