"""The release-outcomes data file: kvdoctor's own measurements, one row per release x recipe.

Written only from real runs (`kvdoctor matrix --audit --write-data FILE`), reviewed like
code, and checked by tests/test_release_outcomes.py against `kvdoctor audit --json` on the
release installed; `kvdoctor.matrix.known` reads it for the hints in `repro` and `audit`, and
the test suite reads every per-release expectation from it (tests/recipe_runs.measured).
"""

from __future__ import annotations

import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from kvdoctor.errors import UsageError
from kvdoctor.recipes.writer import toml_string
from kvdoctor.releases import KNOWN_RELEASES

DATA_FILE = Path(__file__).resolve().parent.parent / "data" / "release_outcomes.toml"
DATA_SCHEMA_VERSION = 1
HEADER = """\
# vLLM release x built-in recipe -> outcome under vLLM's installed logic, as kvdoctor measured it.
# Written by `kvdoctor matrix --audit --write-data kvdoctor/data/release_outcomes.toml` from real
# runs; never edit by hand: re-measure. tests/test_release_outcomes.py fails when a release's
# `kvdoctor audit --json` disagrees with its rows (outcome, the failure site when reproduced, and
# whether the run reached the recipe's crash site: `coverage`). A release counts as fixed only where
# the site was reached and held, or is gone from that release's source. Optional keys, from the same
# measurement (absent = not measured): `fixed_logic_outcome` (kvdoctor's fixed logic, run beside the
# installed one), `async_outcome` and `async_fixed_logic_outcome` (`kvdoctor audit --async-scheduling`),
# `reason_outcomes` (each measured reason the recipe gives, `recipes.geometry.MEASURED_REASONS`: the outcome
# of the run at the value that breaks it, as the run showed it; sync_scheduling's is the async audit's run).
"""


@dataclass(frozen=True)
class OutcomeRow:
    release: str
    recipe: str
    bug: str
    outcome: str
    failure_site: str | None
    measured_on: str  # YYYY-MM-DD
    kvdoctor_version: str
    # The crash site's coverage line: "reached 2x: held (...)", "not reached: ...", "site gone: ...";
    # None for rows measured before kvdoctor counted it (they earn no "fixed").
    coverage: str | None = None
    # Further dimensions of the same measurement, each None where not measured (older rows, or a run
    # that broke): the outcome under kvdoctor's fixed logic (the PR #49146 cap; the audit runs it
    # beside the installed one), and both outcomes again under the user's --async-scheduling (a
    # second audit of the release, `kvdoctor audit --async-scheduling`).
    fixed_logic_outcome: str | None = None
    async_outcome: str | None = None
    async_fixed_logic_outcome: str | None = None
    # requirement -> the outcome measured at the value that breaks it (matrix/reasons.py); None: not measured
    reason_outcomes: dict[str, str] | None = None

    def outcome_for(self, logic: str = "installed", async_scheduling: bool = False) -> str | None:
        """The measured outcome under `logic` ("installed" | "fixed") and scheduling mode; None: not
        measured (a reader skips, never guesses)."""
        key = {("installed", False): "outcome", ("fixed", False): "fixed_logic_outcome",
               ("installed", True): "async_outcome", ("fixed", True): "async_fixed_logic_outcome"}.get(
            (logic, bool(async_scheduling)))
        return getattr(self, key) if key else None

    @property
    def coverage_class(self) -> str | None:
        return coverage_class(self.coverage)

    @property
    def earns_fixed(self) -> bool:
        """This row is evidence that the bug is gone on its release: the run reached the crash site and
        it held, or the site no longer exists; `not_applicable` (the release lacks what the trigger
        needs) as before."""
        if self.outcome == "not_applicable":
            return True
        return self.outcome == "not_reproduced" and self.coverage_class in ("held", "gone")


# Optional keys of a row (absent = not measured); a reader of schema 1 ignores them.
OPTIONAL_OUTCOMES = ("fixed_logic_outcome", "async_outcome", "async_fixed_logic_outcome")


def coverage_class(line: str | None) -> str | None:
    """"held" | "fired" | "not_reached" | "gone" | None, from a coverage line."""
    if not line:
        return None
    if line.startswith("site gone"):
        return "gone"
    if line.startswith("not reached"):
        return "not_reached"
    if line.startswith("reached"):
        return "fired" if ": fired" in line else "held"
    return None


def load(path: Path = DATA_FILE) -> list[OutcomeRow]:
    if not path.is_file():
        return []
    try:
        data = tomllib.loads(path.read_text())
        return [OutcomeRow(release=r["release"], recipe=r["recipe"], bug=r.get("bug", "-"), outcome=r["outcome"],
                           failure_site=r.get("failure_site"), measured_on=r["measured_on"],
                           kvdoctor_version=r["kvdoctor_version"], coverage=r.get("coverage"),
                           **{key: r.get(key) for key in OPTIONAL_OUTCOMES},
                           reason_outcomes=_reason_outcomes(r.get("reason_outcomes")))
                for r in data.get("outcome", [])]
    except (tomllib.TOMLDecodeError, KeyError, TypeError) as exc:
        raise UsageError(f"{path}: not a release-outcomes file ({type(exc).__name__}: {exc})") from None


def _reason_outcomes(value: object) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise TypeError(f"reason_outcomes must be a table of strings, got {value!r}")
    return dict(value)


def _order(row: OutcomeRow) -> tuple[int, str]:
    index = KNOWN_RELEASES.index(row.release) if row.release in KNOWN_RELEASES else len(KNOWN_RELEASES)
    return index, row.recipe


def render(rows: Iterable[OutcomeRow]) -> str:
    lines = [HEADER, f"schema_version = {DATA_SCHEMA_VERSION}", ""]
    for row in sorted(rows, key=_order):
        lines.append("[[outcome]]")
        for key in ("release", "recipe", "bug", "outcome", "failure_site", "coverage", *OPTIONAL_OUTCOMES,
                    "measured_on", "kvdoctor_version"):
            value = getattr(row, key)
            if value is not None:
                lines.append(f"{key} = {toml_string(value)}")
        if row.reason_outcomes:
            table = ", ".join(f"{name} = {toml_string(value)}" for name, value in sorted(row.reason_outcomes.items()))
            lines.append(f"reason_outcomes = {{ {table} }}")
        lines.append("")
    return "\n".join(lines)


def merge(old: Iterable[OutcomeRow], new: Iterable[OutcomeRow],
          recipes: Iterable[str] | None = None) -> list[OutcomeRow]:
    """The new measurements replace every old row of the releases they cover (of those releases' `recipes`
    only, where given: an audit limited to named recipes leaves the other rows as they were)."""
    new = list(new)
    remeasured = {row.release for row in new}
    limit = None if recipes is None else set(recipes)
    return [row for row in old
            if row.release not in remeasured or (limit is not None and row.recipe not in limit)] + new
