"""Write a recipe as a standalone Python script that uses vLLM's own APIs only.

The script body is `kvdoctor/export/standalone.py` (kept as real, testable
Python); exporting replaces its `RECIPE = ...` line with the resolved recipe
(prompts as token ids, the setup as the connector receives it), its `PLAYS`
line with each step kind's `script` lines from its declaration (`kvdoctor.steps`;
a kind without one refuses the export, naming the step), and copies in the one
definition of the adapter's vLLM-only reads, the simulated worker and the step loop.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvdoctor import clean_exit, expectation
from kvdoctor.engine import answer_key, step_loop, worker
from kvdoctor.engine.compat import inline_portable
from kvdoctor.engine.serve_args import exported_setup
from kvdoctor.engine.setup import Setup
from kvdoctor.engine.tiny_model import config_json
from kvdoctor.errors import UsageError
from kvdoctor.levels import serve
from kvdoctor.recipes.compile import compile_recipe
from kvdoctor.recipes.geometry import NotApplicable
from kvdoctor.recipes.model import Recipe
from kvdoctor.steps import REGISTRY, Unsupported, kind_of

_TEMPLATE = Path(__file__).with_name("standalone.py")
_RECIPE_LINE = 'RECIPE = json.loads(r"""{"name": "example", "setup": {}, "steps": []}""")  # replaced on export'
_PLAYS_LINE = ("    # each step kind the recipe uses, played as its declaration says: replaced on export\n"
               "    PLAYS: dict[str, Callable[[dict[str, Any]], None]] = {}\n")
_CONFIG_LINE = "CONFIG_JSON = r'''{}'''  # kvdoctor's tiny model config.json, replaced on export"


def _raw(name: str, text: str) -> str:
    """`NAME = r'''text'''`, refusing text that would not survive the literal (kvdoctor's bug)."""
    if "'''" in text or text.endswith("\\"):
        raise RuntimeError(f"{name}: the text cannot be embedded in a raw string")
    return f"{name} = r'''{text}'''"


def _plays(kinds: set[str]) -> str:
    """`PLAYS`, inside the script's `main`: one function per step kind the recipe uses, its body the kind's
    `script` lines (`kvdoctor.steps`), in declaration order."""
    import textwrap

    lines = []
    for name, kind in REGISTRY.items():
        if name in kinds:
            if isinstance(kind.script, Unsupported):  # pragma: no cover - export_script refused it first
                raise RuntimeError(f"step kind {name!r} has no exported form")
            body = textwrap.indent(kind.script.strip("\n") + "\n", " " * 8)
            lines.append(f"    def play_{name}(args: dict[str, Any]) -> None:\n{body}\n")
    table = ", ".join(f'"{name}": play_{name}' for name in REGISTRY if name in kinds)
    return "".join(lines) + f"    PLAYS: dict[str, Callable[[dict[str, Any]], None]] = {{{table}}}\n"


def _with_tiny_config(template: str) -> str:
    """The template with kvdoctor's one tiny-model config.json (`engine.tiny_model`) embedded as text."""
    if _CONFIG_LINE not in template:  # pragma: no cover - guards the template itself
        raise RuntimeError("standalone template lost its CONFIG_JSON line")
    return template.replace(_CONFIG_LINE, _raw("CONFIG_JSON", config_json()))


def recipe_data(recipe: Recipe, setup: Setup) -> dict:
    """The script always drives the worker side with plain bookkeeping: the scheduler-side crash it
    reproduces needs no KV bytes, and vLLM's worker connector on a CPU needs kvdoctor's copy
    engine, which a vLLM-only script cannot import (`--worker vllm` exports this same form)."""
    import dataclasses

    setup = dataclasses.replace(setup, worker="simulated", device=None)
    try:
        compiled = compile_recipe(recipe.steps, setup)
    except NotApplicable as exc:
        raise UsageError(f"cannot export {recipe.name}: {exc}") from None
    steps: list[dict[str, Any]] = []
    for play in compiled.steps:
        if play.repeat > 1:  # the script repeats a schedule by its count
            continue
        kind = kind_of(play.action)
        args = dict(play.args)
        if kind.repeats and args.pop("until", None) is not None:
            args.pop("request", None)
            args["count"] = play.repeats
        if kind.admits:  # each of its requests by token ids (a fill admits several)
            sizing = ("prompt_tokens", "prompt_chunks", "fill_pool", "shared_prefix_with", "shared_prefix_tokens",
                      "trim_tokens", "shared_prefix_chunks", "prompt_rest_of_pool")
            kept = {key: value for key, value in args.items() if key not in sizing}
            if args.get("fill_pool"):
                steps.extend({"action": play.action, "args": {"request": new.request, "prompt": list(new.prompt),
                                                              "max_tokens": new.max_tokens}} for new in play.requests)
                continue
            args = {**kept, "prompt": list(play.requests[0].prompt)}
        args.pop("description", None)
        steps.append({"action": play.action, "args": args})
    return {
        "name": recipe.name,
        "setup": {
            **exported_setup(setup),  # the serve geometry, from the one serve-flag table
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
    for number, step in enumerate(recipe.steps, 1):  # a kind the script cannot play: refused, never skipped
        script = kind_of(step.action).script
        if isinstance(script, Unsupported):
            raise UsageError(f"--export-script cannot reproduce step {number} (line {step.line}) `{step.action}`: "
                             f"{script.why}")
    if setup.multi_connector or setup.speculative_method or setup.pd_decode:
        what = ("a MultiConnector (multi_connector)" if setup.multi_connector
                else "a P/D decode node (pd_decode: kvdoctor's NIXL stand-in)" if setup.pd_decode
                else "speculative decoding (kvdoctor's stand-in drafter)")
        raise UsageError(f"--export-script cannot reproduce {what} yet: attach `kvdoctor repro --report` instead")
    if setup.num_workers > 1:  # the script's one bookkeeping worker would report each job once
        raise UsageError(f"--export-script cannot reproduce num_workers = {setup.num_workers} yet (several "
                         f"workers' reports combined): attach `kvdoctor repro --report` instead")

    template = inline_portable(_TEMPLATE.read_text())  # the adapter's vLLM-only reads, copied in
    for module in (worker, step_loop, expectation):  # the simulated worker, the step loop, `expect`: copied in
        template = inline_portable(template, module)
    template = inline_portable(template, clean_exit)  # nothing left behind, the prompt back at once
    template = _with_tiny_config(template)
    if _RECIPE_LINE not in template or _PLAYS_LINE not in template:  # pragma: no cover - guards the template
        raise RuntimeError("standalone template lost its RECIPE or PLAYS line")
    data = recipe_data(recipe, setup)
    template = template.replace(_PLAYS_LINE, _plays({step["action"] for step in data["steps"]}))
    payload = json.dumps(data, indent=1)
    header = (f"# Generated by kvdoctor from recipe {recipe.name!r}"
              + (f" ({recipe.bug}: {', '.join(recipe.refs)})" if recipe.bug else "") + "\n")
    return header + template.replace(_RECIPE_LINE, f'RECIPE = json.loads(r"""{payload}""")')


_SERVE_TEMPLATE = Path(__file__).with_name("standalone_serve.py")
_CORE = Path(__file__).resolve().parents[1] / "engine" / "core"  # the stand-ins' one source, embedded verbatim
_SERVE_LINES = {
    "recipe": 'RECIPE = json.loads(r"""{"name": "example", "serve_args": [], "events": [], "signature": {}}""")'
              '  # replaced on export',
    "platform": "PLATFORM_SOURCE = r'''\"\"\"replaced on export\"\"\"'''",
    "executor": "EXECUTOR_SOURCE = r'''\"\"\"replaced on export\"\"\"'''",
}
# The platform plugin declines unless the exported script started the server (its child's environment).
_REGISTER = """

import os


def register():
    \"\"\"The `vllm.platform_plugins` entry point: declines unless the exported script asked.\"\"\"
    if os.environ.get("KVREPRO_STANDIN") != "1":
        return None
    return "kvrepro_standin.platform.KvdoctorCpuPlatform"
"""


def _script_args(setup: Setup) -> list[str]:
    """The serve level's `vllm serve` flags for `setup`, less those the script gives itself."""
    from kvdoctor.engine.tiny_model import tiny_model_dir  # the model the script writes: its tiers sized by it

    model = tiny_model_dir()
    command = serve.serve_command(setup, model, 0)
    args = command[command.index(model) + 1:]
    for flag in ("--host", "--port", "--distributed-executor-backend"):  # the script gives its own
        at = args.index(flag)
        del args[at:at + 2]
    return args


def serve_recipe_data(recipe: Recipe, setup: Setup) -> dict:
    """What the exported serve script plays: kvdoctor's own serve level's flags, traffic and pacing; for a
    silent bug also the reference's flags (the same geometry with offloading off, `serve.reference_setup`)."""
    import dataclasses

    reasons = serve.unplayable(recipe, setup, "the serve script")
    if reasons:
        raise UsageError(f"--export-script --engine serve: cannot export {recipe.name}: {reasons[0]}")
    if setup.model is not None or setup.layout is not None:
        raise UsageError("--export-script --engine serve builds one full-attention KV cache group (drop --model / "
                         "[setup] layout)")
    setup = serve.serve_setup(setup)
    # the executor plan (holds, completions, late EOS) the script's stand-in plays itself (`StandInExecutor`)
    planned = serve.executor_plan(recipe, setup)
    failing = [entry for entry in planned if entry["action"] not in ("hold", "complete", "eos")]
    if failing:
        raise UsageError(f"--export-script --engine serve: cannot export {recipe.name}: its {failing[0]['action']} "
                         f"at engine step {failing[0]['step']} fails a transfer, which the script's stand-in "
                         f"executor cannot (it holds and completes transfers only): run `kvdoctor repro "
                         f"{recipe.name} --engine serve`")
    traffic = serve.plan_traffic(recipe, setup)
    events = [dataclasses.asdict(event) for event in traffic]
    silent = bool(recipe.signature.invariant)
    return {"name": recipe.name, "serve_args": _script_args(setup), "events": events,
            "aborted": [e["request"] for e in events if e["kind"] == "abort"],
            "step_seconds": serve.STEP_SECONDS, "admission_len": serve.admission_len(setup),
            "plan": planned, "pace_steps": serve.paced_steps(traffic),
            "signature": {"exception": recipe.signature.exception, "function": recipe.signature.function,
                          "invariant": recipe.signature.invariant},
            # a silent bug: its clients' answers against the same traffic's on a server with offloading off
            "reference_args": _script_args(serve.reference_setup(setup)) if silent else None}


def export_serve_script(recipe: Recipe, setup: Setup) -> str:
    """A script that imports only vLLM and the standard library: it writes the two stand-ins beside itself,
    starts `vllm serve`, plays the recipe's clients and exits 1 when the engine dies, 0 when it survives; for
    a silent bug it starts a second server with offloading off, the stand-in executor answering from the KV
    it keeps (`StandInKv`), and exits 1 when a client's completion differs from the reference's, 0 when
    every completion equals it."""
    from kvdoctor import clean_exit
    from kvdoctor.levels import serve_client

    data = serve_recipe_data(recipe, setup)
    template = _with_tiny_config(inline_portable(_SERVE_TEMPLATE.read_text(), serve_client))  # the client, copied in
    template = inline_portable(template, clean_exit)  # nothing left behind, the prompt back at once
    for key, line in _SERVE_LINES.items():
        if line not in template:  # pragma: no cover - guards the template itself
            raise RuntimeError(f"standalone serve template lost its {key} line")
    platform = (_CORE / "cpu_platform.py").read_text()
    executor = inline_portable(inline_portable((_CORE / "standin_executor.py").read_text()), answer_key)
    payload = json.dumps(data, indent=1)
    text = (template.replace(_SERVE_LINES["recipe"], f'RECIPE = json.loads(r"""{payload}""")')
            .replace(_SERVE_LINES["platform"], _raw("PLATFORM_SOURCE", platform.rstrip("\n") + _REGISTER))
            .replace(_SERVE_LINES["executor"], _raw("EXECUTOR_SOURCE", executor)))
    header = (f"# Generated by kvdoctor from recipe {recipe.name!r} for `vllm serve`"
              + (f" ({recipe.bug}: {', '.join(recipe.refs)})" if recipe.bug else "") + "\n")
    return header + text
