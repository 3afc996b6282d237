"""A recipe's triggers restated at the user's geometry, before vLLM is imported.

Built-in recipes name their triggers in geometry terms (chunks, the pool, the
step budget) rather than token counts that only fit one setup. This module
turns them into concrete prompts, refuses what vLLM itself would refuse (a
prompt longer than max_model_len) and says when a trigger cannot exist at a
geometry (`not_applicable`, with the reason) instead of letting a run end in
`setup_error`.

`fill_pool` ("queue the next request behind this one") is planned here: a
few large filler requests, each within max_model_len, that leave the next
request WAITING with no blocks at the step after the fill. Two ways exist and
the cheaper one is taken:
- budget: the fillers' prompts exceed two steps' token budget, so the step in
  which the next request is considered has no budget left for it (costs about
  2 x max_num_batched_tokens tokens, whatever the pool size);
- pool: the pool is smaller than that; the fillers take every usable block,
  including the blocks their own decodes need up to that step.
The plan is simulated with vLLM's FCFS admission rules (running requests first,
then waiting ones while budget and max_num_seqs allow; without chunked prefill
a waiting prompt must fit the remaining budget whole). Block 0 is vLLM's null
block.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvdoctor.engine.setup import Setup
from kvdoctor.errors import UsageError


class NotApplicable(Exception):
    """The recipe's trigger cannot exist at this geometry (the message says why)."""


@dataclass(frozen=True)
class FillPlan:
    prompts: tuple[int, ...]  # filler prompt lengths, the first is the named request's
    steps: int  # schedule() calls that complete the fill (a `schedule until = "filled"` step)
    mode: str  # "budget" | "pool"

    def describe(self) -> str:
        size = f"{len(self.prompts)} filler request(s) of {max(self.prompts)} tokens or fewer"
        why = ("the step budget" if self.mode == "budget" else "the GPU pool")
        return f"{size} take {why} in {self.steps} step(s)"


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _simulate(setup: Setup, prompts: list[int], max_steps: int) -> list[int | None]:
    """The step (1-based) in which each filler's last prompt token is scheduled (None: not yet)."""
    budget_per_step = setup.max_num_batched_tokens
    remaining = list(prompts)
    running: list[int] = []
    waiting = list(range(len(prompts)))
    done: list[int | None] = [None] * len(prompts)
    for step in range(1, max_steps + 1):
        budget = budget_per_step
        for i in running:
            if budget <= 0:
                break
            if remaining[i] > 0:
                n = min(remaining[i], budget)
                remaining[i] -= n
                budget -= n
                if remaining[i] == 0:
                    done[i] = step
            else:
                budget -= 1  # a decode token
        while waiting and budget > 0 and len(running) < setup.max_num_seqs:
            i = waiting[0]
            if not setup.enable_chunked_prefill and remaining[i] > budget:
                break
            n = min(remaining[i], budget)
            remaining[i] -= n
            budget -= n
            running.append(waiting.pop(0))
            if remaining[i] == 0:
                done[i] = step
    return done


def _split(total_blocks: int, cap_blocks: int) -> list[int]:
    full, rest = divmod(total_blocks, cap_blocks)
    return [cap_blocks] * full + ([rest] if rest else [])


def plan_fill(setup: Setup, max_tokens: int) -> FillPlan:
    """Filler prompts that leave the next request queued with no blocks one step after the fill."""
    bs, budget = setup.block_size, setup.max_num_batched_tokens
    usable = setup.gpu_blocks - 1
    cap = setup.max_model_len - max_tokens
    if not setup.enable_chunked_prefill:
        cap = min(cap, budget)
    cap_blocks = cap // bs
    if cap_blocks < 1:
        raise NotApplicable(f"a filler request needs one {bs}-token block of prompt plus {max_tokens} "
                            f"output tokens within max_model_len {setup.max_model_len}")
    seqs = setup.max_num_seqs

    # budget: more than two steps' budget queued ahead of the next request.
    blocks = _ceil(2 * budget + bs, bs)
    prompts = _split(blocks, cap_blocks)[: seqs + 1]
    done = _simulate(setup, [p * bs for p in prompts], 1)
    decoders = sum(1 for d in done if d is not None)
    if blocks + decoders * _ceil(4, bs) + 1 <= usable:  # room for three steps of decodes
        return FillPlan(tuple(p * bs for p in prompts), 1, "budget")

    # pool: every usable block taken at the step the next request is considered.
    reserve = [1] * len(_split(max(1, usable - 1), cap_blocks))
    for _ in range(20):
        total = usable - sum(reserve)
        if total < 1:
            raise NotApplicable(f"the GPU pool ({usable} usable blocks of {bs} tokens) cannot hold a "
                                f"filler request and its decode blocks")
        prompts = _split(total, cap_blocks)
        if len(prompts) > seqs:  # the rest would only wait: the next request queues behind them anyway
            prompts = prompts[: seqs + 1]
        horizon = len(prompts) * 2 + _ceil(total * bs, budget) + 2
        done = _simulate(setup, [p * bs for p in prompts], horizon)
        if any(d is None for d in done[:seqs]):
            raise NotApplicable("the filler requests cannot all be scheduled at this geometry")
        steps = max(d for d in done if d is not None)
        new_reserve = [_ceil(steps + 1 - d, bs) if d is not None else 0 for d in done]
        if new_reserve == reserve:
            return FillPlan(tuple(p * bs for p in prompts), steps, "pool")
        reserve = new_reserve
    raise NotApplicable("no stable filler plan at this geometry")


