"""Application functions: one per command, free of Typer and of formatting.

Each resolves its inputs, asks the engine level it names (`levels.runners`) to play the recipes, and
returns a result type (`kvdoctor.results`) for `kvdoctor.report` to render.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

from kvdoctor.engine import compat
from kvdoctor.engine.compat import VllmApi
from kvdoctor.engine.setup import Setup, resolve_blocks_per_chunk
from kvdoctor.errors import UsageError
from kvdoctor.export.script import export_script, export_serve_script
from kvdoctor.levels.in_process import check_spec_name
from kvdoctor.levels.runners import runner
from kvdoctor.logic.variants import expand_logic
from kvdoctor.matrix.known import FixedIn, fixed_in
from kvdoctor.observe.metrics import MeasurementIncomplete, measured_bugs, take_measurement
from kvdoctor.observe.verdict import Outcome
from kvdoctor.recipes import builtins as builtin_recipes  # the module: tests swap its catalogue
from kvdoctor.recipes.geometry import plan_setup
from kvdoctor.recipes.model import Recipe, bug_order
from kvdoctor.results import AuditReport, AuditRow, MetricRow, ReproReport, RunResult
from kvdoctor.steps import Need, kinds_needing

# The exported form of each level that has one (`--export-script`); the core level has none.
EXPORTERS: dict[str, Callable[[Recipe, Setup], str]] = {"scheduler": export_script, "serve": export_serve_script}


def resolve_setup(recipe: Recipe, overrides: dict[str, Any], worker_fallback: bool = False,
                  default_worker: str | None = None) -> Setup:
    """The one resolution of a run's setup, validated before vLLM is imported, in this order:

    1. the recipe's [setup] over `Setup`'s defaults;
    2. the user's flags over it (`overrides`: `Setup` fields, None = not given), and where neither a flag
       nor the recipe names a worker, the command's `default_worker` (repro, inspect and audit: vLLM's);
    3. the fallbacks, each recorded with its reason: `Setup.worker_fallback` where vLLM's worker was asked
       for but cannot run this setup (a MultiConnector, a Mamba layout) and the simulated worker runs
       instead, and `Setup.device_fallback` (`resolve_device`).

    The worker falls back where it was only the command's default, or where `worker_fallback` allows it
    (audit, per recipe); otherwise asking vLLM's worker for such a setup is a usage error (exit 2), as for
    `repro --worker vllm`."""
    base = dict(recipe.setup)
    extra = dict(base.pop("extra_connector_config", {}))
    try:
        setup = Setup(**base, extra_connector_config=extra)
    except TypeError as exc:
        raise UsageError(f"{recipe.source}: bad [setup]: {exc}") from None
    overrides = dict(overrides)
    worker_defaulted = (default_worker is not None and overrides.get("worker") is None
                        and "worker" not in recipe.setup)
    if worker_defaulted:
        overrides["worker"] = default_worker
    if (worker_fallback or worker_defaulted) and (overrides.get("worker") or setup.worker) == "vllm":
        names = {f.name for f in dataclasses.fields(setup)}
        asked = dataclasses.replace(setup, **{k: v for k, v in overrides.items() if k in names and v is not None})
        unsupported = asked.vllm_worker_unsupported()
        memory = None if unsupported else asked.vllm_worker_memory_refusal()
        # the user's own sizes (not the setup's kind) past this machine: refused; audit makes that recipe untested
        if memory and not worker_fallback:
            raise UsageError(f"vLLM's worker (the default) cannot run this geometry here: {memory} "
                             f"(--worker simulated runs it without KV bytes)")
        refusal = unsupported or memory
        if refusal:
            overrides.update(worker=None, device=None)
            setup = dataclasses.replace(setup, worker="simulated", device=None, worker_fallback=refusal)
    offloaded = overrides.pop("_offloaded_block_size", None)
    if "extra_connector_config" in overrides and overrides["extra_connector_config"] is not None:
        overrides["extra_connector_config"] = {**setup.extra_connector_config, **overrides["extra_connector_config"]}
    setup = setup.with_overrides(**overrides)
    if offloaded is not None:
        if overrides.get("blocks_per_chunk") is not None:
            bpc = resolve_blocks_per_chunk(setup.block_size, offloaded)
            if bpc != setup.blocks_per_chunk:
                raise UsageError("--blocks-per-chunk and kv_connector_extra_config.block_size disagree")
        setup = setup.with_overrides(blocks_per_chunk=resolve_blocks_per_chunk(setup.block_size, offloaded))
    setup = plan_setup(recipe, setup)  # sizes the user did not give, derived to meet the trigger
    return resolve_device(setup, recipe, fallback=worker_fallback)  # audit: --device cuda falls back too


def resolve_device(setup: Setup, recipe: Recipe, fallback: bool = False) -> Setup:
    """Where vLLM's worker keeps the KV tensors: the GPU when torch sees one, unless told, or unless the
    recipe controls transfers (its steps need `Need.TRANSFER_CONTROL`: only kvdoctor's copy engine on CPU
    tensors can hold or fail a transfer at a chosen step; vLLM's own CUDA worker completes each transfer
    when the GPU does): then the CPU, and `Setup.device_fallback` says why.
    An explicit --device cuda on such a recipe is a usage error, except where `fallback` (audit)."""
    if setup.worker != "vllm":
        return setup
    import torch  # heavy (~1 s): only where vLLM's worker runs

    has_cuda = bool(torch.cuda.is_available())
    if setup.device == "cuda" and not has_cuda:
        raise UsageError("--device cuda: torch sees no CUDA GPU on this machine (use --device cpu)")
    copy_engine_steps = kinds_needing(Need.TRANSFER_CONTROL)
    controls = sorted({step.action for step in recipe.steps if step.action in copy_engine_steps})
    if controls and setup.device != "cpu" and (has_cuda or setup.device == "cuda"):
        why = (f"{' and '.join(controls)} need kvdoctor's copy engine on CPU tensors; vLLM's own CUDA worker "
               f"completes transfers when the GPU does")
        if setup.device == "cuda" and not fallback:
            raise UsageError(f"--device cuda: recipe {recipe.name}'s {why} (use --device cpu)")
        return dataclasses.replace(setup, device="cpu", device_fallback=why)
    if setup.device is None:
        return setup.with_overrides(device="cuda" if has_cuda else "cpu")
    return setup


def load_vllm() -> VllmApi:
    return compat.load()


def repro(recipe_ref: str, overrides: dict[str, Any], logic: str, record_timeline: bool = False,
          command: str = "", default_worker: str | None = None,
          on_progress: Callable[[int, int, str], None] | None = None) -> ReproReport:
    """`on_progress(done, total, what runs now)` is called before the import and each logic variant."""
    recipe = builtin_recipes.resolve(recipe_ref)
    variants = expand_logic(logic)
    # resolving plans the geometry: what vLLM would refuse (a prompt longer than max_model_len) is exit 2 here
    setup = resolve_setup(recipe, overrides, default_worker=default_worker)
    level = runner(setup.engine)
    level.check_logic(logic)
    return level.repro(recipe, setup, variants, overrides=overrides, command=command, fixed_in=_fixed_in(recipe),
                       record_timeline=record_timeline, progress=on_progress or (lambda done, total, what: None))


def export(recipe_ref: str, overrides: dict[str, Any], path: Path, default_worker: str | None = None) -> None:
    """Write the recipe as a standalone script (no vLLM import here): the scheduler level's, or with
    `--engine serve` one that starts `vllm serve` with its two stand-ins and plays the recipe's clients."""
    recipe = builtin_recipes.resolve(recipe_ref)
    setup = resolve_setup(recipe, overrides, default_worker=default_worker)
    exporter = EXPORTERS.get(setup.engine)
    if exporter is None:
        raise UsageError(f"--export-script writes a scheduler-level script, or with --engine serve a `vllm serve` "
                         f"one; --engine {setup.engine} has no exported form")
    text = exporter(recipe, setup)
    try:
        path.write_text(text)
    except OSError as exc:
        raise UsageError(f"--export-script {path}: {exc.strerror}") from None


