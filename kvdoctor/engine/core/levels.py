"""Which recipe step each engine level can express, and why not where it cannot (no vLLM import).

`scheduler` is kvdoctor calling `Scheduler.schedule()` / `update_from_output()` itself; `core` is
vLLM's `EngineCore` in-process; `serve` is a `vllm serve` child driven over HTTP. A recipe with a
step its level cannot express is `not_applicable` at that level, naming the step
(`unexpressible`). `docs/engine-levels.md` shows this table (`markdown_table`).
"""

from __future__ import annotations

from typing import Any

from kvdoctor.engine.setup import ENGINE_LEVELS as LEVELS
DEFAULT_LEVEL = "scheduler"

# step action -> {level: None (expressible, how) | reason it is not}; how is said in HOW.
_YES = None
STEP_LEVELS: dict[str, dict[str, str | None]] = {
    "add": {"core": _YES, "serve": _YES},
    "schedule": {"core": _YES, "serve": _YES},
    "abort": {"core": _YES, "serve": _YES},
    "expect": {"core": _YES,
               "serve": "the server's scheduler state cannot be read from outside the process"},
    "finish": {"core": _YES,
               "serve": "the served executor samples no EOS on request (only max_tokens ends a request)"},
    "hold_transfers": {"core": _YES, "serve": "the served executor completes every transfer when issued"},
    "complete_transfers": {"core": _YES, "serve": "the served executor completes every transfer when issued"},
    "fail_transfers": {"core": _YES, "serve": "the served executor completes every transfer when issued"},
    "drain": {"core": "under async scheduling the engine keeps a batch in flight (step_with_batch_queue); "
                      "only its own steps apply it, a client cannot ask for that between steps",
              "serve": "a client cannot apply the in-flight batch between engine steps"},
    "reset_prefix_cache": {"core": _YES,
                           "serve": "not played by kvdoctor's serve client yet (POST /reset_prefix_cache "
                                    "races with the busy loop)"},
    "delay_block_hashes": {"core": "block hashes are computed by the engine's own request_block_hasher; "
                                   "withholding them is a scheduler-side intervention",
                           "serve": "a scheduler-side intervention"},
    "release_block_hashes": {"core": "a scheduler-side intervention (see delay_block_hashes)",
                             "serve": "a scheduler-side intervention"},
}

HOW: dict[str, str] = {
    "add": "EngineCore.preprocess_add_request + add_request (serve: POST /v1/completions, token-id prompt)",
    "schedule": "the engine's step_fn (step / step_with_batch_queue) + post_step",
    "abort": "EngineCore.abort_requests (serve: the client disconnects)",
    "expect": "the engine's Scheduler, read between steps",
    "finish": "kvdoctor's executor samples EOS for the request",
    "hold_transfers": "kvdoctor's executor holds the worker's jobs",
    "complete_transfers": "kvdoctor's executor releases them",
    "fail_transfers": "kvdoctor's executor reports them failed",
    "drain": "sync scheduling: a no-op (nothing in flight between engine steps)",
    "reset_prefix_cache": "EngineCore.reset_prefix_cache",
}


def why_not(action: str, level: str, args: dict[str, Any] | None = None, async_scheduling: bool = False) -> str | None:
    """None when `level` can play this step; otherwise the reason."""
    if level == DEFAULT_LEVEL:
        return None
    row = STEP_LEVELS.get(action)
    if row is None:
        return f"kvdoctor does not know how to play step kind {action!r} at the {level} level"
    if action == "drain" and level == "core" and not async_scheduling:
        return None
    return row.get(level, f"no {level} form")


def unexpressible(steps: list[Any], level: str, async_scheduling: bool) -> list[str]:
    """One line per step kind this level cannot play: 'step N (line L) `kind`: why'."""
    reasons: list[str] = []
    seen: set[str] = set()
    for index, step in enumerate(steps, 1):
        why = why_not(step.action, level, step.args, async_scheduling)
        if why and step.action not in seen:
            seen.add(step.action)
            reasons.append(f"step {index} (line {step.line}) `{step.action}` cannot be played through "
                           f"vLLM's {'EngineCore' if level == 'core' else 'vllm serve'}: {why}")
    return reasons


def markdown_table() -> str:
    """Step kind x level, from `STEP_LEVELS` (docs/engine-levels.md embeds it)."""
    lines = ["| step | scheduler | core | serve |", "|---|---|---|---|"]
    for action, row in STEP_LEVELS.items():
        cells = []
        for level in ("core", "serve"):
            why = row.get(level)
            if action == "drain" and level == "core":
                cells.append("sync scheduling only: " + why)
            else:
                cells.append("yes" if why is None else "no: " + why)
        lines.append(f"| `{action}` | yes | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)
