"""Application functions: one per command, free of Typer and of formatting.

Each resolves its inputs, loads vLLM once, runs scenarios and returns plain
data for `kvdoctor.report` to render.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass, field
from typing import Any, Callable

from kvdoctor import __version__
from kvdoctor.engine.setup import Setup
from kvdoctor.errors import UsageError
from kvdoctor.logic.variants import expand_logic
from kvdoctor.recipes.model import Recipe, bug_order


@dataclass
class ReproReport:
    recipe: Recipe
    setup: Setup
    vllm_version: str
    results: list[Any] = field(default_factory=list)  # RunResult
    command: str = ""
    # From kvdoctor's release measurements (kvdoctor.matrix.known), shown as a hint, never the verdict.
    fixed_in: Any = None  # FixedIn | None

    @property
    def kv_plan(self) -> Any:
        """The KV cache groups vLLM's planner built (every variant builds the same); None if none ran."""
        return next((r.kv_plan for r in self.results if r.kv_plan is not None), None)

    @property
    def decisive(self) -> Any:
        """The result whose outcome sets the exit code: installed logic when it ran."""
        for result in self.results:
            if result.logic == "installed":
                return result
        return self.results[0]


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
    from kvdoctor.engine.setup import resolve_blocks_per_chunk

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
        import dataclasses

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
    from kvdoctor.recipes.geometry import plan_setup

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
    import dataclasses

    import torch

    has_cuda = bool(torch.cuda.is_available())
    if setup.device == "cuda" and not has_cuda:
        raise UsageError("--device cuda: torch sees no CUDA GPU on this machine (use --device cpu)")
    from kvdoctor.steps import Need, kinds_needing

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


def with_model_runner(setup: Setup, results: list[Any]) -> Setup:
    """The setup as it ran: the model runner the harness resolved (the same for every variant)."""
    import dataclasses

    runner = next((r.model_runner for r in results if getattr(r, "model_runner", "")), None)
    return dataclasses.replace(setup, model_runner=runner) if runner else setup


def load_vllm() -> Any:
    from kvdoctor.engine import compat

    return compat.load()


def repro(recipe_ref: str, overrides: dict[str, Any], logic: str, record_timeline: bool = False,
          command: str = "", default_worker: str | None = None,
          on_progress: Callable[[int, int, str], None] | None = None) -> ReproReport:
    """`on_progress(done, total, what runs now)` is called before the import and each logic variant."""
    from kvdoctor.recipes.builtins import resolve

    recipe = resolve(recipe_ref)
    variants = expand_logic(logic)
    setup = resolve_setup(recipe, overrides, default_worker=default_worker)
    from kvdoctor.recipes.geometry import check as check_geometry

    check_geometry(recipe, setup)  # what vLLM would refuse (a prompt longer than max_model_len): exit 2 now
    if setup.engine == "serve":
        if logic not in ("all", "installed"):
            raise UsageError(f"--logic {logic}: the served engine runs the installed vLLM unpatched (--engine serve "
                             f"runs --logic installed only)")
        from kvdoctor.engine.core.serve import repro_serve

        return repro_serve(recipe, setup, command=command, fixed_in=_fixed_in(recipe))
    progress = on_progress or (lambda done, total, what: None)
    progress(0, 0, "importing vLLM")
    api = load_vllm()
    check_spec_name(api, recipe, setup, overrides)
    run_scenario = _scenario_runner(setup.engine)
    report = ReproReport(recipe=recipe, setup=setup, vllm_version=api.version_text, command=command,
                         fixed_in=_fixed_in(recipe))
    for done, variant in enumerate(variants):
        progress(done, len(variants), f"{recipe.name} under the {variant} logic")
        report.results.append(run_scenario(api, recipe, setup, variant, record_timeline=record_timeline))
    report.setup = with_model_runner(setup, report.results)
    return report


def export(recipe_ref: str, overrides: dict[str, Any], path: Any, default_worker: str | None = None) -> None:
    """Write the recipe as a standalone script (no vLLM import here): the scheduler level's, or with
    `--engine serve` one that starts `vllm serve` with its two stand-ins and plays the recipe's clients."""
    from kvdoctor.export.script import export_script, export_serve_script
    from kvdoctor.recipes.builtins import resolve

    recipe = resolve(recipe_ref)
    setup = resolve_setup(recipe, overrides, default_worker=default_worker)
    if setup.engine == "core":
        raise UsageError("--export-script writes a scheduler-level script, or with --engine serve a `vllm serve` "
                         "one; --engine core has no exported form")
    text = (export_serve_script if setup.engine == "serve" else export_script)(recipe, setup)
    try:
        path.write_text(text)
    except OSError as exc:
        raise UsageError(f"--export-script {path}: {exc.strerror}") from None


