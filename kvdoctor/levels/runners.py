"""The one table that chooses where a recipe is played: `--engine` names a level, the level does the
rest. The application functions (`app`) ask a level for what they need and never branch on its name.

Each level also has its row in `table.LEVEL_TABLE` (the needs it meets; pure data the CLI reads
without importing this module)."""

from __future__ import annotations

from typing import Protocol

from kvdoctor.engine.compat import VllmApi
from kvdoctor.engine.overrides import Overrides
from kvdoctor.engine.setup import Setup
from kvdoctor.errors import InternalError
from kvdoctor.levels.core import CORE
from kvdoctor.levels.in_process import Progress
from kvdoctor.levels.scheduler import SCHEDULER
from kvdoctor.levels.serve import SERVE
from kvdoctor.matrix.known import FixedIn
from kvdoctor.recipes.model import Recipe
from kvdoctor.results import AuditRow, ReproReport


class LevelRunner(Protocol):
    """What a level offers the application functions."""

    name: str

    def check_logic(self, logic: str) -> None:
        """A usage error (exit 2, before vLLM is imported) for a logic variant this level cannot play."""

    def check_ready(self) -> None:
        """A usage error (exit 2, before vLLM is imported) where this level cannot start here."""

    def repro(self, recipe: Recipe, setup: Setup, variants: list[str], *, overrides: Overrides, command: str,
              fixed_in: FixedIn | None, record_timeline: bool, progress: Progress) -> ReproReport:
        """`kvdoctor repro`/`inspect`: the recipe under each logic variant this level plays."""
        ...

    def audit_row(self, api: VllmApi, recipe: Recipe, setup: Setup, fixed_in: FixedIn | None) -> AuditRow:
        """`kvdoctor audit`'s row for one recipe: the installed and the fixed logic."""
        ...

    def audit_rows(self, api: VllmApi, jobs: list[tuple[Recipe, Setup, FixedIn | None]],
                   progress: Progress) -> list[AuditRow]:
        """`kvdoctor audit`'s rows for these recipes, in their order (the serve level starts their servers at
        once); `progress(done, total, what runs now)` as the level goes."""
        ...


RUNNERS: dict[str, LevelRunner] = {level.name: level for level in (SCHEDULER, CORE, SERVE)}


def runner(name: str) -> LevelRunner:
    try:
        return RUNNERS[name]
    except KeyError:
        raise InternalError(f"unknown engine level {name!r}") from None
