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

`fill_pool = "preempt_next"` (with the `prompt_rest_of_pool` request after it)
is planned here too (`plan_preempt`): fillers take every usable block but the
next request's, which is admitted mid-prefill in the step their prefills end
and loses a block to the last filler's first decode in the next step, so it is
preempted with whole chunks unstored. Its simulation also counts blocks step by
step, with vLLM's rule that a waiting request is admitted only when its whole
prompt fits the free blocks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvdoctor.engine.kv_layout import MAMBA, SLIDING, resolve_layout
from kvdoctor.engine.serve_args import flag_name
from kvdoctor.engine.setup import PLANNED_FIELDS, Setup
from kvdoctor.errors import UsageError

if TYPE_CHECKING:
    from collections.abc import Sequence

    from kvdoctor.recipes.model import Recipe, Step


@dataclass(frozen=True)
class Need:
    """A Setup value that would let a trigger exist here: `field op value` (op ">=", "<=" or "==")."""

    field: str
    value: Any
    op: str = ">="

    def holds(self, setup: Setup) -> bool:
        have = getattr(setup, self.field)
        return have >= self.value if self.op == ">=" else have <= self.value if self.op == "<=" else \
            have == self.value

    def change(self) -> str:
        """The smallest change of the user's flags that meets it, in flag terms."""
        if isinstance(self.value, bool):
            return flag_name(self.field, self.value)
        if self.value is None:
            return f"no {flag_name(self.field)}"
        bound = {">=": " or more", "<=": " or less", "==": ""}[self.op]
        return f"{flag_name(self.field)} {self.value}{bound}"


class NotApplicable(Exception):
    """The recipe's trigger cannot exist at this geometry (the message says why; `needs`: what would
    let it exist, alternatives in order of preference)."""

    def __init__(self, message: str, needs: tuple[Need, ...] | list[Need] = ()) -> None:
        super().__init__(message)
        self.needs = tuple(needs)


@dataclass(frozen=True)
class Problem:
    """Why a trigger cannot exist at a geometry, and the changes that would let it (first: preferred)."""

    message: str
    needs: tuple[Need, ...] = ()
    requirement: str | None = None  # the recipe's `setup:<name>` requirement it comes from (None: the steps)


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
                            f"output tokens within max_model_len {setup.max_model_len}",
                            [Need("max_model_len", bs + max_tokens), Need("max_num_batched_tokens", bs)])
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
                                f"filler request and its decode blocks", [Need("gpu_blocks", sum(reserve) + 2)])
        prompts = _split(total, cap_blocks)
        if len(prompts) > seqs:  # the rest would only wait: the next request queues behind them anyway
            prompts = prompts[: seqs + 1]
        horizon = len(prompts) * 2 + _ceil(total * bs, budget) + 2
        done = _simulate(setup, [p * bs for p in prompts], horizon)
        if any(d is None for d in done[:seqs]):
            raise NotApplicable("the filler requests cannot all be scheduled at this geometry",
                                [Need("max_num_seqs", len(prompts) + 1)])
        steps = max(d for d in done if d is not None)
        new_reserve = [_ceil(steps + 1 - d, bs) if d is not None else 0 for d in done]
        if new_reserve == reserve:
            return FillPlan(tuple(p * bs for p in prompts), steps, "pool")
        reserve = new_reserve
    # the reserve alternates between two plans (a filler more or less): a block more or a longer filler settles it
    raise NotApplicable("no stable filler plan at this geometry",
                        [Need("gpu_blocks", setup.gpu_blocks + 1), Need("max_model_len", setup.max_model_len + bs)])


def reloaded_prompts(steps: Sequence[Step], setup: Setup) -> frozenset[str]:
    """Requests whose whole-chunk prompt (`prompt_chunks`, no `trim_tokens`) is reloaded from the offload tier
    after a `reset_prefix_cache` (the prefix a later request shares, or the request itself where the reset
    preempts running requests), at a `--model` with sliding-window or Mamba layers: they get one prompt token
    more (`prompt_length`).

    Why: since vLLM's `prefix_cache_retention_interval = 0` default, the connector stores a sliding-window or
    Mamba group's chunk only at a semantic checkpoint, the request's replay boundary (its prompt less one
    token) among them; a prompt of whole chunks puts that boundary a token short of its last chunk, so the
    chunk is stored for the attention groups only and the reload misses (measured on 0.30.0 and 0.34.0:
    prefetch at gpt-oss-20b, Gemma 3 and Qwen3-Next, preempt-reload-same-step at Gemma 3 ended setup_error,
    no hit). One token more puts the boundary at the chunk's end; releases that store densely store it too."""
    if setup.model is None or not any(layer.kind in (SLIDING, MAMBA) for layer in
                                      resolve_layout(setup.model, None, setup.sliding_window).layers):
        return frozenset()
    whole = {s.args["request"] for s in steps if s.action == "add" and "prompt_chunks" in s.args
             and "trim_tokens" not in s.args}
    reloaded: set[str] = set()
    added: list[str] = []
    reset_seen = False
    for step in steps:
        if step.action == "reset_prefix_cache":
            reset_seen = True
            if step.args.get("reset_running_requests"):
                reloaded.update(added)
        elif step.action == "add":
            if reset_seen and "shared_prefix_with" in step.args:
                reloaded.add(step.args["shared_prefix_with"])
            added.append(step.args["request"])
    return frozenset(reloaded & whole)


