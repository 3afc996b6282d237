"""`--engine core`: the scenario's own run (observation, invariants, verdict) on vLLM's `EngineCore`,
which calls the scheduler, instead of kvdoctor's scheduler harness; kvdoctor only hosts the executor.

Steps (and setups) the level cannot express make the recipe `not_applicable` and `unplayable`, naming
them, before vLLM builds anything (`table.unexpressible`), as at the scheduler level (`ScenarioRun`)."""

from __future__ import annotations

import dataclasses

from kvdoctor.engine.compat import VllmApi
from kvdoctor.engine.core.harness import CoreHarness
from kvdoctor.engine.kv_layout import resolve_layout
from kvdoctor.engine.setup import Setup
from kvdoctor.engine.step_loop import EOS_TOKEN
from kvdoctor.errors import KvdoctorError
from kvdoctor.levels.in_process import InProcessLevel
from kvdoctor.levels.scheduler import p2p_checked
from kvdoctor.levels.table import unexpressible
from kvdoctor.logic.patch import storable_chunks_variant
from kvdoctor.observe.snapshot import Observer
from kvdoctor.observe.verdict import ClientAnswers, Outcome, compare_completions
from kvdoctor.recipes.model import Recipe
from kvdoctor.results import RunResult
from kvdoctor.scenario import ScenarioRun
from kvdoctor.steps import StepTarget, play

NAME = "core"


class CoreScenarioRun(ScenarioRun):
    harness_class = CoreHarness

    def _run_on(self, harness: CoreHarness) -> RunResult:  # type: ignore[override]  # each level runs its own harness
        self.result.worker = (f"{self.result.worker}; hosted by kvdoctor's executor under vLLM's EngineCore "
                              f"(EngineCore.{harness.step_fn_name} calls the scheduler)")
        return super()._run_on(harness)


class ClientRun(CoreScenarioRun):
    """The recipe as its clients play it: every step but `expect` (a client cannot read the scheduler), no
    invariant (a client sees only its answers), played to the end; `completions` is what each request's
    client received (vLLM's Request.output_token_ids, a recipe's EOS left out: it is the recipe's, not the
    model's). A vLLM exception ends the run where it fired (a dead engine serves nothing more)."""

    def __init__(self, api: VllmApi, recipe: Recipe, setup: Setup, logic: str) -> None:
        super().__init__(api, recipe, setup, logic, record_timeline=False)
        self.invariants = []
        self.completions: dict[str, list[int]] = {}
        self.logprobs: dict[str, list[float]] = {}  # the stand-in's logprob of each token it chose, in order
        self.played_through = False  # every step played (no vLLM exception ended the run)
        self.unanswered: list[tuple[int, str]] = []  # (step, request) the toy model gave no answer (harness)

    def _run_on(self, harness: CoreHarness) -> RunResult:  # type: ignore[override]  # each level runs its own harness
        assert self.compiled is not None
        target = StepTarget(harness, Observer(harness, self.logic))
        with storable_chunks_variant(self.api, self.logic, self.log):
            for concrete in self.compiled.steps:
                if concrete.step.action == "expect":
                    continue
                try:
                    play(concrete, target)
                except KvdoctorError:
                    raise
                except Exception as exc:  # vLLM's: the engine is dead; the clients have what they got
                    self.result.outcome = Outcome.OTHER_FAILURE
                    self.result.detail = f"{type(exc).__name__} at step {concrete.counter}"
                    break
                finally:
                    self.log.take()
            else:
                self.played_through = True
        self.completions = {rid: [int(t) for t in request.output_token_ids if t != EOS_TOKEN]
                            for rid, request in harness.requests.items()}
        self.logprobs = {rid: [lp for token, lp in harness.answers.get(rid, [])] for rid in harness.requests}
        self.unanswered = list(harness.unanswered)
        return self.result


# The reference's completions per (recipe, its steps and setup): offloading off does not depend on the logic
# variant, so `repro --logic all` plays it once.
_REFERENCES: dict[tuple[str, str], tuple[dict[str, list[int]], dict[str, list[float]]]] = {}
REFERENCE = "offloading off"