def environment() -> dict[str, Any]:
    """What a bug report needs about this machine: no paths, no secrets."""
    from importlib import metadata

    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    return {
        "kvdoctor": __version__,
        "vllm": version("vllm"),
        "torch": version("torch"),
        "python": platform.python_version(),
        "os": f"{platform.system()} {platform.release()} ({platform.machine()})",
    }


@dataclass
class AuditRow:
    bug: str
    recipe: Recipe
    setup: Setup
    installed: Any  # RunResult
    fixed: Any  # RunResult
    fixed_in: Any = None  # FixedIn | None: measured on other releases, never the verdict
    server_log: str = ""  # --engine serve: the server's own log


@dataclass
class MetricRow:
    """A performance bug, reported as a measured number against a baseline."""

    bug: str
    title: str
    refs: tuple[str, ...]
    value: Any  # e.g. PrefixSharingMetric; None when the measurement did not complete
    error: str | None = None  # why it did not complete (the row then counts as other_failure)
    level: str = "scheduler"  # the audit's engine level; K10 is always measured by kvdoctor's harness

    @property
    def outcome(self) -> str:
        return "other_failure" if self.error else "measured"


@dataclass
class AuditReport:
    vllm_version: str
    rows: list[AuditRow] = field(default_factory=list)
    metrics: list[MetricRow] = field(default_factory=list)
    command: str = ""
    engine: str = "scheduler"  # the engine level every row ran at (kvdoctor/engine/core/levels.py)

    @property
    def any_reproduced(self) -> bool:
        return any(row.installed.outcome.value == "reproduced" for row in self.rows)

    @property
    def reproducing(self) -> dict[str, list[str]]:
        """Bug id -> its recipes that reproduce under the installed logic (catalogue order)."""
        found: dict[str, list[str]] = {}
        for row in self.rows:
            if row.installed.outcome.value == "reproduced":
                found.setdefault(row.bug, []).append(row.recipe.name)
        return found

    @property
    def upgrade_hint(self) -> Any:
        """The measured release that fixes the most of what reproduces here (a hint, not a verdict)."""
        from kvdoctor.matrix.known import upgrade_hint

        return upgrade_hint(self.reproducing, self.vllm_version)

    @property
    def exit_status(self) -> int:
        """1 when any known bug reproduces; else 4 when any row (or a metric) ended other_failure or
        setup_error; 0 only when every row is not_reproduced / not_applicable."""
        from kvdoctor.observe.verdict import Outcome
        from kvdoctor.outcome_codes import exit_code_for_many

        outcomes = [row.installed.outcome for row in self.rows]
        outcomes += [Outcome.OTHER_FAILURE for metric in self.metrics if metric.error]
        return exit_code_for_many(outcomes)


def audit(command: str = "", overrides: dict[str, Any] | None = None,
          default_worker: str | None = None,
          on_progress: Callable[[int, int, str], None] | None = None) -> AuditReport:
    """Every built-in recipe against the installed vLLM: one vLLM import, one process.
    `on_progress(done, total, what runs now)` is called before each piece of work.

    At `--engine core` each recipe runs through vLLM's EngineCore (`run_core_scenario`), at
    `--engine serve` through a `vllm serve` child (installed logic only; a recipe with a step the
    serve client cannot play is not_applicable there, naming it, without starting a server). The K10
    measurement counts scheduler steps and is taken by kvdoctor's harness at every level."""
    from kvdoctor.recipes.builtins import all_builtins

    engine = (overrides or {}).get("engine") or "scheduler"
    if engine == "serve":
        from kvdoctor.engine.core.serve import check_plugin

        check_plugin()  # before vLLM is imported: one line, exit 2
    run_scenario = _scenario_runner(engine)
    recipes = all_builtins()
    setups = [_audit_setup(recipe, dict(overrides or {}), default_worker) for recipe in recipes]
    refused = [setup for setup in setups if isinstance(setup, UsageError)]
    if len(refused) == len(setups):
        raise refused[0]  # the flags themselves are wrong, for every recipe
    total = len(recipes) + 1  # and the K10 measurement
    progress = on_progress or (lambda done, total, what: None)
    progress(0, 0, "importing vLLM")  # no count yet: the recipes have not started
    api = load_vllm()
    if (overrides or {}).get("spec_name"):
        check_spec_name(api, recipes[0], next(s for s in setups if not isinstance(s, UsageError)), overrides or {})
    report = AuditReport(vllm_version=api.version_text, command=command, engine=engine)
    for done, (recipe, setup) in enumerate(zip(recipes, setups)):
        progress(done, total, f"{recipe.bug or '-'} {recipe.name}")
        if isinstance(setup, UsageError):  # this recipe's needs exceed the user's settings; the rest run
            from kvdoctor.observe.verdict import Outcome
            from kvdoctor.scenario import RunResult

            own = resolve_setup(recipe, {"worker": "simulated", "engine": engine})
            installed, fixed = (RunResult(logic, Outcome.UNTESTED, detail=str(setup)) for logic in ("installed", "fixed"))
            report.rows.append(AuditRow(recipe.bug or "-", recipe, own, installed, fixed, _fixed_in(recipe)))
            continue
        if engine == "serve":
            report.rows.append(_serve_row(recipe, setup))
            continue
        installed = run_scenario(api, recipe, setup, "installed", record_timeline=True)
        fixed = run_scenario(api, recipe, setup, "fixed")
        report.rows.append(AuditRow(recipe.bug or "-", recipe, with_model_runner(setup, [installed]),
                                    installed, fixed, _fixed_in(recipe)))
    report.rows.sort(key=lambda row: (bug_order(row.bug), row.recipe.name))
    from kvdoctor.observe.metrics import MeasurementIncomplete, measure_prefix_sharing

    title = "Concurrent loads of one prefix serialise: overlapping requests wait for the first load"
    progress(len(recipes), total, "K10 measuring concurrent prefix loads")
    try:
        report.metrics.append(MetricRow("K10", title, ("vllm#44294 (issue)",), measure_prefix_sharing(api),
                                        level=engine))
    except MeasurementIncomplete as exc:
        report.metrics.append(MetricRow("K10", title, ("vllm#44294 (issue)",), None, error=str(exc), level=engine))
    return report