def prompt_length(args: dict, setup: Setup, preempt: PreemptPlan | None = None,
                  reloaded: frozenset[str] = frozenset()) -> int:
    """An `add` step's prompt length at this geometry (fill_pool: its first filler's; prompt_rest_of_pool:
    the victim's of `preempt`, the recipe's preempting fill; `reloaded`: `reloaded_prompts`, a token more)."""
    if "prompt" in args:
        return len(args["prompt"])
    if args.get("fill_pool") == PREEMPT_NEXT:
        return (preempt or _no_plan()).fillers[0]
    if args.get("fill_pool"):
        return plan_fill(setup, args.get("max_tokens", 8)).prompts[0]
    if args.get("prompt_rest_of_pool"):
        return (preempt or _no_plan()).victim
    if "prompt_chunks" in args:
        trim = args.get("trim_tokens", 0)
        length = args["prompt_chunks"] * setup.offloaded_block_size - trim
        if length < 1:
            per_block = args["prompt_chunks"] * setup.blocks_per_chunk
            raise NotApplicable(f"{args['prompt_chunks']} chunk(s) of {setup.offloaded_block_size} tokens less "
                                f"{trim} token(s) leave no prompt",
                                [Need("block_size", _ceil(trim + 1, per_block)),
                                 Need("blocks_per_chunk", _ceil(trim + 1, args["prompt_chunks"] * setup.block_size))])
        return length + (1 if args.get("request") in reloaded else 0)
    return args["prompt_tokens"]


def shared_prefix_length(args: dict, setup: Setup) -> int:
    if "shared_prefix_chunks" in args:
        return args["shared_prefix_chunks"] * setup.offloaded_block_size
    return args.get("shared_prefix_tokens", 0)


PREEMPT_NEXT = "preempt_next"  # fill_pool = "preempt_next": fill so that the next request is preempted


def _no_plan() -> PreemptPlan:
    raise NotApplicable("no preempting fill was planned for this recipe")


def preempt_plan(steps: Sequence[Step], setup: Setup) -> PreemptPlan | None:
    """The plan of a recipe's `fill_pool = "preempt_next"` and the `prompt_rest_of_pool` add after it
    (None where the recipe has none; NotApplicable where the geometry has none)."""
    fill = next((s for s in steps if s.action == "add" and s.args.get("fill_pool") == PREEMPT_NEXT), None)
    if fill is None:
        return None
    victim = next((s for s in steps if s.action == "add" and s.args.get("prompt_rest_of_pool")), None)
    return plan_preempt(setup, fill.args.get("max_tokens", 8), victim.args.get("max_tokens", 8) if victim else 8)


def check(recipe: Recipe, setup: Setup) -> list[str]:
    """Refuse what vLLM would refuse; return why the trigger cannot exist here (empty: it can)."""
    return [problem.message for problem in problems(recipe, setup)]


def problems(recipe: Recipe, setup: Setup) -> list[Problem]:
    """Why the trigger cannot exist at this geometry, each with the changes that would let it.

    A user's recipe file with a prompt longer than a max_model_len it or the user fixed is a usage error
    naming the step (vLLM rejects such a request); everything else is a `Problem` for `plan_setup`.
    """
    found: list[Problem] = []
    try:
        preempt = preempt_plan(recipe.steps, setup)
    except NotApplicable as exc:
        return [Problem(str(exc), exc.needs)]
    counter = 0
    reloaded = reloaded_prompts(recipe.steps, setup)
    mml_fixed = "max_model_len" in setup.fixed or (not recipe.builtin and "max_model_len" in recipe.setup)
    for step in recipe.steps:
        counter += step.args.get("count", 1) if step.action == "schedule" else 1
        if step.action != "add":
            continue
        where = f"step {counter} (line {step.line}) add {step.args['request']}"
        try:
            length = prompt_length(step.args, setup, preempt, reloaded)
        except NotApplicable as exc:
            found.append(Problem(f"{where}: {exc}", exc.needs))
            continue
        max_tokens = step.args.get("max_tokens", 8)
        total = length + max_tokens
        usable = setup.gpu_blocks - 1
        if length > setup.max_model_len and not recipe.builtin and mml_fixed:  # vLLM rejects it: a usage error
            raise UsageError(f"{recipe.source}:{step.line}: {where}: a {length}-token prompt with max_tokens "
                             f"{max_tokens} does not fit max_model_len {setup.max_model_len} "
                             f"(vLLM rejects such a request); raise --max-model-len")
        if not step.args.get("fill_pool") and not step.args.get("prompt_rest_of_pool") and \
                _ceil(length + 1, setup.block_size) > usable:
            # vLLM admits a request only when its whole prompt fits the free blocks
            found.append(Problem(f"{where}: a {length}-token prompt needs {_ceil(length + 1, setup.block_size)} "
                                 f"blocks of {setup.block_size} tokens; the pool has {usable} usable",
                                 (Need("gpu_blocks", _ceil(length + 1, setup.block_size) + 1),)))
            continue
        if total > setup.max_model_len:
            found.append(Problem(f"{where}: {length} prompt + {max_tokens} output tokens exceed max_model_len "
                                 f"{setup.max_model_len} (vLLM rejects such a request)",
                                 (Need("max_model_len", total),)))
    for model_problem in (_model_preemption(recipe, setup), _hybrid_one_chunk_tier(recipe, setup)):
        if model_problem:
            found.append(model_problem)
    waived = {name for name, _ in setup.waived}
    for requirement in recipe.requires:
        kind, _, value = requirement.partition(":")
        if kind == "setup" and value not in waived:
            problem = _SETUP_REQUIREMENTS[value](setup, recipe)
            if problem:
                found.append(dataclasses.replace(problem, requirement=value))
    return found


def _chunk_bytes(setup: Setup) -> int:
    """One offloaded chunk's KV bytes: kvdoctor's tiny KV spec (64 bytes a token), or a `--model`'s own
    pages (every layer's K and V; `KvLayout.page_bytes`); the tiering spec pads a chunk to whole 4 KiB pages."""
    if setup.model is not None:
        from kvdoctor.engine.kv_layout import resolve_layout

        chunk = resolve_layout(setup.model, None, setup.sliding_window).page_bytes(setup.block_size) \
            * setup.blocks_per_chunk
    else:
        chunk = setup.offloaded_block_size * 64
    return _ceil(chunk, 4096) * 4096 if setup.spec_name == "TieringOffloadingSpec" else chunk