def prompt_length(args: dict, setup: Setup) -> int:
    """An `add` step's prompt length at this geometry (fill_pool: its first filler's)."""
    if "prompt" in args:
        return len(args["prompt"])
    if args.get("fill_pool"):
        return plan_fill(setup, args.get("max_tokens", 8)).prompts[0]
    if "prompt_chunks" in args:
        length = args["prompt_chunks"] * setup.offloaded_block_size - args.get("trim_tokens", 0)
        if length < 1:
            raise NotApplicable(f"{args['prompt_chunks']} chunk(s) of {setup.offloaded_block_size} tokens less "
                                f"{args['trim_tokens']} token(s) leave no prompt")
        return length
    return args["prompt_tokens"]


def shared_prefix_length(args: dict, setup: Setup) -> int:
    if "shared_prefix_chunks" in args:
        return args["shared_prefix_chunks"] * setup.offloaded_block_size
    return args.get("shared_prefix_tokens", 0)


def check(recipe, setup: Setup) -> list[str]:
    """Refuse what vLLM would refuse; return why the trigger cannot exist here (empty: it can).

    A user's recipe file with a prompt longer than max_model_len is a usage
    error naming the step; a built-in recipe's trigger that does not fit the
    user's geometry is not applicable, with the reason.
    """
    reasons: list[str] = []
    counter = 0
    for step in recipe.steps:
        counter += step.args.get("count", 1) if step.action == "schedule" else 1
        if step.action != "add":
            continue
        try:
            length = prompt_length(step.args, setup)
        except NotApplicable as exc:
            reasons.append(f"step {counter} (line {step.line}) add {step.args['request']}: {exc}")
            continue
        total = length + step.args.get("max_tokens", 8)
        usable = setup.gpu_blocks - 1
        if length > setup.max_model_len and not recipe.builtin:  # vLLM rejects it: a usage error, first
            raise UsageError(f"{recipe.source}:{step.line}: step {counter} (line {step.line}) add "
                             f"{step.args['request']}: a {length}-token prompt with max_tokens "
                             f"{step.args.get('max_tokens', 8)} does not fit max_model_len {setup.max_model_len} "
                             f"(vLLM rejects such a request); raise --max-model-len")
        if not step.args.get("fill_pool") and _ceil(length + 1, setup.block_size) > usable:
            # vLLM admits a request only when its whole prompt fits the free blocks
            reasons.append(f"step {counter} (line {step.line}) add {step.args['request']}: a {length}-token prompt "
                           f"needs {_ceil(length + 1, setup.block_size)} blocks of {setup.block_size} tokens; the "
                           f"pool has {usable} usable")
            continue
        if length > setup.max_model_len:
            message = (f"step {counter} (line {step.line}) add {step.args['request']}: a {length}-token prompt "
                       f"with max_tokens {step.args.get('max_tokens', 8)} does not fit max_model_len "
                       f"{setup.max_model_len} (vLLM rejects such a request)")
            if recipe.builtin:
                reasons.append(message)
            else:
                raise UsageError(f"{recipe.source}:{step.line}: {message}; raise --max-model-len")
        elif total > setup.max_model_len and recipe.builtin:
            reasons.append(f"step {counter} (line {step.line}) add {step.args['request']}: {length} prompt + "
                           f"{step.args.get('max_tokens', 8)} output tokens exceed max_model_len "
                           f"{setup.max_model_len}")
    for requirement in recipe.requires:
        kind, _, value = requirement.partition(":")
        if kind == "setup":
            reason = _setup_requirement(value, setup, recipe)
            if reason:
                reasons.append(reason)
    return reasons


def cpu_tier_chunks(setup: Setup) -> int:
    """Chunks the CPU tier holds for kvdoctor's tiny KV spec (64 bytes a token; the tiering
    spec pads each chunk to whole 4 KiB pages)."""
    chunk = setup.offloaded_block_size * 64
    if setup.spec_name == "TieringOffloadingSpec":
        chunk = _ceil(chunk, 4096) * 4096
    return setup.cpu_bytes_to_use // chunk


_GEOMETRY_FIELDS = ("block_size", "blocks_per_chunk", "gpu_blocks", "max_num_batched_tokens", "max_num_seqs",
                    "enable_chunked_prefill")


def _own_geometry(setup: Setup, recipe) -> str | None:
    differ = [f"{name}={getattr(setup, name)}" for name in _GEOMETRY_FIELDS
              if name in recipe.setup and recipe.setup[name] != getattr(setup, name)]
    if not differ:
        return None
    own = ", ".join(f"{name}={recipe.setup[name]}" for name in _GEOMETRY_FIELDS if name in recipe.setup)
    return (f"this recipe's trigger is scripted for its own geometry ({own}) and not yet restated for "
            f"{', '.join(differ)}")


_SETUP_REQUIREMENTS = {
    "sync_scheduling": lambda s, r: None if not s.async_scheduling else (
        "the trigger needs synchronous scheduling: under --async-scheduling the step already in flight "
        "computes the last sampled token's KV slot, so the final store is legitimate"),
    "one_chunk_cpu_tier": lambda s, r: None if cpu_tier_chunks(s) == 1 else (
        f"the trigger needs a CPU tier whose every block is held by an in-flight store; this one holds "
        f"{cpu_tier_chunks(s):,} chunks (cpu_bytes_to_use={s.cpu_bytes_to_use:,})"),
    "own_geometry": lambda s, r: _own_geometry(s, r),
    "two_running_requests": lambda s, r: None if s.max_num_seqs >= 2 else (
        "the trigger needs two requests running at once; --max-num-seqs is 1"),
}


def _setup_requirement(name: str, setup: Setup, recipe) -> str | None:
    return _SETUP_REQUIREMENTS[name](setup, recipe)


def is_known_setup_requirement(name: str) -> bool:
    return name in _SETUP_REQUIREMENTS