def audit(command: str = "", overrides: dict[str, Any] | None = None,
          default_worker: str | None = None,
          on_progress: Callable[[int, int, str], None] | None = None) -> AuditReport:
    """Every built-in recipe against the installed vLLM: one vLLM import, one process.
    `on_progress(done, total, what runs now)` is called before each piece of work.

    Each recipe is played by the engine level `--engine` names (`levels.runners`): at `--engine core`
    through vLLM's EngineCore, at `--engine serve` through a `vllm serve` child (installed logic only; a
    recipe with a step the serve client cannot play is not_applicable there, naming it, without starting a
    server). The measured bugs (kvdoctor/data/measured_bugs.toml: K10) count scheduler steps and are taken
    by kvdoctor's harness at every level."""
    engine = (overrides or {}).get("engine") or "scheduler"
    level = runner(engine)
    level.check_ready()
    recipes = builtin_recipes.all_builtins()
    setups = [_audit_setup(recipe, dict(overrides or {}), default_worker) for recipe in recipes]
    refused = [setup for setup in setups if isinstance(setup, UsageError)]
    if len(refused) == len(setups):
        raise refused[0]  # the flags themselves are wrong, for every recipe
    measured = measured_bugs()
    total = len(recipes) + len(measured)
    progress = on_progress or (lambda done, total, what: None)
    progress(0, 0, "importing vLLM")  # no count yet: the recipes have not started
    api = load_vllm()
    if (overrides or {}).get("spec_name"):
        check_spec_name(api, recipes[0], next(s for s in setups if isinstance(s, Setup)), overrides or {})
    report = AuditReport(vllm_version=api.version_text, command=command, engine=engine)
    for done, (recipe, setup) in enumerate(zip(recipes, setups)):
        progress(done, total, f"{recipe.bug or '-'} {recipe.name}")
        if isinstance(setup, UsageError):  # this recipe's needs exceed the user's settings; the rest run
            own = resolve_setup(recipe, {"worker": "simulated", "engine": engine})
            installed, fixed = (RunResult(logic, Outcome.UNTESTED, detail=str(setup)) for logic in ("installed", "fixed"))
            report.rows.append(AuditRow(recipe.bug or "-", recipe, own, installed, fixed, _fixed_in(recipe)))
            continue
        report.rows.append(level.audit_row(api, recipe, setup, _fixed_in(recipe)))
    report.rows.sort(key=lambda row: (bug_order(row.bug), row.recipe.name))
    for done, bug in enumerate(measured, len(recipes)):
        progress(done, total, f"{bug.bug} {bug.doing}")
        try:
            report.metrics.append(MetricRow(bug.bug, bug.title, bug.refs, take_measurement(bug, api), level=engine))
        except MeasurementIncomplete as exc:
            report.metrics.append(MetricRow(bug.bug, bug.title, bug.refs, None, error=str(exc), level=engine))
    return report


def _audit_setup(recipe: Recipe, overrides: dict[str, Any], default_worker: str | None) -> Setup | UsageError:
    """A recipe's setup at the user's flags, or why it cannot run there (audit makes that row untested).
    A recipe with its own KV layout keeps it: --model is for the others."""
    if recipe.setup.get("layout"):
        overrides.pop("model", None)
    try:
        return resolve_setup(recipe, overrides, worker_fallback=True, default_worker=default_worker)
    except UsageError as exc:
        return exc


def _fixed_in(recipe: Recipe) -> FixedIn | None:
    """The first release where kvdoctor measured a built-in recipe stop reproducing, if any."""
    return fixed_in(recipe.name) if recipe.builtin else None