def cpu_tier_chunks(setup: Setup) -> int:
    """Chunks the CPU tier holds (`_chunk_bytes` each)."""
    return setup.cpu_bytes_to_use // _chunk_bytes(setup)


# cpu_bytes_to_use: a recipe that sets its CPU tier's size scripts evictions by it (K3, K9, K11).
_GEOMETRY_FIELDS = ("block_size", "blocks_per_chunk", "gpu_blocks", "max_num_batched_tokens", "max_num_seqs",
                    "enable_chunked_prefill", "cpu_bytes_to_use")


def _own_geometry(setup: Setup, recipe: Recipe) -> Problem | None:
    differ = [name for name in _GEOMETRY_FIELDS if name in recipe.setup and recipe.setup[name] != getattr(setup, name)]
    if setup.model is not None and "cpu_bytes_to_use" in differ and \
            _recipe_tier_chunks(recipe, setup) == cpu_tier_chunks(setup):
        differ.remove("cpu_bytes_to_use")  # the same chunks in the model's bytes (`plan_setup`)
    if setup.model is not None and not setup.enable_prefix_caching and not recipe.setup.get("enable_prefix_caching",
                                                                                            True):
        from kvdoctor.engine.kv_layout import MAMBA, resolve_layout

        if any(layer.kind == MAMBA for layer in resolve_layout(setup.model, None, setup.sliding_window).layers):
            return Problem(f"this recipe's trigger is scripted without prefix caching, and vLLM's connector needs "
                           f"prefix caching for a Mamba hybrid's hash blocks (--model {setup.model}; measured on "
                           f"0.26.0: build_offloading_config asserts tokens_per_block divisible by tokens_per_hash)",
                           (Need("model", None, "=="),))
    if not differ:
        return None
    own = ", ".join(f"{name}={recipe.setup[name]}" for name in _GEOMETRY_FIELDS if name in recipe.setup)
    return Problem(f"this recipe's trigger is scripted for its own geometry ({own}) and not yet restated for "
                   f"{', '.join(f'{name}={getattr(setup, name)}' for name in differ)}",
                   tuple(Need(name, recipe.setup[name], "==") for name in differ))


def one_chunk_cpu_bytes(setup: Setup) -> int:
    """cpu_bytes_to_use of a CPU tier of exactly one chunk (see `cpu_tier_chunks`)."""
    return tier_bytes(setup, 1)


def tier_bytes(setup: Setup, chunks: int) -> int:
    """cpu_bytes_to_use of a CPU tier of `chunks` chunks. A `--model`'s chunk is estimated from its layers
    before vLLM groups them, and a hybrid's groups may pad their layer counts (vLLM's chunk is then larger):
    half an estimated chunk more keeps the count where vLLM's chunk is near the estimate (for one chunk:
    0.75x-1.5x; measured on the six shipped configs, Gemma 3's seven groups included)."""
    if setup.model is None:
        return chunks * _chunk_bytes(setup)
    tier = (2 * chunks + 1) * _chunk_bytes(setup) // 2
    return _ceil(tier, 4096) * 4096 if setup.spec_name == "TieringOffloadingSpec" else tier


def _model_preemption(recipe: Recipe, setup: Setup) -> Problem | None:
    """A recipe that preempts a request by running the GPU pool out counts a block of every KV cache group for
    each block of tokens (the pool of a `--model` is sized so: kv_layout's `_pool_for_groups`). A model whose
    Mamba groups or sliding-window groups (a window shorter than max_model_len) hold fewer blocks for a long
    request leaves the pool unspent: measured on 0.26.0, preemption at Qwen3-Next and
    readmitted-stale-store-cursor at gpt-oss-20b (128-token window) never preempted and ended setup_error.
    A fill that only queues the next request (`fill_pool = true`) is restated for Mamba groups
    (`mamba_fill_requests`: the pool counts the blocks they hold) and holds at every window shipped."""
    if setup.model is None:
        return None
    preempts = any(step.action == "expect" and "PREEMPTED" in str(step.args.get("status", "")) for step in recipe.steps)
    if not preempts:
        return None
    from kvdoctor.engine.kv_layout import MAMBA, SLIDING, resolve_layout

    layers = resolve_layout(setup.model, None, setup.sliding_window).layers
    short = sorted({layer.sliding_window for layer in layers if layer.kind == SLIDING
                    and layer.sliding_window is not None and layer.sliding_window < setup.max_model_len})
    mamba = any(layer.kind == MAMBA for layer in layers)
    if not short and not mamba:
        return None
    kinds = " and ".join((["Mamba"] if mamba else []) + ([f"{short[0]}-token sliding-window"] if short else []))
    return Problem(f"this recipe preempts a request by running the GPU pool out, "
                   f"a block of every KV cache group for each block of tokens; the {kinds} groups of --model "
                   f"{setup.model} hold fewer blocks for a long request, and kvdoctor has not restated the fill "
                   f"for them",
                   (Need("model", None, "=="),))


def _hybrid_one_chunk_tier(recipe: Recipe, setup: Setup) -> Problem | None:
    """A CPU tier of exactly one chunk (`setup:one_chunk_cpu_tier`) at a `--model` with more than one kind of
    layer: vLLM's chunk bytes depend on how it groups and aliases the layers' pages, which kvdoctor does not
    know before vLLM is imported (measured: finished-after-finalize held two chunks at Gemma 3, gpt-oss and
    Qwen3-Next on 0.34.0, one on 0.26.0, and ended setup_error)."""
    if setup.model is None or "setup:one_chunk_cpu_tier" not in recipe.requires:
        return None
    from kvdoctor.engine.kv_layout import resolve_layout

    kinds = {(layer.kind, layer.sliding_window) for layer in resolve_layout(setup.model, None,
                                                                            setup.sliding_window).layers}
    if len(kinds) < 2:
        return None
    return Problem(f"the trigger needs a CPU tier of exactly one chunk; the chunk of --model {setup.model} "
                   f"({len(kinds)} kinds of layer) is sized by how vLLM groups them, which kvdoctor does not "
                   f"estimate before vLLM is imported", (Need("model", None, "=="),))


