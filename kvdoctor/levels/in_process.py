"""What the two in-process levels share (`scheduler`, `core`): vLLM imported once in this process,
each logic variant a fresh scenario run, `repro`'s report and `audit`'s row built from those runs."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from kvdoctor.engine import compat
from kvdoctor.engine.compat import VllmApi
from kvdoctor.engine.overrides import Overrides
from kvdoctor.engine.setup import Setup
from kvdoctor.errors import UsageError
from kvdoctor.matrix.known import FixedIn
from kvdoctor.matrix.reasons import judge_waived
from kvdoctor.recipes.model import Recipe
from kvdoctor.results import AuditRow, ReproReport, RunResult

Progress = Callable[[int, int, str], None]  # (done, total, what runs now)


class InProcessLevel:
    """A level that plays the recipe in this process; `run` is the level's scenario run."""

    name: str

    def run(self, api: VllmApi, recipe: Recipe, setup: Setup, logic: str, record_timeline: bool = False) -> RunResult:
        raise NotImplementedError

    def judged_run(self, api: VllmApi, recipe: Recipe, setup: Setup, logic: str,
                   record_timeline: bool = False) -> RunResult:
        """`run`, then judged where the user's flags break one of the recipe's measured reasons
        (`Setup.waived`): the run's own outcome stands unless kvdoctor's measurement on this release
        supports the reason (`matrix.reasons.judge_waived`). What repro and audit report."""
        result = self.run(api, recipe, setup, logic, record_timeline=record_timeline)
        judged: RunResult = judge_waived(result, setup, recipe.name, api.version_text)
        return judged

    def check_logic(self, logic: str) -> None:
        """Every logic variant is played in-process (kvdoctor patches `storable_chunks` in a scope)."""

    def check_ready(self) -> None:
        """Nothing to check before vLLM is imported."""

    def repro(self, recipe: Recipe, setup: Setup, variants: list[str], *, overrides: Overrides, command: str,
              fixed_in: FixedIn | None, record_timeline: bool, progress: Progress) -> ReproReport:
        """`progress(done, total, what runs now)` is called before the import and each logic variant."""
        progress(0, 0, "importing vLLM")
        api = compat.load()
        check_spec_name(api, recipe, setup, overrides)
        report = ReproReport(recipe=recipe, setup=setup, vllm_version=api.version_text, command=command,
                             fixed_in=fixed_in)
        for done, variant in enumerate(variants):
            progress(done, len(variants), f"{recipe.name} under the {variant} logic")
            report.results.append(self.judged_run(api, recipe, setup, variant, record_timeline=record_timeline))
        report.setup = with_model_runner(setup, report.results)
        return report

    def audit_row(self, api: VllmApi, recipe: Recipe, setup: Setup, fixed_in: FixedIn | None) -> AuditRow:
        installed = self.judged_run(api, recipe, setup, "installed", record_timeline=True)
        fixed = self.judged_run(api, recipe, setup, "fixed")
        return AuditRow(recipe.bug or "-", recipe, with_model_runner(setup, [installed]), installed, fixed, fixed_in)

    def audit_rows(self, api: VllmApi, jobs: list[tuple[Recipe, Setup, FixedIn | None]],
                   progress: Progress) -> list[AuditRow]:
        """One recipe after another, in this process."""
        rows = []
        for done, (recipe, setup, fixed_in) in enumerate(jobs):
            progress(done, len(jobs), f"{recipe.bug or '-'} {recipe.name}")
            rows.append(self.audit_row(api, recipe, setup, fixed_in))
        return rows


def with_model_runner(setup: Setup, results: list[RunResult]) -> Setup:
    """The setup as it ran: the model runner the harness resolved (the same for every variant)."""
    runner = next((r.model_runner for r in results if getattr(r, "model_runner", "")), None)
    return dataclasses.replace(setup, model_runner=runner) if runner else setup


def check_spec_name(api: VllmApi, recipe: Recipe, setup: Setup, overrides: Overrides) -> None:
    """A spec_name this vLLM does not register is a usage error naming where it was given (the flag, or the
    recipe file's line); a recipe that requires the spec (`spec:<name>`) is not applicable instead."""
    name = setup.spec_name
    if not name or f"spec:{name}" in recipe.requires or api.has_offloading_spec(name):
        return
    if overrides.spec_name:
        where = "--kv-transfer-config: kv_connector_extra_config.spec_name"
    else:
        line = next((i for i, text in enumerate(Path(recipe.source).read_text().splitlines(), 1)
                     if text.strip().startswith("spec_name")), 0) if recipe.source else 0
        where = f"{recipe.source}:{line}: spec_name"
    raise UsageError(f"{where} {name!r}: this vLLM registers no offloading spec of that name")
