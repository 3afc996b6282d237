"""Triage of a finding before it is reported: is it the offloading connector's, and does a real engine get there?

Three questions, each answered by running or by reading vLLM, never assumed:

(a) *Without the connector.* The shrunk recipe runs again with `offloading =
    false` (no KV connector: a server without --kv-transfer-config). A failure
    that fires there too is vLLM's core scheduler's, not the offloading
    connector's.
(b) *Could the harness have caused it?* kvdoctor drives the scheduler the way
    vLLM's EngineCore does, with a few liberties; each step kind is checked
    against what the installed EngineCore can produce (feature probes in
    `compat.engine_core_facts`):
    - `reset_prefix_cache` is EngineCore's utility call of that name (reached
      through `LLM.reset_prefix_cache`, `AsyncLLM` and the dev server's
      `/reset_prefix_cache`); an argument it does not take is unreachable. Under
      async scheduling with an output still in flight it is reachable where the
      engine core keeps a batch queue (`step_with_batch_queue` returns with the
      batch queued) and its busy loop handles client calls between steps.
    - a failed transfer is reachable only where vLLM's offloading worker can
      report one (before 0.34 it asserts every transfer succeeds);
    - a geometry whose pool vLLM's start-up check refuses for `max_model_len`
      is one no server runs;
    - an exception raised in kvdoctor itself is the harness's by definition;
    - a failure while building the scheduler is a configuration a server refuses
      to start with, not a sequence of steps;
    - `delay_block_hashes` (a request's block hashes, so its offload keys, arrive
      after its blocks) is what a P/D decode instance, a hybrid model or
      lookahead block hashes (EAGLE/MTP) do; kvdoctor withholds them from vLLM's
      own hasher, so the finding is reachable but carries a caveat saying how the
      lag was made, for the reader to weigh against their deployment.
    Adds, schedules, aborts, EOS, held or completed transfers and drains are
    what an engine does between and during its steps.

(c) *Through vLLM's EngineCore.* The shrunk recipe is replayed with `--engine
    core` (the core level of `kvdoctor.levels.runners`: vLLM's own
    EngineCore calls the scheduler, kvdoctor only hosts the executor). It is
    "reproduced through vLLM's EngineCore", "not reproduced through EngineCore
    (scheduler-level only)", or, for a recipe with a step the engine core
    cannot play (a scheduler-side intervention such as withheld block hashes,
    a drain under async scheduling), "not playable at core" naming the step.
    A finding the engine core plays and does not reproduce is not a candidate:
    the scheduler-level run did something the engine does not (a finding about
    kvdoctor's harness until shown otherwise).

A finding with sleep / wake_up steps (`explore --force sleep-wake`) was found at --engine core: each of the
three runs plays it there (`runner.play`), so (a) is EngineCore without a connector and (c) the found run again.

A finding that survives all three (not also without the connector, nothing the
harness did that an engine cannot, not refuted by EngineCore) and is not a
known bug is a *candidate upstream report*: the caller's `write_attachment`
(the CLI's: the `kvdoctor repro FILE --report` Markdown, with this triage)
writes its attachment next to its recipe. Formatting stays on the CLI side:
nothing in this package imports the report formatters.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvdoctor.engine import compat
from kvdoctor.errors import KvdoctorError, UsageError
from kvdoctor.explore.runner import play, setup_of
from kvdoctor.levels.core import CORE as CORE_LEVEL
from kvdoctor.levels.table import why_not
from kvdoctor.observe.verdict import Outcome

CANDIDATE = "candidate upstream report"
KNOWN = "known bug"
CORE = "not the connector's"
HARNESS = "harness artifact"
STARTUP = "start-up refusal: a server with this configuration does not start"
_STARTUP_REASON = "vLLM raised while building the scheduler"
SCHEDULER_ONLY = ("scheduler-level only: vLLM's EngineCore plays these steps and does not fail this way "
                  "(a finding about kvdoctor's harness until shown otherwise)")

# What the EngineCore replay said (`through_engine_core`'s word) -> the label triage shows.
REPRODUCED_AT_CORE = "reproduced"
NOT_REPRODUCED_AT_CORE = "not reproduced"
NOT_PLAYABLE_AT_CORE = "not playable"
NOT_RUN_AT_CORE = "not run"
OTHERWISE_AT_CORE = "fails otherwise"


@dataclass
class Triage:
    without_connector: str  # "reproduces" | "does not reproduce" | "fails otherwise" | "not run"
    without_connector_detail: str = ""
    harness_caused: bool = False
    harness_reasons: list[str] = field(default_factory=list)  # why the harness may have caused it
    reachable_notes: list[str] = field(default_factory=list)  # why each liberty it took is reachable
    caveats: list[str] = field(default_factory=list)  # kvdoctor approximations the run relied on
    verdict: str = ""
    report: str | None = None  # the Markdown attachment, for a candidate
    impact: str = ""  # what it does to a server and its clients (`kvdoctor.explore.impact`)
    diagnosis: list[str] = field(default_factory=list)  # what the run shows of the cause, beyond the message
    # The replay through vLLM's EngineCore (`through_engine_core`): its word and what it showed.
    engine_core: str = NOT_RUN_AT_CORE
    engine_core_detail: str = ""

    @property
    def engine_core_label(self) -> str:
        if self.engine_core == REPRODUCED_AT_CORE:
            return "reproduced through vLLM's EngineCore"
        if self.engine_core == NOT_REPRODUCED_AT_CORE:
            return "not reproduced through EngineCore (scheduler-level only)"
        if self.engine_core == NOT_PLAYABLE_AT_CORE:
            return f"not playable at core: {self.engine_core_detail}"
        if self.engine_core == OTHERWISE_AT_CORE:
            return f"through EngineCore it fails otherwise ({self.engine_core_detail})"
        return f"not replayed through EngineCore ({self.engine_core_detail or 'not run'})"

    @property
    def line(self) -> str:
        connector = {"reproduces": "also without the connector",
                     "does not reproduce": "not without the connector",
                     "fails otherwise": "without the connector it fails otherwise",
                     "not run": "not rerun without the connector"}[self.without_connector]
        parts = [connector, self.engine_core_label]
        if self.harness_caused:
            parts.append("the harness may have caused it: " + "; ".join(self.harness_reasons))
        return f"{self.verdict} ({'; '.join(parts)})"

    def as_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "without_connector": self.without_connector,
                "without_connector_detail": self.without_connector_detail,
                "harness_caused": self.harness_caused, "harness_reasons": list(self.harness_reasons),
                "reachable": list(self.reachable_notes), "caveats": list(self.caveats), "report": self.report,
                "impact": self.impact, "diagnosis": list(self.diagnosis),
                "engine_core": self.engine_core, "engine_core_label": self.engine_core_label,
                "engine_core_detail": self.engine_core_detail}


def _setup(recipe: Any, **changes: Any) -> Any:
    setup = setup_of(recipe)
    return dataclasses.replace(setup, **changes).validate() if changes else setup


def without_connector(api: Any, finding: Any) -> tuple[str, str]:
    """Rerun the shrunk recipe with no KV connector: (outcome word, detail)."""
    if finding.kind == "harness":
        return "not run", "the exception was kvdoctor's own"
    try:
        # No connector, nothing for vLLM's worker connector to drive: the scheduler runs with the
        # simulated worker (the question is the scheduler's, with no KV transfer at all).
        setup = _setup(finding.recipe, offloading=False, worker="simulated")
        result = play(api, finding.recipe, setup, finding.logic)
    except UsageError as exc:
        return "not run", f"vLLM refused the setup without a connector: {exc}"
    if result.outcome is Outcome.REPRODUCED:
        return "reproduces", result.detail or f"{finding.signature} fires with no KV connector configured"
    if result.outcome is Outcome.NOT_REPRODUCED:
        return "does not reproduce", "the same steps run through with no KV connector configured"
    if result.outcome is Outcome.NOT_REACHED:  # a connector's crash site: gone with the connector
        return "does not reproduce", ("the same steps run through with no KV connector configured (its crash "
                                      "site, in the connector, is never reached)")
    return "fails otherwise", f"{result.outcome.value}: {result.detail}"


def through_engine_core(api: Any, finding: Any) -> tuple[str, str]:
    """Replay the shrunk recipe with `--engine core` (vLLM's EngineCore calls the scheduler): (word, detail).

    Reproduced means the outcome the scheduler level gives the recipe (its signature fires:
    `reproduced`; a leak finding's [[check]] fails: `other_failure`, the same check) comes out of the
    engine core too. A step the engine core cannot play makes the recipe `not_applicable` there,
    before vLLM builds anything; the steps it names are the detail."""
    if finding.kind == "harness":
        return NOT_RUN_AT_CORE, "the exception was kvdoctor's own"
    try:
        setup = _setup(finding.recipe, engine="core")
        result = CORE_LEVEL.run(api, finding.recipe, setup, finding.logic)
    except KvdoctorError as exc:  # a setup the engine level refuses (kvdoctor's own refusal, one line)
        return NOT_PLAYABLE_AT_CORE, str(exc)
    if result.outcome is Outcome.NOT_APPLICABLE:
        steps = list(dict.fromkeys(step.action for step in finding.recipe.steps
                                   if why_not(step.action, "core", setup.async_scheduling)))
        return NOT_PLAYABLE_AT_CORE, (", ".join(f"`{step}`" for step in steps) if steps else result.detail)
    wanted = Outcome.OTHER_FAILURE if finding.kind == "check" else Outcome.REPRODUCED
    if result.outcome is wanted and (wanted is Outcome.REPRODUCED or "check" in (result.detail or "")):
        return REPRODUCED_AT_CORE, result.detail or ""
    if result.outcome in (Outcome.NOT_REPRODUCED, Outcome.NOT_REACHED):
        return NOT_REPRODUCED_AT_CORE, f"{result.outcome.value}: {result.detail}"
    return OTHERWISE_AT_CORE, f"{result.outcome.value}: {result.detail}"


def _in_flight_resets(steps: tuple[Any, ...], async_scheduling: bool) -> tuple[list[Any], list[Any]]:
    """(reset steps, those taken with an async output in flight: a schedule since the last drain)."""
    resets, in_flight = [], []
    pending = False
    for step in steps:
        if step.action == "schedule":
            pending = async_scheduling
        elif step.action == "drain":
            pending = False
        elif step.action == "reset_prefix_cache":
            resets.append(step)
            if pending:
                in_flight.append(step)
    return resets, in_flight


def harness_check(api: Any, finding: Any, facts: Any) -> tuple[list[str], list[str], list[str]]:
    """(reasons the harness may have caused it, why each liberty taken is reachable, caveats)."""
    reasons: list[str] = []
    reachable: list[str] = []
    caveats: list[str] = []
    recipe = finding.recipe
    if finding.kind == "harness":
        reasons.append("the exception was raised in kvdoctor, not in vLLM")
        return reasons, reachable, caveats
    setup = _setup(recipe)
    result = play(api, recipe, setup, finding.logic, record_timeline=True)
    if result.failure is not None and result.failure_step == 0:
        reasons.append(f"{_STARTUP_REASON} and its connector: a server with this "
                       "configuration does not start (a start-up refusal, not a step sequence)")
    notes = list(result.kv_plan.notes) if result.kv_plan is not None else []
    for note in notes:
        if "would refuse to start" in note:
            reasons.append(f"vLLM's start-up check refuses this pool: {note}")
        else:
            caveats.append(note)
    resets, in_flight = _in_flight_resets(recipe.steps, setup.async_scheduling)
    for step in resets:
        wanted = {name for name in ("reset_running_requests", "reset_connector") if step.args.get(name)}
        absent = sorted(wanted - facts.reset_params)
        if absent:
            reasons.append(f"this vLLM's EngineCore.reset_prefix_cache takes no {', '.join(absent)}")
    if resets and not any(r.startswith("this vLLM's EngineCore") for r in reasons):
        reachable.append("reset_prefix_cache is EngineCore's utility call of that name "
                         "(LLM.reset_prefix_cache, AsyncLLM, the dev server's /reset_prefix_cache)")
    if in_flight:
        if facts.batch_queue and facts.utilities_between_steps:
            reachable.append("the reset came with an async output in flight: EngineCore.step_with_batch_queue "
                             "returns with that batch queued and EngineCoreProc's busy loop handles client "
                             "calls before the next step")
        else:
            reasons.append("the reset came with an async output in flight, and this vLLM's engine core "
                           "handles no client call while a batch is queued")
    failed = [entry for entry in result.timeline if entry.events is not None and entry.events.failed_jobs]
    if failed:
        if api.worker_reports_failed_jobs:
            reachable.append("failed transfers: this vLLM's offloading worker reports failed jobs "
                             "(mark_completed(success=False))")
        else:
            reasons.append("a transfer failed, but this vLLM's offloading worker has no failure path "
                           "(it asserts every transfer succeeds)")
    if any(step.action == "delay_block_hashes" for step in recipe.steps):
        reachable.append("late block hashes: a request's offload keys lag its blocks as in P/D decode "
                         "instances, hybrid models and lookahead block hashes (EAGLE/MTP)")
        caveats.append("kvdoctor made the hashes late by withholding them from vLLM's request block "
                       "hasher (computed in full on release); GPU prefix caching is off in such a recipe")
    if any(step.action == "drain" for step in recipe.steps) and setup.async_scheduling:
        reachable.append("drain: an engine core with nothing to schedule applies the batch in flight "
                         "without scheduling (step_with_batch_queue), as pause_generation waits for")
    return reasons, reachable, caveats


# Writes a candidate's attachment beside its recipe and returns its path (None: not written). The
# CLI supplies it (`kvdoctor.cli.explore_cmd.write_attachment`): formatting is the CLI's.
WriteAttachment = Callable[[Any, "Triage"], "str | None"]


def triage(api: Any, finding: Any, facts: Any | None = None,
           write_attachment: WriteAttachment | None = None) -> Triage:
    """The three checks, the verdict, and (for a candidate, through `write_attachment`) the report
    attachment next to the recipe."""
    facts = facts or compat.load().engine_core_facts()
    word, detail = without_connector(api, finding)
    reasons, reachable, caveats = harness_check(api, finding, facts)
    core, core_detail = through_engine_core(api, finding)
    result = Triage(without_connector=word, without_connector_detail=detail, harness_caused=bool(reasons),
                    harness_reasons=reasons, reachable_notes=reachable, caveats=caveats, engine_core=core,
                    engine_core_detail=core_detail)
    result.verdict = verdict(word, reasons, finding.known, core)
    finding.triage = result  # the impact reads the verdict (a start-up refusal is a server that never starts)
    result.impact = finding.impact.line
    result.diagnosis = diagnose_reset_failure(api, finding)
    if result.verdict == CANDIDATE and finding.file and write_attachment is not None:
        result.report = write_attachment(finding, result)
    return result


def verdict(without: str, harness_reasons: list[str], known: tuple[str, tuple[str, ...]] | None,
            engine_core: str = NOT_RUN_AT_CORE) -> str:
    """What the checks make of a finding (harness first: a step no engine takes decides nothing; a
    known bug stays labelled whatever the engine core says; an unknown one that the engine core plays
    without failing is the scheduler level's alone)."""
    if any(reason.startswith(_STARTUP_REASON) for reason in harness_reasons):
        return STARTUP
    if harness_reasons:
        return HARNESS
    if without == "reproduces":
        return f"{CORE}: vLLM's scheduler fails this way with no KV connector"
    if known:
        return f"{KNOWN} {known[0]} ({', '.join(known[1])})"
    if engine_core == NOT_REPRODUCED_AT_CORE:
        return SCHEDULER_ONLY
    return CANDIDATE


_RESET_MESSAGE = "waiting for remote KV transfer"


def diagnose_reset_failure(api: Any, finding: Any) -> list[str]:
    """`reset_prefix_cache(reset_running_requests=True)` raising RuntimeError whose message blames
    requests "waiting for remote KV transfer": rerun the recipe up to the step before the reset and
    say what the scheduler held there. vLLM preempts every running request first, then finds blocks
    still referenced and raises before `reset_connector`; under async scheduling the batch in flight
    still holds its blocks (its frees are deferred until its output is applied)."""
    sig = finding.recipe.signature
    steps = finding.recipe.steps
    if (finding.kind != "exception" or sig.exception != "RuntimeError" or sig.function != "reset_prefix_cache"
            or not steps or steps[-1].action != "reset_prefix_cache"
            or not steps[-1].args.get("reset_running_requests")):
        return []
    setup = _setup(finding.recipe)
    nothing = dataclasses.replace(sig, exception="(none)", function="(none)", contains=None)
    before = dataclasses.replace(finding.recipe, steps=steps[:-1], checks=(), signature=nothing)
    result = play(api, before, setup, finding.logic)
    waiting_remote = [s.request for s in result.requests if s.status == "WAITING_FOR_REMOTE_KVS"]
    running = [s.request for s in result.requests if s.status == "RUNNING"]
    _, in_flight = _in_flight_resets(steps, setup.async_scheduling)
    notes = ["the engine survives: EngineCore returns the utility call's exception to its caller "
             "(LLM.reset_prefix_cache raises, /reset_prefix_cache answers with an error); by then vLLM has "
             f"already preempted every running request ({', '.join(running) or 'none'} here: they are recomputed "
             "from the waiting queue) and the prefix cache is not reset; reset_connector, if asked, is skipped"]
    if _RESET_MESSAGE in (sig.contains or "") and not waiting_remote:
        cause = ("the reset came right after an async step, with that batch's output not yet applied: its "
                 "blocks are still referenced (their frees wait for the output), so the block pool cannot be "
                 "reset" if in_flight else "some blocks were still referenced when the pool was reset")
        notes.append(f"the message blames requests {_RESET_MESSAGE!r}, but no request was waiting for a KV "
                     f"transfer before the reset (none in WAITING_FOR_REMOTE_KVS): {cause}")
    return notes