def _recipe_tier_chunks(recipe: Recipe, setup: Setup) -> int | None:
    """The chunks of the CPU tier a recipe's [setup] sizes in bytes of kvdoctor's tiny KV spec (None: none)."""
    if "cpu_bytes_to_use" not in recipe.setup:
        return None
    return recipe.setup["cpu_bytes_to_use"] // _chunk_bytes(dataclasses.replace(setup, model=None))


def _problem(ok: bool, message: str, *needs: Need) -> Problem | None:
    return None if ok else Problem(message, needs)


_SETUP_REQUIREMENTS = {
    "sync_scheduling": lambda s, r: _problem(
        not s.async_scheduling,
        "the trigger as this recipe plays it needs synchronous scheduling: under --async-scheduling the next "
        "step is scheduled before this step's output is applied, which changes what the trigger sets up",
        Need("async_scheduling", False, "==")),
    "one_chunk_cpu_tier": lambda s, r: _problem(
        cpu_tier_chunks(s) == 1,
        f"the trigger needs a CPU tier whose every block is held by an in-flight store; this one holds "
        f"{cpu_tier_chunks(s):,} chunks (cpu_bytes_to_use={s.cpu_bytes_to_use:,})",
        Need("cpu_bytes_to_use", one_chunk_cpu_bytes(s), "==")),
    "own_geometry": lambda s, r: _own_geometry(s, r),
    "last_token_in_prompt_block": lambda s, r: _problem(
        s.block_size > 1,
        "at block_size 1 the last sampled token's slot opens a block that was never allocated, so "
        "the final store cannot cover it silently (measured: 0.26.0 pairs the chunk's offload keys with too "
        "few blocks and _build_store_jobs asserts, K1's assertion; 0.27.0 on builds no such store)",
        Need("block_size", 2)),
    "two_running_requests": lambda s, r: _problem(
        s.max_num_seqs >= 2, "the trigger needs two requests running at once; --max-num-seqs is 1",
        Need("max_num_seqs", 2)) or _two_fit(s, r),
    "prefill_in_one_step": lambda s, r: _one_step_prefills(s, r),
}


def _one_step_prefills(setup: Setup, recipe: Recipe) -> Problem | None:
    """Each `schedule until = "prefilled"` request's prompt, beside the others' decodes, within one step's
    budget (a recipe whose other requests' few output tokens must outlast that prefill)."""
    prefilled = {s.args.get("request") for s in recipe.steps
                 if s.action == "schedule" and s.args.get("until") == "prefilled"}
    # the others decoding beside it: the recipe's other requests, as many as may run at once (measured on
    # 0.26.0: finished-after-finalize reproduces at a budget of its prompt + 15, max_num_seqs 16, which the
    # earlier bound of prompt + max_num_seqs called impossible)
    others = min(setup.max_num_seqs, sum(1 for s in recipe.steps if s.action == "add")) - 1
    for step in recipe.steps:
        if step.action == "add" and step.args.get("request") in prefilled:
            try:
                length = prompt_length(step.args, setup, reloaded=reloaded_prompts(recipe.steps, setup))
            except NotApplicable:
                return None  # reported by `problems` itself
            if length + others > setup.max_num_batched_tokens:
                return Problem(f"the trigger needs {step.args['request']}'s {length}-token prompt prefilled in "
                               f"one step beside the others' decodes (their few output tokens must outlast it); "
                               f"the step budget is {setup.max_num_batched_tokens} tokens",
                               (Need("max_num_batched_tokens", length + others),))
    return None


def _two_fit(setup: Setup, recipe: Recipe) -> Problem | None:
    """The pool holds the recipe's two largest requests at once (prompt and outputs, whole blocks)."""
    sizes = []
    for step in recipe.steps:
        if step.action == "add" and not step.args.get("fill_pool") and not step.args.get("prompt_rest_of_pool"):
            try:
                length = prompt_length(step.args, setup, reloaded=reloaded_prompts(recipe.steps, setup))
            except NotApplicable:
                return None  # reported by `problems` itself
            sizes.append(_ceil(length + step.args.get("max_tokens", 8), setup.block_size))
    needed = sum(sorted(sizes)[-2:]) + 1  # block 0 is vLLM's null block
    return _problem(setup.gpu_blocks >= needed,
                    f"the trigger needs its two requests running at once: {needed - 1} blocks of "
                    f"{setup.block_size} tokens; the pool has {setup.gpu_blocks - 1} usable",
                    Need("gpu_blocks", needed))


def is_known_setup_requirement(name: str) -> bool:
    return name in _SETUP_REQUIREMENTS


# -- measured reasons ----------------------------------------------------------------------------------------

# A requirement whose sentence is a claim about vLLM ("the trigger needs X") and the Setup field the claim is
# about: where the user's own value of that field breaks it, the recipe is not declared untested on the
# sentence's word. The run is played at the user's value and judged by what happens; the sentence is shown
# as the explanation only where `kvdoctor matrix --audit --write-data` measured the recipe at that field's
# other value on this release and the measurement supports it (kvdoctor/matrix/reasons.py). `own_geometry`
# is not one: it says kvdoctor has not restated the recipe's script for another geometry (kvdoctor's limit,
# not vLLM's), and a pool or a prompt vLLM would refuse is vLLM's own rule.
MEASURED_REASONS: dict[str, str] = {
    "sync_scheduling": "async_scheduling",
    "last_token_in_prompt_block": "block_size",
    "two_running_requests": "max_num_seqs",
    "one_chunk_cpu_tier": "cpu_bytes_to_use",
    "prefill_in_one_step": "max_num_batched_tokens",
}