def _scenario_runner(engine: str) -> Callable[..., Any]:
    """The scenario run of an engine level (serve has none in-process: `_serve_row`); a run played past a
    measured reason the user's flags break is judged with kvdoctor's measurement (matrix/reasons.py)."""
    from kvdoctor.matrix.reasons import judge_waived

    if engine == "core":
        from kvdoctor.engine.core.runner import run_core_scenario as run
    else:
        from kvdoctor.scenario import run_scenario as run

    def judged(api: Any, recipe: Recipe, setup: Setup, logic: str, **kwargs: Any) -> Any:
        return judge_waived(run(api, recipe, setup, logic, **kwargs), setup, recipe.name, api.version_text)

    return judged


def _serve_row(recipe: Recipe, setup: Setup) -> AuditRow:
    """One recipe through a `vllm serve` child; the fixed logic cannot be played there."""
    from kvdoctor.engine.core.serve import UNPATCHED, run_serve, serve_setup
    from kvdoctor.observe.verdict import Outcome
    from kvdoctor.scenario import RunResult

    setup = serve_setup(setup)
    installed, log_text = run_serve(recipe, setup)
    fixed = RunResult("fixed", Outcome.NOT_APPLICABLE, detail=UNPATCHED)
    return AuditRow(recipe.bug or "-", recipe, setup, installed, fixed, _fixed_in(recipe), server_log=log_text)


def check_spec_name(api: Any, recipe: Recipe, setup: Setup, overrides: dict[str, Any]) -> None:
    """A spec_name this vLLM does not register is a usage error naming where it was given (the flag, or the
    recipe file's line); a recipe that requires the spec (`spec:<name>`) is not applicable instead."""
    name = setup.spec_name
    if not name or f"spec:{name}" in recipe.requires or api.has_offloading_spec(name):
        return
    if overrides.get("spec_name"):
        where = "--kv-transfer-config: kv_connector_extra_config.spec_name"
    else:
        line = next((i for i, text in enumerate(open(recipe.source).read().splitlines(), 1)
                     if text.strip().startswith("spec_name")), 0) if recipe.source else 0
        where = f"{recipe.source}:{line}: spec_name"
    raise UsageError(f"{where} {name!r}: this vLLM registers no offloading spec of that name")


def _audit_setup(recipe: Recipe, overrides: dict[str, Any], default_worker: str | None) -> Setup | UsageError:
    """A recipe's setup at the user's flags, or why it cannot run there (audit makes that row untested).
    A recipe with its own KV layout keeps it: --model is for the others."""
    if recipe.setup.get("layout"):
        overrides.pop("model", None)
    try:
        return resolve_setup(recipe, overrides, worker_fallback=True, default_worker=default_worker)
    except UsageError as exc:
        return exc


def _fixed_in(recipe: Recipe) -> Any:
    """The first release where kvdoctor measured a built-in recipe stop reproducing, if any."""
    if not recipe.builtin:
        return None
    from kvdoctor.matrix.known import fixed_in

    return fixed_in(recipe.name)


