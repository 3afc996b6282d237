"""A recipe compiled, once, into the concrete steps a run plays at one geometry.

Recipes size their requests and repeats relative to the geometry (`fill_pool`,
`prompt_chunks`, `shared_prefix_chunks`, `schedule until = "filled"` /
`"prefilled"`). The scenario, the script exporter and explore's runner all need
the same concrete form: every request's token ids (of the kinds declared `admits`
in `kvdoctor.steps`), how often each `schedule` (declared `repeats`) runs and the
run-time step counter each play gets (a schedule's repeats count one each; report
timelines, failure steps and explore's cuts use it). This is the one place that
expansion is written. Pure data: no vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvdoctor.engine.setup import Setup
from kvdoctor.errors import InternalError
from kvdoctor.recipes.geometry import (
    PREEMPT_NEXT,
    PreemptPlan,
    plan_fill,
    preempt_plan,
    prompt_length,
    reloaded_prompts,
    shared_prefix_length,
)
from kvdoctor.recipes.model import Step
from kvdoctor.steps import kind_of


@dataclass(frozen=True)
class NewRequest:
    """One request an `add` step admits."""

    request: str
    prompt: tuple[int, ...]
    max_tokens: int


@dataclass(frozen=True)
class ConcreteStep:
    """One play of a recipe step: a `schedule` with n repeats is n of these, everything else one."""

    counter: int  # 1-based run-time step counter
    index: int  # the recipe step it comes from (0-based)
    step: Step  # that recipe step: its kind, fields, line and description
    requests: tuple[NewRequest, ...] = ()  # an add: the requests it admits, in order (a fill: several)
    repeat: int = 1  # which play of the recipe step this is (1-based)
    repeats: int = 1  # how often the recipe step plays

    @property
    def action(self) -> str:
        return self.step.action

    @property
    def args(self) -> dict[str, Any]:
        return self.step.args


@dataclass(frozen=True)
class CompiledRecipe:
    steps: tuple[ConcreteStep, ...]
    prompts: dict[str, tuple[int, ...]] = field(default_factory=dict)  # every request's token ids
    preempt: PreemptPlan | None = None  # the recipe's preempting fill at this geometry, if it has one


def tokens(order: int, length: int, args: dict[str, Any], prompts: dict[str, tuple[int, ...]],
           setup: Setup | None = None) -> tuple[int, ...]:
    """Token ids distinct per request (`order`: how many came before), unless a prefix is shared."""
    ids = [10 + (order * 131 + i * 7) % 1000 for i in range(length)]
    if "shared_prefix_with" in args:
        if setup is None:
            raise InternalError("a shared prefix is sized at a geometry: tokens() needs the setup")
        prefix = prompts[args["shared_prefix_with"]][: shared_prefix_length(args, setup)]
        ids[: len(prefix)] = prefix
    return tuple(ids)


def preempt_fill_requests(plan: PreemptPlan, name: str) -> list[tuple[str, int, int]]:
    """(request id, prompt length, max_tokens) of a preempting fill, in admission order: the spacers
    (`A.s1`, `A.s2`, ...: one output token each), then the fillers (`A`, `A.2`, ...)."""
    spacers = [(f"{name}.s{i + 1}", length, 1) for i, length in enumerate(plan.spacers)]
    fillers = [(name if i == 0 else f"{name}.{i + 1}", length, plan.filler_max_tokens)
               for i, length in enumerate(plan.fillers)]
    return spacers + fillers


def prefill_steps(prompt_length_: int, setup: Setup) -> int:
    """Steps a prompt's prefill takes at the step budget (chunked prefill splits it by the budget)."""
    return max(1, -(-prompt_length_ // setup.max_num_batched_tokens))


def _added(args: dict[str, Any], setup: Setup, prompts: dict[str, tuple[int, ...]],
           preempt: PreemptPlan | None, reloaded: frozenset[str]) -> tuple[tuple[NewRequest, ...], int | None]:
    """The requests an add admits, and the steps a `schedule until = "filled"` after it takes (None:
    not a fill). A fill's named request is its first filler; the others are named after it."""
    max_tokens = args.get("max_tokens", 8)
    if args.get("fill_pool") == PREEMPT_NEXT:
        if preempt is None:
            raise InternalError(f"fill_pool = {PREEMPT_NEXT!r} ({args['request']}) compiled without its preempt plan")
        planned = preempt_fill_requests(preempt, args["request"])
        fill_steps: int | None = preempt.steps
    elif args.get("fill_pool"):
        plan = plan_fill(setup, max_tokens)
        planned = [(args["request"] if i == 0 else f"{args['request']}.{i + 1}", length, max_tokens)
                   for i, length in enumerate(plan.prompts)]
        fill_steps = plan.steps
    else:
        prompt = (tuple(args["prompt"]) if "prompt" in args else
                  tokens(len(prompts), prompt_length(args, setup, preempt, reloaded), args, prompts, setup))
        prompts[args["request"]] = prompt
        return (NewRequest(args["request"], prompt, max_tokens),), None
    added = []
    for request, length, request_max_tokens in planned:
        prompts[request] = tokens(len(prompts), length, {}, prompts)
        added.append(NewRequest(request, prompts[request], request_max_tokens))
    return tuple(added), fill_steps


def _repeats(step: Step, fill_steps: int, prompts: dict[str, tuple[int, ...]], setup: Setup | None) -> int:
    if not kind_of(step.action).repeats:
        return 1
    until = step.args.get("until")
    if until is None:
        return step.args.get("count", 1)
    if setup is None:
        raise InternalError(f"schedule until = {until!r} (line {step.line}) needs a geometry to expand")
    if until == "filled":
        return fill_steps
    if until == "prefilled":
        return prefill_steps(len(prompts[step.args["request"]]), setup)
    raise InternalError(f"schedule until = {until!r} (line {step.line}) has no expansion")


def compile_recipe(steps: tuple[Step, ...] | list[Step], setup: Setup) -> CompiledRecipe:
    """The recipe's steps at `setup`. Raises geometry's `NotApplicable` where a trigger cannot exist
    here (the scenario checks the geometry first; the exporter turns it into a usage error)."""
    preempt = preempt_plan(steps, setup)
    reloaded = reloaded_prompts(steps, setup)  # a token more at a hybrid --model (geometry.reloaded_prompts)
    prompts: dict[str, tuple[int, ...]] = {}
    fill_steps = 1  # a `schedule until = "filled"` repeats as often as the fill before it needs
    plays: list[ConcreteStep] = []
    for index, step in enumerate(steps):
        requests: tuple[NewRequest, ...] = ()
        if kind_of(step.action).admits:
            requests, planned_steps = _added(step.args, setup, prompts, preempt, reloaded)
            fill_steps = planned_steps if planned_steps is not None else fill_steps
        repeats = _repeats(step, fill_steps, prompts, setup)
        for repeat in range(1, repeats + 1):
            plays.append(ConcreteStep(len(plays) + 1, index, step, requests, repeat, repeats))
    return CompiledRecipe(tuple(plays), prompts, preempt)


def expand_counts(steps: tuple[Step, ...] | list[Step]) -> list[tuple[int, str]]:
    """(recipe step index, action) per run-time step for steps whose repeats need no geometry (explore's
    generated recipes: `count` only); an `until` raises kvdoctor's internal error, never a silent 1."""
    out: list[tuple[int, str]] = []
    for index, step in enumerate(steps):
        out.extend((index, step.action) for _ in range(_repeats(step, 1, {}, None)))
    return out