def measured_reasons(recipe: Recipe) -> list[str]:
    """The recipe's requirements that are measured reasons, in the recipe's order."""
    return [value for kind, _, value in (r.partition(":") for r in recipe.requires)
            if kind == "setup" and value in MEASURED_REASONS]


def reason_alternative(recipe: Recipe, requirement: str, planned: Setup) -> dict[str, Any]:
    """The Setup value that breaks `requirement` nearest the recipe's own plan (`planned`: the recipe at
    default flags): what a measurement of the reason runs the recipe at."""
    if requirement == "sync_scheduling":
        return {"async_scheduling": True}
    if requirement == "last_token_in_prompt_block":
        return {"block_size": 1}
    if requirement == "two_running_requests":
        return {"max_num_seqs": 1}
    if requirement == "one_chunk_cpu_tier":
        return {"cpu_bytes_to_use": 2 * one_chunk_cpu_bytes(planned)}
    if requirement == "prefill_in_one_step":
        problem = _one_step_prefills(dataclasses.replace(planned, max_num_batched_tokens=1), recipe)
        if problem is None:
            raise ValueError(f"{recipe.name}: no request is prefilled in one step")
        return {"max_num_batched_tokens": problem.needs[0].value - 1}
    raise ValueError(f"{requirement!r} is not a measured reason")


# -- preempt the next request mid-prefill (`fill_pool = "preempt_next"`, then `prompt_rest_of_pool`) --------

# Running the pool out takes every usable block in prompt tokens, so the fill's cost grows with the pool; past
# this many schedule() calls a run takes minutes, and the recipe says so instead of running.
MAX_PREEMPT_FILL_STEPS = 2048
# Freed blocks are counted free this many steps after their request finished: async scheduling applies the
# output a step late and some releases defer the free a step more (a synchronous run frees them sooner).
_FREE_LAG = 3
# Steps after the victim's preemption in which nothing else may be preempted and the victim, re-considered
# for admission, must not fit: the recipe's re-consideration, its abort's step, and one of async lag.
_AFTER_PREEMPTION = 3


@dataclass(frozen=True)
class PreemptPlan:
    """Requests that get the next request (the victim) preempted mid-prefill, sized at the geometry.

    Spacers (one output token each) are prefilled first and finish: they use step budget and give their
    blocks back. Fillers (prompts of whole blocks) then take every usable block but the victim's. The
    victim's prompt, `victim` tokens of whole chunks, is admitted in the step the last filler's prefill
    ends (`admit_step`), with `leftover` tokens of budget, fewer than its prompt. In the next step the last
    filler's first decode takes a new block (its prompt ends on a block boundary), so the victim cannot get
    the blocks the rest of its prompt needs and is preempted (FCFS preempts the last running request) in
    step `fail_step`, with `victim_computed` tokens computed: fewer than its whole chunks, so at least one
    of its chunks has an offload key and no store job.
    """
    spacers: tuple[int, ...]
    fillers: tuple[int, ...]
    filler_max_tokens: int
    victim: int
    admit_step: int
    leftover: int
    fail_step: int
    victim_computed: int

    @property
    def steps(self) -> int:
        """A `schedule until = "filled"` after this fill: the steps before the preemption's."""
        return self.fail_step - 1

    def describe(self) -> str:
        spacers = f"{len(self.spacers)} spacer(s) of {sum(self.spacers)} tokens, " if self.spacers else ""
        return (f"{spacers}{len(self.fillers)} filler(s) of {max(self.fillers)} tokens or fewer; the "
                f"{self.victim}-token request is admitted in step {self.admit_step} with {self.leftover} tokens "
                f"of budget and preempted in step {self.fail_step}")


@dataclass
class _Req:
    prompt: int
    max_tokens: int
    computed: int = 0
    blocks: int = 0
    outputs: int = 0


