"""The scripted tier in explore's tier byte (issue 36): which secondary tiers, the scripted tier's job script
and its backpressure pattern, drawn from the byte's upper bits (3-7) where `SCRIPTED_TIER_DRAW` is a feature
(probed: vLLM loads kvdoctor's scripted tier through `module_path`, with deferred releases and
`backpressure_cls`). Elsewhere those bits are ignored, so a release's examples stay as they were; a zero
upper part (what hypothesis shrinks towards) is the fs tier alone, as before."""

from __future__ import annotations

import random
from typing import Any

SCRIPTED_TIER_DRAW = "scripted_tier"
# bits 3-4: the tiers (fs alone as before, the scripted tier alone, or both, fs first)
TIER_KINDS = ("fs", "scripted", "fs+scripted", "scripted")
# bits 5-6: the scripted tier's job outcomes, "<stores>/<promotions>" cycled (engine/tier_script.py)
TIER_SCRIPTS = (None, "late,ok/defer,ok", "ok,fail/partial,late", "fail,late/late,defer,fail")
# bit 7: a backpressure pattern (vLLM's backpressure_cls: kvdoctor's scripted detector), dropping one
# cascade in three
BACKPRESSURE_PATTERNS = (None, "1,0,1")
# where VLLM_BACKPRESSURE_DRAW is a feature too (probed: VllmApi.has_vllm_backpressure with a failure threshold),
# bit 7 under the store scripts whose stores are late or fail (bits 5-6 = 1, 3) names vLLM's own EMA detector on the
# step clock instead (engine/compat/vllm_backpressure.py): late completions raise its EMA, failed ones trip it, idle
# steps decay it. Elsewhere (and where the feature is absent) the pattern is as before.
VLLM_BACKPRESSURE_DRAW = "vllm_backpressure"
VLLM_BACKPRESSURE = {1: "vllm", 3: "vllm:policy=drop,failures=2"}


def scripted_tier_fields(byte: int, features: frozenset[str]) -> tuple[str, str | None, str | None]:
    """(secondary_tier, tier_script, backpressure_pattern) the tier byte's upper bits give (the fs tier
    alone, no script, where the feature is absent)."""
    kind = TIER_KINDS[byte >> 3 & 3] if SCRIPTED_TIER_DRAW in features else "fs"
    if "scripted" not in kind:
        return kind, None, None
    script_bits = byte >> 5 & 3
    pattern = BACKPRESSURE_PATTERNS[byte >> 7 & 1]
    if pattern is not None and VLLM_BACKPRESSURE_DRAW in features and script_bits in VLLM_BACKPRESSURE:
        pattern = VLLM_BACKPRESSURE[script_bits]
    return kind, TIER_SCRIPTS[script_bits], pattern


# -- the P2P pair (engine/p2p.py), where P2P_TIER_DRAW is a feature (probed: compat.p2p_transport.p2p_probe) ------
# explore draws it in a branch of its own (explore/search.py `P2PBranch`): after every P2P_EVERY generated examples,
# the next of the 128 plan bytes in an order the worker's seed draws, played as a `[setup] p2p = true` recipe
# (`p2p_steps`). It draws nothing from hypothesis, so the search's examples stay as they were (and where the
# feature is absent the branch does not run at all).
P2P_TIER_DRAW = "p2p_tier"
P2P_KILL_AT = (None, 1, 5, 8)  # the producer dies before the handshake, mid-round, after it (or never)
P2P_EVERY = 8
P2P_SETUP = {"block_size": 4, "gpu_blocks": 32, "max_model_len": 128, "worker": "simulated", "p2p": True}
P2P_TAIL = 12  # engine steps after the plan's last event, before vLLM's P2P clock moves past its timeouts


# bit 7: the lossy plans: a control message type the fabric drops (bits 0-1 pick which, no delay then) and the death
# of bits 3-4 is the consumer's instead of the producer's
P2P_DROPS = (("transfer_done",), ("fetch",), ("lookup_resp",), ("abort_fetch", "connect_ack"))
P2P_PLANS = 256


def p2p_plan_fields(byte: int) -> dict[str, Any]:
    """A P2P plan's fault fields from one byte: bits 0-1 the fabric's delay in polls, bit 2 failed transfers,
    bits 3-4 when a side dies, bit 5 the consumer's abort at step 4, bit 6 symmetric P2P; bit 7 a lossy plan
    (bits 0-1 a dropped message type instead of a delay, and the death is the consumer's). Zero (what hypothesis
    shrinks towards) is the plain PD exchange. explore plays them in `p2p_plan_bytes`' order."""
    lossy = bool(byte >> 7 & 1)
    death = P2P_KILL_AT[byte >> 3 & 3]
    return {"delay_polls": 0 if lossy else byte & 3, "drop": P2P_DROPS[byte & 3] if lossy else (),
            "fail_transfers": bool(byte >> 2 & 1),
            "kill_producer_at": None if lossy else death, "kill_consumer_at": death if lossy else None,
            "abort_consumer_at": 4 if byte >> 5 & 1 else None, "symmetric": bool(byte >> 6 & 1)}


