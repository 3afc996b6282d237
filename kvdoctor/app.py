"""Application functions: one per command, free of Typer and of formatting.

Each resolves its inputs, loads vLLM once, runs scenarios and returns plain
data for `kvdoctor.report` to render.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass, field
from typing import Any

from kvdoctor import __version__
from kvdoctor.engine.setup import Setup
from kvdoctor.errors import UsageError
from kvdoctor.logic.variants import expand_logic
from kvdoctor.recipes.model import Recipe

SCHEMA_VERSION = 1


@dataclass
class ReproReport:
    recipe: Recipe
    setup: Setup
    vllm_version: str
    results: list[Any] = field(default_factory=list)  # RunResult
    command: str = ""

    @property
    def decisive(self) -> Any:
        """The result whose outcome sets the exit code: installed logic when it ran."""
        for result in self.results:
            if result.logic == "installed":
                return result
        return self.results[0]


def resolve_setup(recipe: Recipe, overrides: dict[str, Any]) -> Setup:
    """Recipe defaults, then the user's flags; validated before vLLM is imported."""
    from kvdoctor.engine.setup import resolve_blocks_per_chunk

    base = dict(recipe.setup)
    extra = dict(base.pop("extra_connector_config", {}))
    try:
        setup = Setup(**base, extra_connector_config=extra)
    except TypeError as exc:
        raise UsageError(f"{recipe.source}: bad [setup]: {exc}") from None
    overrides = dict(overrides)
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
    return setup


def load_vllm() -> Any:
    from kvdoctor.engine import compat

    return compat.load()


def repro(recipe_ref: str, overrides: dict[str, Any], logic: str, record_timeline: bool = False,
          command: str = "") -> ReproReport:
    from kvdoctor.recipes.builtins import resolve

    recipe = resolve(recipe_ref)
    variants = expand_logic(logic)
    setup = resolve_setup(recipe, overrides)
    from kvdoctor.recipes.geometry import check as check_geometry

    check_geometry(recipe, setup)  # what vLLM would refuse (a prompt longer than max_model_len): exit 2 now
    api = load_vllm()
    from kvdoctor.scenario import run_scenario

    report = ReproReport(recipe=recipe, setup=setup, vllm_version=api.version_text, command=command)
    for variant in variants:
        report.results.append(run_scenario(api, recipe, setup, variant, record_timeline=record_timeline))
    return report


def export(recipe_ref: str, overrides: dict[str, Any], path: Any) -> None:
    """Write the recipe as a standalone script (no vLLM import here)."""
    from kvdoctor.export.script import export_script
    from kvdoctor.recipes.builtins import resolve

    recipe = resolve(recipe_ref)
    text = export_script(recipe, resolve_setup(recipe, overrides))
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

    @property
    def hint(self) -> str:
        outcome = self.installed.outcome.value
        if outcome == "reproduced":
            if self.fixed.outcome.value == "not_reproduced":
                return "fixed logic (PR #49146 cap) prevents it"
            return "fixed logic does not prevent it: needs its own upstream fix"
        if outcome == "not_reproduced":
            return "; ".join(self.installed.guards) or "this vLLM handles the trigger"
        return self.installed.detail


@dataclass
class MetricRow:
    """A performance bug, reported as a measured number against a baseline."""

    bug: str
    title: str
    refs: tuple[str, ...]
    value: Any  # e.g. PrefixSharingMetric

    @property
    def summary(self) -> str:
        m = self.value
        return (f"{m.requests} requests sharing an offloaded prefix (loads take {m.load_latency_steps} steps): "
                f"{m.shared_steps} steps until all have a first token, vs {m.baseline_steps} with disjoint "
                f"prefixes ({m.extra_steps:+d})")


@dataclass
class AuditReport:
    vllm_version: str
    rows: list[AuditRow] = field(default_factory=list)
    metrics: list[MetricRow] = field(default_factory=list)
    command: str = ""

    @property
    def any_reproduced(self) -> bool:
        return any(row.installed.outcome.value == "reproduced" for row in self.rows)


def audit(command: str = "") -> AuditReport:
    """Every built-in recipe against the installed vLLM: one vLLM import, one process."""
    from kvdoctor.recipes.builtins import all_builtins
    from kvdoctor.scenario import run_scenario

    recipes = all_builtins()
    setups = [resolve_setup(recipe, {}) for recipe in recipes]
    api = load_vllm()
    report = AuditReport(vllm_version=api.version_text, command=command)
    for recipe, setup in zip(recipes, setups):
        installed = run_scenario(api, recipe, setup, "installed", record_timeline=True)
        fixed = run_scenario(api, recipe, setup, "fixed")
        report.rows.append(AuditRow(recipe.bug or "-", recipe, setup, installed, fixed))
    report.rows.sort(key=lambda row: (_bug_order(row.bug), row.recipe.name))
    from kvdoctor.observe.metrics import measure_prefix_sharing

    report.metrics.append(MetricRow(
        "K10", "Concurrent loads of one prefix serialise: overlapping requests wait for the first load",
        ("vllm#44294 (issue)",), measure_prefix_sharing(api)))
    return report


def _bug_order(bug: str) -> tuple[int, str]:
    digits = "".join(ch for ch in bug if ch.isdigit())
    return (int(digits) if digits else 10_000, bug)