def _simulate_preempt(setup: Setup, spacers: list[int], fillers: list[int], victim: int,
                      filler_max_tokens: int, max_steps: int) -> dict | None:
    """vLLM's FCFS chunked-prefill scheduling, counted in blocks and budget.

    Running requests first, in admission order, while budget remains (a prefill takes what the budget
    allows, a decode one token); then waiting ones while budget and max_num_seqs allow and their whole
    prompt fits the free blocks. None where the plan would depend on when finished requests' blocks are
    freed (a request waits for blocks) or a request other than the victim would be preempted.
    """
    bs, budget_per_step = setup.block_size, setup.max_num_batched_tokens
    free = setup.gpu_blocks - 1
    reqs = ([_Req(p, 1) for p in spacers] + [_Req(p, filler_max_tokens) for p in fillers]
            + [_Req(victim, 1 << 30)])
    victim_index = len(reqs) - 1
    waiting = list(range(len(reqs)))
    running: list[int] = []
    releases: dict[int, int] = {}  # step -> blocks freed then
    out = {"admit_step": None, "leftover": None, "free_at_admission": None, "fail_step": None,
           "victim_computed": None, "last_release": 0, "reconsidered": None}
    for step in range(1, max_steps + 1):
        free += releases.pop(step, 0)
        if out["fail_step"] is not None and step > out["fail_step"] + _AFTER_PREEMPTION:
            return out
        budget = budget_per_step
        scheduled: list[int] = []
        preempted_now = False
        for i in list(running):
            if budget <= 0 or i not in running:
                break
            r = reqs[i]
            n = min(r.prompt - r.computed, budget) if r.computed < r.prompt else 1
            need = _ceil(r.computed + n, bs) - r.blocks
            if need > free:
                if releases:
                    return None
                if running[-1] != victim_index or out["admit_step"] is None or out["fail_step"] is not None:
                    return {**out, "short": need - free}  # a filler would be preempted
                out["fail_step"], out["victim_computed"] = step, reqs[victim_index].computed
                # the victim is preempted: its blocks come back, the filler retries
                free += reqs[victim_index].blocks
                reqs[victim_index] = _Req(victim, 1 << 30)
                running.remove(victim_index)
                waiting.insert(0, victim_index)
                preempted_now = True
                if i == victim_index:
                    break
                need = _ceil(r.computed + n, bs) - r.blocks
                if need > free:
                    return {**out, "short": need - free}
            r.blocks += need
            free -= need
            budget -= n
            r.computed += n
            scheduled.append(i)
        while not preempted_now and waiting and budget > 0 and len(running) < setup.max_num_seqs:
            i = waiting[0]
            r = reqs[i]
            if i == victim_index and out["fail_step"] is not None:
                if _ceil(r.prompt, bs) <= free:
                    return None  # the preempted victim would be re-admitted
                out["reconsidered"] = step
                break
            if _ceil(r.prompt, bs) > free:
                if releases:
                    return None  # it would wait for blocks: a guess at when the spacers' are freed
                return {**out, "short": _ceil(r.prompt, bs) - free}
            if i == victim_index:
                if any(reqs[j].computed < reqs[j].prompt for j in running) or releases:
                    return None
                out["admit_step"], out["leftover"], out["free_at_admission"] = step, budget, free
            n = min(r.prompt, budget)
            r.blocks = _ceil(n, bs)
            free -= r.blocks
            r.computed = n
            budget -= n
            running.append(waiting.pop(0))
            scheduled.append(i)
        for i in scheduled:
            r = reqs[i]
            if r.computed >= r.prompt:
                r.outputs += 1
                if r.outputs >= r.max_tokens:
                    running.remove(i)
                    releases[step + _FREE_LAG] = releases.get(step + _FREE_LAG, 0) + r.blocks
                    out["last_release"] = step + _FREE_LAG
    return out


