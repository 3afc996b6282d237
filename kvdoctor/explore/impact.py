"""What a finding does to a server, and what its client sees.

Read from where vLLM's EngineCore meets the failure, not guessed from its name:

- an exception in an engine step (`schedule` / `update_from_output`, reached by
  the recipe's schedule, finish, drain and transfer steps) or while the engine
  core adds or aborts a request escapes `EngineCoreProc`'s busy loop: the
  engine core dies, every request in flight fails and the server stops serving;
- an exception in a utility call (`reset_prefix_cache`, `sleep`, `wake_up`) is caught by
  `EngineCore._invoke_utility_method` and returned to its caller: that call
  fails, the engine survives;
- an exception while the scheduler is built is a server that does not start;
- a violated KV-content invariant, or a bookkeeping one whose effect is wrong
  bytes in the CPU tier, is an engine serving wrong KV: no error anywhere, a
  later prefix hit (or this forward) computes with KV of other tokens;
- a chunk never stored costs later prefix hits (recomputation), no wrong output;
- connector state never released is a leak;
- an exception inside kvdoctor is kvdoctor's bug: nothing about vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ENGINE_DIES = "engine dies"
CALL_FAILS = "a call fails"
NO_START = "server does not start"
WRONG_KV = "engine serves wrong KV"
LOST_HITS = "lost prefix hits"
LEAK = "leak"
WRONG_METRICS = "wrong metrics"
HARNESS = "kvdoctor's own bug"

# Utility calls EngineCore runs for a client through _invoke_utility_method (failures returned).
UTILITY_ACTIONS = {"reset_prefix_cache": "reset_prefix_cache (LLM.reset_prefix_cache, the dev server's "
                                         "/reset_prefix_cache)",
                   # EngineCoreProc's sleep runs its pause's cache reset in an idle callback that sets the
                   # exception on the utility's future; in-process, LLM.sleep raises it (0.34.0's core.py)
                   "sleep": "sleep (LLM.sleep, the dev server's /sleep; the scheduler may be left paused)",
                   "wake_up": "wake_up (LLM.wake_up, the dev server's /wake_up)"}

# Invariant -> (impact kind, what a client sees).
_INVARIANTS: dict[str, tuple[str, str]] = {
    "store-covers-computed-slots": (WRONG_KV, "no error; a store copies KV slots never computed into the CPU "
                                              "tier, and a later request whose prefix hits that chunk computes "
                                              "with garbage KV: wrong output"),
    "store-copies-computed-kv": (WRONG_KV, "no error; the CPU tier holds bytes that are not its tokens' KV, and "
                                           "a later request whose prefix hits that chunk gets wrong output"),
    "reused-blocks-are-flushed": (WRONG_KV, "no error; the pending store may copy the new owner's KV under the "
                                            "old request's keys, and a later hit on them gives wrong output"),
    "reads-see-their-tokens": (WRONG_KV, "no error; this forward attends to KV of other tokens: wrong output "
                                         "for the running request"),
    "load-returns-stored-bytes": (WRONG_KV, "no error; a load wrote bytes other than those stored: wrong output "
                                            "for the request that hit them"),
    "canonical-page-is-tp1-page": (WRONG_KV, "no error; a chunk stored under one TP size (a shared CPU or fs "
                                             "tier, a restarted deployment) is loaded under another as other "
                                             "heads' or other tokens' KV: wrong output for the request that hits it"),
    "final-store-covers-computed-chunks": (LOST_HITS, "no error and no wrong output; a computed chunk never "
                                                      "reaches the CPU tier, so later prefix hits stop short of it "
                                                      "(more recomputation, higher latency)"),
    "readmitted-chunks-offered-again": (LOST_HITS, "no error and no wrong output; the recomputed chunks never "
                                                   "reach the CPU tier, so later prefix hits stop at the hole "
                                                   "(more recomputation, higher latency)"),
    "kv-events-match-tier": (LOST_HITS, "no error and no wrong output; a KV-events subscriber (a cache-aware "
                                        "router) believes chunks are in the CPU tier that are not, and routes "
                                        "requests to prefixes the engine recomputes"),
    "kv-events-store-remove-alternate": (LOST_HITS, "no error and no wrong output; a KV-events subscriber gets a "
                                                    "store it already had or a removal it never saw stored: its "
                                                    "index of cached prefixes drifts from the engine's"),
    "kv-events-self-describing": (LOST_HITS, "no error and no wrong output; a KV-events subscriber indexes a stored "
                                             "chunk under hashes or tokens that are not its request's"),
    "kv-events-removal-carries-store-hashes": (LOST_HITS, "no error and no wrong output; a KV-events subscriber "
                                                          "keeps block hashes of a removed chunk"),
    "no-orphan-transfer-jobs": (LEAK, "no error; a transfer job no request owns keeps its blocks or CPU slots "
                                      "until restart"),
    # the metrics invariants: what /metrics and the stats log say, not what is served
    "connector-metrics-in-range": (WRONG_METRICS, "no error and no wrong output; the server's KV offload metrics "
                                                  "(/metrics, the stats log) report impossible values, or "
                                                  "recording them raises"),
    "idle-connector-gauges-zero": (LEAK, "no error; with nothing running the CPU tier still counts chunks in "
                                         "use (pinned, never evictable again) until restart"),
}


@dataclass(frozen=True)
class Impact:
    kind: str  # one of the constants above
    client: str  # what a client of the server sees

    @property
    def line(self) -> str:
        return f"{self.kind}: {self.client}"

    def as_dict(self) -> dict[str, str]:
        return {"kind": self.kind, "client": self.client}


def impact_of(kind: str, invariant: str | None, failing_action: str | None) -> Impact:
    """The impact of a finding of `kind` ("exception", "harness", "invariant", "check"), from its
    invariant or the recipe step it failed in (`failing_action`; "" or None: while building)."""
    if kind == "harness":
        return Impact(HARNESS, "nothing: the exception was raised in kvdoctor, not in vLLM")
    if kind == "check":
        return Impact(LEAK, "no error; a finished request's connector state is never released (its CPU slots "
                            "and bookkeeping stay held until restart)")
    if kind == "invariant":
        kind_, client = _INVARIANTS.get(invariant or "", (WRONG_KV, "no error; the connector's state is wrong in "
                                                                    "a way kvdoctor checks but cannot rank"))
        return Impact(kind_, client)
    if not failing_action:
        return Impact(NO_START, "the server refuses to start with this configuration")
    if failing_action in UTILITY_ACTIONS:
        return Impact(CALL_FAILS, f"the engine survives; the {UTILITY_ACTIONS[failing_action]} call fails with "
                                  f"this exception, returned to its caller")
    return Impact(ENGINE_DIES, "the exception escapes EngineCore's busy loop: the engine core dies, every request "
                               "in flight fails (the API server returns errors and stops serving)")


def impact_of_finding(finding: Any, startup: bool = False) -> Impact:
    """`startup`: triage found the failure in the scheduler's build (before any step)."""
    steps = finding.recipe.steps
    action = steps[-1].action if steps and finding.kind in ("exception", "harness") else None
    return impact_of(finding.kind, finding.recipe.signature.invariant, "" if startup else action)