# -- vLLM's object-store tier (compat/objstore_tier.py), where OBJSTORE_DRAW is a feature (probed:
# compat.objstore_agent.objstore_probe) -----------------------------------------------------------------------
OBJSTORE_DRAW = "objstore_tier"
# bits 6-7: the fake NIXL agent's fault script, "<stores>/<loads>" cycled (compat/objstore_agent.OUTCOMES)
OBJSTORE_SCRIPTS = ("", "late,fail,ok,notel/ok,late", "err,ok,noreg,norel/fail,ok", "ok,noprep,leak,noxfer/raise,ok")


def objstore_fields(byte: int, features: frozenset[str]) -> str | None:
    """The object-store tier's fault script (`Setup.object_store`), or None for no object-store tier. Read only
    where the scripted-tier bits (3-4) say "fs" alone, whose bits 5-7 nothing else reads: bit 5 adds the
    object-store tier (first, before fs), bits 6-7 its script. Elsewhere, and where the feature is absent, None:
    a release's examples stay as they were, and zero upper bits stay the fs tier alone."""
    if OBJSTORE_DRAW not in features or byte >> 3 & 3 or not byte >> 5 & 1:
        return None
    return OBJSTORE_SCRIPTS[byte >> 6 & 3]


# -- vLLM's example tier (compat/example_tier.py), where EXAMPLE_TIER_DRAW is a feature (probed:
# VllmApi.has_example_tier, with the object-store draw's probe: the two share the byte) ---------------------------
EXAMPLE_TIER_DRAW = "example_tier"
# bits 6-7 where bits 3-5 are zero (the fs tier alone, no object store): nothing else reads them there
EXAMPLE_TIER_KINDS = ("fs", "example", "fs+example", "example")


def example_tier_kind(byte: int, features: frozenset[str], kind: str) -> str:
    """The secondary tiers with vLLM's example tier drawn in: bits 6-7 of the tier byte, read only where the
    scripted-tier bits (3-4) and the object-store bit (5) are zero, whose bits 6-7 nothing else reads, and where
    the feature is present; elsewhere `kind` unchanged (a release's examples stay as they were)."""
    if EXAMPLE_TIER_DRAW not in features or byte >> 3 & 7:
        return kind
    return EXAMPLE_TIER_KINDS[byte >> 6 & 3]


def p2p_plan_bytes(seed: int, worker: int) -> list[int]:
    """The plan bytes a worker plays, in the order its seed draws (all of them: 0, the plain exchange, among
    them)."""
    order = list(range(P2P_PLANS))
    random.Random(seed * 1_000_003 + worker).shuffle(order)
    return order


def p2p_steps(byte: int) -> list[tuple[str, dict[str, Any]]]:
    """The recipe steps (action, fields) of plan `byte`, as engine/p2p.P2PPair plays the plan: the producer's
    32-token prompt, the consumer's (its prefix plus one token) at step 2 (symmetric: a warm-up request at 2,
    the request at 6), the producer's death and the consumer's abort at their steps; then `P2P_TAIL` steps and
    vLLM's P2P clock a minute on (past its load and AbortAck timeouts), and a few steps more."""
    plan = p2p_plan_fields(byte)
    symmetric = bool(plan["symmetric"])
    role = "symmetric" if symmetric else "pd"
    at: dict[int, list[tuple[str, dict[str, Any]]]] = {}
    if symmetric:
        at.setdefault(2, []).append(("p2p_add", {"side": "consumer", "request": "W", "prompt_tokens": 8,
                                                 "max_tokens": 1, "role": role, "kv_request_id": "warm-up"}))
    at.setdefault(6 if symmetric else 2, []).append(("p2p_add", {
        "side": "consumer", "request": "D", "prompt_tokens": 33, "shared_prefix_with": "P",
        "shared_prefix_tokens": 32, "max_tokens": 3, "role": role}))
    for side in ("producer", "consumer"):
        if plan[f"kill_{side}_at"] is not None:
            at.setdefault(int(plan[f"kill_{side}_at"]), []).append(("p2p_kill", {"side": side}))
    if plan["abort_consumer_at"] is not None:
        at.setdefault(int(plan["abort_consumer_at"]), []).append(("p2p_abort", {"side": "consumer", "request": "D"}))
    steps: list[tuple[str, dict[str, Any]]] = []
    if plan["delay_polls"] or plan["fail_transfers"] or plan["drop"]:
        steps.append(("p2p_fabric", {"delay_polls": plan["delay_polls"], "fail_transfers": plan["fail_transfers"],
                                     **({"drop": list(plan["drop"])} if plan["drop"] else {})}))
    steps.append(("p2p_add", {"side": "producer", "request": "P", "prompt_tokens": 32, "max_tokens": 1,
                              "role": "none" if symmetric else "pd"}))
    last = max(at)
    for index in range(last + 1):
        steps += at.get(index, [])
        steps.append(("schedule", {}))
    steps += [("schedule", {"count": P2P_TAIL}), ("p2p_clock", {"advance_s": 60}), ("schedule", {"count": 5})]
    return steps