def client_answers(api: VllmApi, recipe: Recipe, setup: Setup, logic: str) -> ClientAnswers:
    """Every request's completion with offloading on against the same steps with offloading off (the run's
    own reference: the engine computes every token's KV itself), where both runs play every step."""
    if setup.worker != "vllm":
        return ClientAnswers(REFERENCE, not_compared=f"this run's worker moves no KV bytes ({setup.worker} worker"
                                                     f"{': ' + setup.worker_fallback if setup.worker_fallback else ''}"
                                                     f"), so its clients always get the answers of right KV")
    if setup.p2p:  # a byte-moving worker on the pair (CUDA only): no engine without offloading plays `p2p_*` steps
        return ClientAnswers(REFERENCE, not_compared="the P2P pair's reference would be its two engines with "
                                                     "offloading off, which have no P2P tier to play the recipe's "
                                                     "p2p_* steps; the consumer's bytes are compared with the "
                                                     "producer's on the fabric instead (p2p-consumer-bytes-equal)")
    played = ClientRun(api, recipe, setup, logic)
    played.run()
    if not played.played_through:
        return ClientAnswers(REFERENCE, not_compared=f"offloading on, the clients' run stopped: {played.result.detail}")
    if played.unanswered:  # kvdoctor's failure: those tokens are right KV's, never read from the KV bytes
        step, request = played.unanswered[0]
        return ClientAnswers(REFERENCE, not_compared=f"kvdoctor's stand-in model gave no answer for request {request}"
                                                     f"'s token at step {step} ({len(played.unanswered)} tokens in "
                                                     f"all; kvdoctor's bug, the comparison is void)")
    key = (recipe.name, repr((recipe.steps, setup)))
    if key not in _REFERENCES:
        plain = dataclasses.replace(setup, offloading=False, multi_connector=False, worker="simulated",
                                    device=None)
        reference = ClientRun(api, recipe, plain, "installed")
        reference.run()
        if not reference.played_through:
            return ClientAnswers(REFERENCE, not_compared=f"the reference run stopped: {reference.result.detail}")
        _REFERENCES[key] = reference.completions, reference.logprobs
    completions, logprobs = _REFERENCES[key]
    return compare_completions(played.completions, completions, REFERENCE, played.logprobs, logprobs)


def answers_apply(recipe: Recipe, result: RunResult) -> bool:
    """A silent bug (its signature an invariant) played to a verdict: what its clients received is the
    question an operator asks."""
    return bool(recipe.signature.invariant) and result.outcome in (Outcome.REPRODUCED, Outcome.NOT_REPRODUCED)


def run_core_scenario(api: VllmApi, recipe: Recipe, setup: Setup, logic: str,
                      record_timeline: bool = False) -> RunResult:
    """As the scheduler level runs it (`ScenarioRun`): the steps and setup this level cannot play are its
    `unplayable` reasons, judged there beside the release's probes (a probe's reason first)."""
    setup = p2p_checked(recipe, setup)
    reasons = unexpressible(recipe.steps, NAME, setup.async_scheduling) + setup_unexpressible(setup)
    run = CoreScenarioRun(api, recipe, setup, logic, record_timeline, unplayable=tuple(reasons))
    if setup.p2p:  # two EngineCores on one in-memory fabric: the scheduler level's pair code (engine/p2p.py)
        from kvdoctor.engine.p2p import CoreP2PHarness

        run.harness_class = CoreP2PHarness
    result = run.run()
    if answers_apply(recipe, result):  # a played verdict only: an unplayable run has no answers to compare
        result.answers = client_answers(api, recipe, setup, logic)
    return result


def setup_unexpressible(setup: Setup) -> list[str]:
    """Geometry the engine cannot build as the scheduler level does."""
    layout = resolve_layout(setup.model, setup.layout, setup.sliding_window)
    if any(layer.draft for layer in layout.layers):
        return [f"{layout.source} has EAGLE drafter layers: vLLM's EngineCore flags a drafter's KV cache "
                f"group (is_eagle_group) only under a speculative config, which loads a draft model; kvdoctor's "
                f"scheduler level flags the group itself (measured: without the flag the engine takes the "
                f"non-EAGLE path and the bug's trigger is never built)"]
    return []


class CoreLevel(InProcessLevel):
    name = NAME

    def run(self, api: VllmApi, recipe: Recipe, setup: Setup, logic: str, record_timeline: bool = False) -> RunResult:
        return run_core_scenario(api, recipe, setup, logic, record_timeline=record_timeline)


CORE = CoreLevel()