def _spacer_prompts(tokens: int, setup: Setup) -> list[int]:
    """`tokens` of budget in one-token-output requests within max_model_len."""
    cap = min(setup.max_model_len - 1, setup.max_num_batched_tokens)
    return [cap] * (tokens // cap) + ([tokens % cap] if tokens % cap else [])


def plan_preempt(setup: Setup, max_tokens: int, victim_max_tokens: int) -> PreemptPlan:
    """Spacers, fillers and a victim prompt that get the victim preempted mid-prefill at this geometry.

    The victim's prompt is k whole chunks (k = 4, the founding case, where that works; else other sizes,
    largest first) and takes every block the fillers leave free when it is admitted. The fillers' prompts
    are whole blocks, as few requests as max_model_len allows (more where that helps); the spacers' tokens
    leave the victim about half its prompt of budget in the step that admits it.
    """
    bs, chunk = setup.block_size, setup.offloaded_block_size
    usable, budget = setup.gpu_blocks - 1, setup.max_num_batched_tokens
    if not setup.enable_chunked_prefill:
        raise NotApplicable("without chunked prefill vLLM schedules a prompt whole, in the step that admits it "
                            "and only when all its blocks fit: a request is never preempted mid-prefill",
                            [Need("enable_chunked_prefill", True, "==")])
    if setup.max_num_seqs < 2:
        raise NotApplicable("the trigger needs a filler request decoding beside the preempted one; "
                            "--max-num-seqs is 1", [Need("max_num_seqs", 2)])
    if budget >= usable * bs:
        # the others in the step that admits it hold at most the rest of the pool, so the budget left covers it
        raise NotApplicable(f"the step budget ({budget:,} tokens) covers the whole GPU pool ({usable:,} blocks of "
                            f"{bs} tokens): a prompt that fits the free blocks is scheduled whole in the step "
                            f"that admits it, never left mid-prefill",
                            [Need("gpu_blocks", budget // bs + 2),
                             Need("max_num_batched_tokens", max(setup.max_num_seqs, usable * bs - 1), "<=")])
    max_chunks = min(setup.max_model_len - victim_max_tokens, (usable - 1) * bs) // chunk
    if max_chunks < 1:
        raise NotApplicable(f"the preempted request needs a prompt of at least one {chunk}-token chunk plus "
                            f"{victim_max_tokens} output tokens within max_model_len {setup.max_model_len}, "
                            f"and a block left for a filler in the {usable}-block pool",
                            [Need("max_model_len", chunk + victim_max_tokens),
                             Need("gpu_blocks", setup.blocks_per_chunk + 2)])
    est_steps = _ceil(usable * bs + budget, max(1, budget - setup.max_num_seqs)) + 2
    if est_steps > MAX_PREEMPT_FILL_STEPS:
        raise NotApplicable(f"running the GPU pool out of blocks takes its {usable:,} usable blocks "
                            f"({usable * bs:,} tokens) in prompts, about {est_steps:,} steps at "
                            f"{budget:,} tokens a step; kvdoctor bounds this fill at "
                            f"{MAX_PREEMPT_FILL_STEPS:,} steps",
                            [Need("max_num_batched_tokens",
                                  _ceil(usable * bs, MAX_PREEMPT_FILL_STEPS - 16) + setup.max_num_seqs + 1),
                             Need("gpu_blocks", (MAX_PREEMPT_FILL_STEPS - 16) * max(1, budget - setup.max_num_seqs)
                                  // bs, "<=")])
    filler_max_tokens = max(max_tokens, est_steps + 8)
    cap_blocks = (setup.max_model_len - filler_max_tokens) // bs
    if cap_blocks < 1:
        raise NotApplicable(f"a filler request needs one {bs}-token block of prompt plus {filler_max_tokens} "
                            f"output tokens (the fill's steps) within max_model_len {setup.max_model_len}",
                            [Need("max_model_len", filler_max_tokens + bs)])
    m_min = _ceil(usable - 1, cap_blocks)
    if m_min + 1 > setup.max_num_seqs:
        # fewer, longer fillers (a longer context), or more requests running at once
        raise NotApplicable(f"filling the {usable:,}-block pool takes {m_min} requests of at most "
                            f"{cap_blocks * bs} prompt tokens (max_model_len {setup.max_model_len}) running "
                            f"beside the preempted one; --max-num-seqs is {setup.max_num_seqs}",
                            [Need("max_model_len", _ceil(usable - 1, max(1, setup.max_num_seqs - 1)) * bs
                                  + filler_max_tokens),
                             Need("max_num_seqs", m_min + 1)])
    sizes = ([4] if max_chunks >= 4 else []) + [k for k in range(max_chunks, 0, -1) if k != 4]
    counts = sorted({m for m in (m_min, m_min + 1, 2 * m_min) if m < setup.max_num_seqs})
    for k in sizes[:8]:
        for m in counts:
            plan = _fit_preempt(setup, k, m, cap_blocks, filler_max_tokens, est_steps + 8)
            if plan is not None:
                return plan
    raise NotApplicable(f"no fill of this {usable:,}-block pool leaves a request of whole {chunk}-token chunks "
                        f"admitted with less step budget than its prompt and then short of a block "
                        f"(max_num_seqs {setup.max_num_seqs}, max_model_len {setup.max_model_len})")


def _fit_preempt(setup: Setup, k: int, m: int, cap_blocks: int, filler_max_tokens: int,
                 max_steps: int) -> PreemptPlan | None:
    """Fixed point of spacer tokens and m fillers' blocks around a k-chunk victim: the fillers leave
    exactly the victim's blocks free at its admission, the spacers leave it about half its prompt of budget."""
    bs, chunk, budget = setup.block_size, setup.offloaded_block_size, setup.max_num_batched_tokens
    usable = setup.gpu_blocks - 1
    victim_blocks, victim = k * setup.blocks_per_chunk, k * chunk
    total = usable - victim_blocks
    spacer_tokens = 0
    for _ in range(24):
        if total < m or total > m * cap_blocks:
            return None
        blocks = [total // m + (1 if i < total % m else 0) for i in range(m)]
        blocks.sort(reverse=True)
        # All but the last filler end a token into their last block: their decodes need no new block for
        # block_size - 1 steps. The last ends on a block boundary: its first decode takes a block.
        fillers = [b * bs - (bs - 1 if i < m - 1 else 0) for i, b in enumerate(blocks)]
        spacers = _spacer_prompts(spacer_tokens, setup)
        sim = _simulate_preempt(setup, spacers, fillers, victim, filler_max_tokens, max_steps)
        if sim is None:
            return None
        if sim["admit_step"] is None:
            if "short" not in sim:
                return None
            total -= sim["short"]  # the fillers' own decodes need these blocks before the victim is admitted
            continue
        slack = sim["free_at_admission"] - victim_blocks
        leftover = sim["leftover"]
        if slack != 0:
            total += slack
            continue
        target = max(1, victim - bs)  # the victim holds all but about a block: room for the fillers' decodes
        if not 0 < leftover < victim:
            spacer_tokens += (leftover - target) % budget
            continue
        if "short" in sim:
            return None
        if (sim["fail_step"] is not None and sim["victim_computed"] // chunk < k and sim["reconsidered"]
                and sim["admit_step"] >= sim["last_release"]
                and sim["fail_step"] + 4 <= filler_max_tokens):
            return PreemptPlan(tuple(spacers), tuple(fillers), filler_max_tokens, victim, sim["admit_step"],
                               leftover, sim["fail_step"], sim["victim_computed"])
        return None
    return None


# -- planning a recipe at the user's geometry ----------------------------------------------------------------

# Rounds of "meet every open need, look again": each round meets at least one need or stops.
_PLAN_ROUNDS = 32


def plan_setup(recipe: Recipe, setup: Setup) -> Setup:
    """The setup the recipe runs at: the user's values kept, every other size derived to meet the trigger.

    Each round asks `problems` what the trigger lacks here; each problem names the changes that would let
    it exist (first: preferred). A change of a field the user did not fix is made (sizes are raised or
    lowered to the smallest value that meets the need); where every change a problem names touches a field
    the user fixed, the recipe is untested at this geometry: `Setup.untested` names the flag and the
    smallest change that allows it. A user's recipe file fixes its own [setup] values as well.
    """
    fixed = set(setup.fixed) | (set() if recipe.builtin else set(recipe.setup) & set(PLANNED_FIELDS))
    if setup.model is not None:
        fixed.add("model")  # the user's model: never planned away
    setup, mamba = _server_mamba_cache_mode(setup)
    chunks = _recipe_tier_chunks(recipe, setup) if setup.model is not None else None
    if chunks and "cpu_bytes_to_use" not in fixed:  # the recipe's CPU tier, in the model's chunks
        setup = dataclasses.replace(setup, cpu_bytes_to_use=tier_bytes(setup, chunks))
    start = setup
    preferred: dict[str, Any] = {}
    for need in _preferences(recipe, setup):
        if need.field not in fixed and not need.holds(setup):
            preferred[need.field] = max(preferred.get(need.field, need.value), need.value)
    if preferred:
        setup = dataclasses.replace(setup, **preferred).with_rules_kept()
    for _ in range(_PLAN_ROUNDS):
        found = problems(recipe, setup)
        if not found:
            derived = tuple(f"{name}: {getattr(start, name)} -> {getattr(setup, name)}" for name in PLANNED_FIELDS
                            if getattr(start, name) != getattr(setup, name))
            return dataclasses.replace(setup, derived=mamba + derived, untested=None,
                                       mamba_fill_requests=_mamba_fill_requests(recipe, setup))
        changes: dict[str, Any] = {}
        waive: list[tuple[str, str]] = []
        for problem in found:
            open_needs = [need for need in problem.needs if not need.holds(setup)]
            free = [need for need in open_needs if need.field not in fixed]
            if not free and problem.requirement in MEASURED_REASONS and \
                    MEASURED_REASONS[problem.requirement] in {need.field for need in open_needs}:
                # a claim about vLLM, not a planning fact: played at the user's value (see MEASURED_REASONS)
                waive.append((problem.requirement, _untested(recipe, problem, open_needs, start)))
                continue
            if not free:
                return dataclasses.replace(setup, derived=mamba,
                                           untested=_untested(recipe, problem, open_needs, start))
            need = free[0]
            have = changes.get(need.field)
            if have is None or need.op == "==":
                changes[need.field] = need.value
            else:
                changes[need.field] = max(have, need.value) if need.op == ">=" else min(have, need.value)
        if waive:
            setup = dataclasses.replace(setup, waived=setup.waived + tuple(waive))
        try:
            setup = dataclasses.replace(setup, **changes, fixed=tuple(sorted(fixed))).with_rules_kept().validate()
        except UsageError as exc:
            return dataclasses.replace(setup, untested=f"{found[0].message}; meeting it breaks a rule vLLM "
                                                       f"enforces at the given flags: {exc}")
    return dataclasses.replace(setup, untested="; ".join(p.message for p in problems(recipe, setup))
                               + " (kvdoctor found no geometry for this trigger within the given flags)")


def _server_mamba_cache_mode(setup: Setup) -> tuple[Setup, tuple[str, ...]]:
    """A `--model` with Mamba layers runs in the Mamba cache mode vLLM's `MambaModelConfig` picks where none is
    given: with prefix caching, `align` (Mamba state a block) for a model class without Mamba prefix-caching
    support (`all` for one with it, which a recipe's [setup] mamba_cache_mode chooses); kvdoctor builds no
    model class, and left unset its Mamba groups' block (max_model_len) would not divide the hash block."""
    if setup.model is None or setup.mamba_cache_mode is not None or not setup.enable_prefix_caching:
        return setup, ()

    if not any(layer.kind == MAMBA for layer in resolve_layout(setup.model, None, setup.sliding_window).layers):
        return setup, ()
    return dataclasses.replace(setup, mamba_cache_mode="align"), (
        "mamba_cache_mode: None -> align (vLLM's pick with prefix caching for a model class without Mamba "
        "prefix-caching support)",)


def _mamba_fill_requests(recipe: Recipe, setup: Setup) -> int | None:
    """The requests that hold Mamba state when a `fill_pool = true` fill has run the pool out: its fillers
    (None: no `--model` with Mamba layers, or no such fill; `Setup.mamba_fill_requests`)."""
    fill = next((s for s in recipe.steps if s.action == "add" and s.args.get("fill_pool") is True), None)
    if fill is None or setup.model is None:
        return None
    if not any(layer.kind == MAMBA for layer in resolve_layout(setup.model, None, setup.sliding_window).layers):
        return None
    return len(plan_fill(setup, fill.args.get("max_tokens", 8)).prompts)


# A preempting fill takes every usable block in prompts at the step budget; a budget that takes it in
# more steps than this is raised where the user did not give one (the recipe's own 8 tokens suit its 8 blocks).
_PREFERRED_FILL_STEPS = 32


def _preferences(recipe: Recipe, setup: Setup) -> list[Need]:
    """Sizes the trigger does not need but runs better at (fewer steps), taken only where the user gave none."""
    needs = []
    if any(s.action == "add" and s.args.get("fill_pool") == PREEMPT_NEXT for s in recipe.steps):
        bs, pool_tokens = setup.block_size, (setup.gpu_blocks - 1) * setup.block_size
        budget = _ceil(_ceil(pool_tokens, _PREFERRED_FILL_STEPS), bs) * bs
        if budget < pool_tokens:
            needs.append(Need("max_num_batched_tokens", budget))
    # `schedule until = "prefilled"` counts a prompt's steps at the whole budget; others' decodes share it, so
    # a prompt exactly one budget long would take a step more than counted
    prefilled = {s.args.get("request") for s in recipe.steps if s.action == "schedule"
                 and s.args.get("until") == "prefilled"}
    for step in recipe.steps:
        if step.action == "add" and step.args.get("request") in prefilled:
            try:
                length = prompt_length(step.args, setup, reloaded=reloaded_prompts(recipe.steps, setup))
            except NotApplicable:
                continue
            if length <= setup.max_num_batched_tokens < length + setup.max_num_seqs:
                needs.append(Need("max_num_batched_tokens", length + setup.max_num_seqs))
    return needs


def _untested(recipe: Recipe, problem: Problem, needs: list[Need], start: Setup) -> str:
    """Why the user's values make the trigger impossible, the flag that prevents it and the smallest change
    that allows it: the value a plan with that one flag left free derives (else the problem's own bound)."""
    if not needs:
        return f"{problem.message} (kvdoctor knows no change of the flags that allows it)"
    given = ", ".join(dict.fromkeys(
        flag_name(n.field, getattr(start, n.field)) if isinstance(getattr(start, n.field), bool)
        else f"{flag_name(n.field)} {getattr(start, n.field)}" for n in needs))
    changes = []
    for need in needs:
        freed = dataclasses.replace(start, fixed=tuple(f for f in start.fixed if f != need.field))
        planned = plan_setup(recipe, freed) if recipe.builtin and need.field in start.fixed else None
        if planned is not None and planned.untested is None and not isinstance(need.value, bool):
            changes.append(f"{flag_name(need.field)} {getattr(planned, need.field)}")
        else:
            changes.append(need.change())
    return (f"{problem.message}; the given {given} prevents it; the smallest change that allows it: "
            + " or ".join(dict.fromkeys(changes)))
