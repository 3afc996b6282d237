"""Which needs each engine level can meet, and why not where it cannot (no vLLM import).

The step kinds and what each needs are `kvdoctor.steps`' registry, the one source: this module
adds only the levels. `scheduler` is kvdoctor calling `Scheduler.schedule()` /
`update_from_output()` itself; `core` is vLLM's `EngineCore` in-process; `serve` is a
`vllm serve` child driven over HTTP. Each level answers every `Need`: met, or the reason it is
not. A recipe with a step whose needs its level cannot meet is `not_applicable` there, naming
the step (`unexpressible`). `docs/engine-levels.md` shows the tables (`markdown_table`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvdoctor.engine.setup import ENGINE_LEVELS as LEVELS
from kvdoctor.errors import InternalError
from kvdoctor.recipes.model import Step
from kvdoctor.steps import REGISTRY, Need

DEFAULT_LEVEL = "scheduler"


@dataclass(frozen=True)
class Level:
    """One engine level: the needs it meets, and for each it does not, why."""

    name: str
    title: str  # who calls the scheduler, as messages name it
    meets: frozenset[Need]
    cannot: dict[Need, str] = field(default_factory=dict)
    # needs met under sync scheduling only: why not under async scheduling
    sync_only: dict[Need, str] = field(default_factory=dict)

    def why_not(self, need: Need, async_scheduling: bool = False) -> str | None:
        """None when this level meets `need` (under this scheduling mode); otherwise the reason."""
        if need in self.cannot:
            return self.cannot[need]
        if need not in self.meets:
            raise InternalError(f"engine level {self.name!r} gives no answer for need {need.value!r} "
                                f"(kvdoctor/levels/table.py)")
        return self.sync_only.get(need) if async_scheduling else None


_SCHEDULER_SIDE = ("an intervention inside the scheduler: vLLM's engine computes block hashes with its own "
                   "request_block_hasher and offers no way to withhold them")
_NO_TRANSFER_CONTROL = ("a crash recipe's served executor (kvdoctor's simulated worker) completes every transfer "
                        "when issued (a silent recipe's runs vLLM's worker on kvdoctor's copy engine and plays its "
                        "transfer steps on the recipe's schedule)")

LEVEL_TABLE: dict[str, Level] = {level.name: level for level in (
    Level("scheduler", "kvdoctor's scheduler harness", meets=frozenset(Need) - {Need.ENGINE_PAUSE},
          cannot={Need.ENGINE_PAUSE: "pausing and sleep mode are the engine's (EngineCore.pause_scheduler / "
                                     "sleep gate its own step loop and clear its caches); play it with --engine core"}),
    Level("core", "vLLM's EngineCore",
          meets=frozenset(Need) - {Need.SCHEDULER_CONTROL},
          cannot={Need.SCHEDULER_CONTROL: _SCHEDULER_SIDE},
          sync_only={Need.IN_FLIGHT_OUTPUT: "under async scheduling the engine keeps a batch in flight "
                                            "(step_with_batch_queue); only its own steps apply it, a client "
                                            "cannot ask for that between steps"}),
    Level("serve", "vllm serve",
          meets=frozenset({Need.ENGINE_INPUT, Need.ENGINE_STEP, Need.MODEL_OUTPUT, Need.IN_FLIGHT_OUTPUT,
                           Need.ENGINE_UTILITY}),
          sync_only={Need.IN_FLIGHT_OUTPUT: "a client cannot apply the in-flight batch between engine steps"},
          cannot={
              Need.TRANSFER_CONTROL: _NO_TRANSFER_CONTROL,
              Need.P2P_PAIR: "a served engine's P2P tier needs NIXL and a second server; kvdoctor's in-memory "
                             "fabric lives in one process",
              Need.PD_DECODE: "kvdoctor's NIXL stand-in is told a recipe's load failures in-process; a served "
                              "engine's connector is out of reach",
              Need.SCHEDULER_CONTROL: _SCHEDULER_SIDE,
              Need.ENGINE_PAUSE: "not played by kvdoctor's serve client (vllm serve pauses only in its "
                                 "development mode)",
              Need.SCHEDULER_STATE: "the server's scheduler state cannot be read from outside the process (the "
                                    "serve client reads only whether an aborted request was still queued, from "
                                    "the executor's step log)",
          }),
)}

# How each level meets a need (the docs' table; the code is the harness of each level).
HOW: dict[Need, str] = {
    Need.ENGINE_INPUT: "core: EngineCore.preprocess_add_request + add_request, abort_requests; serve: POST "
                       "/v1/completions with a token-id prompt, a client disconnect",
    Need.ENGINE_STEP: "core: the engine's step_fn (step / step_with_batch_queue) + post_step; serve: a paced "
                      "engine step of waiting",
    Need.IN_FLIGHT_OUTPUT: "core and serve, sync scheduling: nothing is in flight between engine steps (a no-op)",
    Need.MODEL_OUTPUT: "core: kvdoctor's executor samples EOS for the request; serve: the client sends the EOS "
                       "schedule with the request (vllm_xargs) before the request's first engine step; a "
                       "later one: a silent recipe's executor samples EOS at the recipe's engine step (its plan), "
                       "a crash recipe's is not_applicable, named",
    Need.TRANSFER_CONTROL: "core: kvdoctor's executor holds, releases or fails the worker's jobs; serve, a silent "
                           "recipe: the same, on the recipe's engine steps (the executor's plan, "
                           "KVDOCTOR_ENGINE_PLAN)",
    Need.ENGINE_UTILITY: "core: EngineCore.reset_prefix_cache; serve: POST /reset_prefix_cache "
                         "(reset_running_requests, reset_external = the step's reset_connector; vLLM's development "
                         "endpoint, VLLM_SERVER_DEV_MODE=1 in the server child), between paced engine steps",
    Need.SCHEDULER_STATE: "core: the engine's Scheduler, read between steps",
    Need.ENGINE_PAUSE: "core: EngineCore.pause_scheduler (mode, clear_cache) / resume_scheduler; EngineCore.sleep "
                       "(level, mode, reset_connector where the release takes it) / wake_up (tags), kvdoctor's "
                       "executor standing in for the workers' sleep",
    Need.PD_DECODE: "scheduler and core: vLLM's MultiConnector loads kvdoctor's NIXL stand-in by module path; "
                    "kvdoctor's worker side ends its loads (engine/pd_decode.py)",
    Need.P2P_PAIR: "scheduler: a producer harness beside the recipe's (the consumer); core: a producer EngineCore "
                   "beside the recipe's; both on vLLM's P2P tier over kvdoctor's in-memory transports, one pair code "
                   "(engine/p2p.py)",
}


def level(name: str) -> Level:
    try:
        return LEVEL_TABLE[name]
    except KeyError:
        raise InternalError(f"unknown engine level {name!r}") from None


def why_not(action: str, level_name: str, async_scheduling: bool = False) -> str | None:
    """None when `level_name` can play this step kind; otherwise why not (its first unmet need)."""
    kind = REGISTRY.get(action)
    if kind is None:
        raise InternalError(f"step kind {action!r} has no handler in kvdoctor.steps")
    for need in kind.needs:
        why = level(level_name).why_not(need, async_scheduling)
        if why is not None:
            return why
    return None


def unexpressible(steps: Sequence[Step], level_name: str, async_scheduling: bool,
                  played_otherwise: frozenset[str] = frozenset()) -> list[str]:
    """One line per step kind this level cannot play: 'step N (line L) `kind`: why'. `played_otherwise`: kinds
    the level plays its own way whatever their needs (the serve client's own precondition check for `expect`)."""
    reasons: list[str] = []
    seen: set[str] = set()
    title = level(level_name).title
    for index, step in enumerate(steps, 1):
        if step.action in played_otherwise:
            continue
        why = why_not(step.action, level_name, async_scheduling)
        if why and step.action not in seen:
            seen.add(step.action)
            reasons.append(f"step {index} (line {step.line}) `{step.action}` cannot be played through "
                           f"{title}: {why}")
    return reasons


def _cell(lvl: Level, needs: tuple[Need, ...]) -> str:
    whys = [lvl.why_not(need) for need in needs]
    if any(whys):
        return "no: " + "; ".join(w for w in whys if w)
    sync = [lvl.sync_only[need] for need in needs if need in lvl.sync_only]
    return "sync scheduling only: " + "; ".join(sync) if sync else "yes"


def markdown_table() -> str:
    """Need x level, then step kind x level (from the step registry); docs/engine-levels.md embeds it."""
    names = list(LEVELS)
    head = " | ".join(names)
    lines = [f"| need | {head} | how |", "|---|" + "---|" * len(names) + "---|"]
    for need in Need:
        cells = " | ".join(_cell(LEVEL_TABLE[n], (need,)) for n in names)
        lines.append(f"| `{need.value}` | {cells} | {HOW.get(need, '')} |")
    lines += ["", f"| step | needs | {head} |", "|---|---|" + "---|" * len(names)]
    for kind in REGISTRY.values():  # declaration order: the loader's vocabulary order
        needs = ", ".join(f"`{need.value}`" for need in kind.needs)
        cells = " | ".join(_cell(LEVEL_TABLE[n], kind.needs).split(":")[0] for n in names)
        lines.append(f"| `{kind.name}` | {needs} | {cells} |")
    return "\n".join(lines)
