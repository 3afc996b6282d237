"""Write a recipe as a standalone Python script that uses vLLM's own APIs only.

The script body is `kvdoctor/export/standalone.py` (kept as real, testable
Python); exporting replaces its `RECIPE = ...` line with the resolved recipe:
prompts as token ids, the setup as the connector receives it.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvdoctor.engine.setup import Setup
from kvdoctor.errors import UsageError
from kvdoctor.recipes.model import Recipe

_TEMPLATE = Path(__file__).with_name("standalone.py")
_RECIPE_LINE = 'RECIPE = json.loads(r"""{"name": "example", "setup": {}, "steps": []}""")  # replaced on export'


def recipe_data(recipe: Recipe, setup: Setup) -> dict:
    """The script always drives the worker side with plain bookkeeping: the scheduler-side crash it
    reproduces needs no KV bytes, and vLLM's worker connector on a CPU needs kvdoctor's copy
    engine, which a vLLM-only script cannot import (`--worker vllm` exports this same form)."""
    import dataclasses

    from kvdoctor.recipes.geometry import PREEMPT_NEXT, NotApplicable, plan_fill, preempt_plan
    from kvdoctor.scenario import ExpectationFailed, _tokens, preempt_fill_requests, prompt_for

    setup = dataclasses.replace(setup, worker="simulated", device=None)

    prompts: dict[str, list[int]] = {}
    steps = []
    fill_steps = 1
    try:
        preempt = preempt_plan(recipe.steps, setup)
    except NotApplicable as exc:
        raise UsageError(f"cannot export {recipe.name}: {exc}") from None
    for step in recipe.steps:
        args = dict(step.args)
        until = args.pop("until", None) if step.action == "schedule" else None
        if until == "filled":
            args["count"] = fill_steps
        elif until == "prefilled":
            args["count"] = max(1, -(-len(prompts[args.pop("request")]) // setup.max_num_batched_tokens))
        if step.action == "add" and args.get("fill_pool") == PREEMPT_NEXT:
            fill_steps = preempt.steps
            for rid, length, max_tokens in preempt_fill_requests(preempt, args["request"]):
                prompts[rid] = _tokens(len(prompts), length, {}, prompts)
                steps.append({"action": "add", "args": {"request": rid, "prompt": prompts[rid],
                                                        "max_tokens": max_tokens}})
            continue
        if step.action == "add" and args.get("fill_pool"):
            try:
                plan = plan_fill(setup, args.get("max_tokens", 8))
            except NotApplicable as exc:
                raise UsageError(f"cannot export {recipe.name}: {exc}") from None
            fill_steps = plan.steps
            for i, length in enumerate(plan.prompts):
                rid = args["request"] if i == 0 else f"{args['request']}.{i + 1}"
                prompts[rid] = _tokens(len(prompts), length, {}, prompts)
                steps.append({"action": "add", "args": {"request": rid, "prompt": prompts[rid],
                                                        "max_tokens": args.get("max_tokens", 8)}})
            continue
        if step.action == "add":
            try:
                args["prompt"] = prompt_for(step, len(prompts), setup, prompts, preempt)
            except (ExpectationFailed, NotApplicable) as exc:
                raise UsageError(f"cannot export {recipe.name}: {exc}") from None
            prompts[args["request"]] = args["prompt"]
            for key in ("prompt_tokens", "prompt_chunks", "fill_pool", "shared_prefix_with", "shared_prefix_tokens",
                        "trim_tokens", "shared_prefix_chunks", "prompt_rest_of_pool"):
                args.pop(key, None)
        args.pop("description", None)
        steps.append({"action": step.action, "args": args})
    return {
        "name": recipe.name,
        "setup": {
            "block_size": setup.block_size, "gpu_blocks": setup.gpu_blocks, "max_model_len": setup.max_model_len,
            "max_num_seqs": setup.max_num_seqs, "max_num_batched_tokens": setup.max_num_batched_tokens,
            "enable_chunked_prefill": setup.enable_chunked_prefill, "async_scheduling": setup.async_scheduling,
            "enable_prefix_caching": setup.enable_prefix_caching,
            "kv_connector_extra_config": setup.kv_connector_extra_config(),
        },
        "steps": steps,
    }


def export_script(recipe: Recipe, setup: Setup) -> str:
    if recipe.signature.invariant:
        raise UsageError(f"{recipe.name} is a silent bug (invariant {recipe.signature.invariant}); a standalone "
                         f"script reproduces crashes only: attach `kvdoctor repro --report` instead")
    if setup.model is not None or setup.layout is not None:
        raise UsageError("--export-script builds one full-attention KV cache group; it cannot reproduce a "
                         "multi-group layout yet (drop --model / [setup] layout, or attach `kvdoctor repro --report`)")
    late = sorted({s.action for s in recipe.steps if s.action in ("delay_block_hashes", "release_block_hashes")})
    if late or setup.multi_connector:
        what = "late block hashes (" + ", ".join(late) + ")" if late else "a MultiConnector (multi_connector)"
        raise UsageError(f"--export-script cannot reproduce {what} yet: attach `kvdoctor repro --report` instead")
    from kvdoctor.engine.compat import inline_portable

    template = inline_portable(_TEMPLATE.read_text())  # the adapter's vLLM-only reads, copied in
    if _RECIPE_LINE not in template:  # pragma: no cover - guards the template itself
        raise RuntimeError("standalone template lost its RECIPE line")
    payload = json.dumps(recipe_data(recipe, setup), indent=1)
    header = (f"# Generated by kvdoctor from recipe {recipe.name!r}"
              + (f" ({recipe.bug}: {', '.join(recipe.refs)})" if recipe.bug else "") + "\n")
    return header + template.replace(_RECIPE_LINE, f'RECIPE = json.loads(r"""{payload}""")')
