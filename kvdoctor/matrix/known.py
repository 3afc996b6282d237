"""What the release-outcomes data says about upgrading: a hint, never a verdict.

The verdict of `repro`/`audit` always comes from running the recipe on the vLLM installed
here; this only adds "on the releases kvdoctor measured, it stops reproducing from X".
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from kvdoctor.matrix import data
from kvdoctor.recipes.model import bug_order
from kvdoctor.releases import KNOWN_RELEASES, release_tuple


class FixedIn(NamedTuple):
    release: str  # first measured release where the recipe no longer reproduces
    last_reproducing: str  # the measured release before it, where it still does
    measured_on: str
    kvdoctor_version: str


def fixed_in(recipe_name: str, path: Path | None = None) -> FixedIn | None:
    """The first measured release after the last one where `recipe_name` reproduces (installed
    logic), when that release earned "fixed" (its run reached the crash site and it held, or the
    site is gone there); None when never measured, never reproducing, reproducing up to the newest
    measured release, or when the next release's run did not reach the site."""
    try:
        rows = [r for r in data.load(path or data.DATA_FILE) if r.recipe == recipe_name and r.release in KNOWN_RELEASES]
    except Exception:
        return None
    rows.sort(key=lambda r: KNOWN_RELEASES.index(r.release))
    last = max((i for i, r in enumerate(rows) if r.outcome == "reproduced"), default=None)
    if last is None:
        return None
    for row in rows[last + 1:]:
        if row.earns_fixed:
            return FixedIn(row.release, rows[last].release, row.measured_on, row.kvdoctor_version)
        return None  # not reached, an error or setup_error right after: no honest answer
    return None


class UpgradeHint(NamedTuple):
    """The measured release to upgrade to: the earliest newer release where the fewest of the
    bugs reproducing here still reproduce (kvdoctor's measurements, a hint like FixedIn)."""

    release: str
    still_reproducing: tuple[str, ...]  # bug ids, catalogue order; () = it fixes all of them
    measured_on: str


def upgrade_hint(reproducing: dict[str, list[str]], installed_version: str,
                 path: Path | None = None) -> UpgradeHint | None:
    """`reproducing` maps a bug id to its recipes that reproduce here. A bug counts as fixed at a
    release only when every one of its recipes was measured there and earned it (reached its crash
    site and held, or the site is gone: `OutcomeRow.earns_fixed`). None when
    no newer release was measured or none fixes any of them."""
    import re

    match = re.match(r"(\d+)\.(\d+)\.(\d+)", installed_version or "")
    if not reproducing or match is None:
        return None
    here = tuple(int(part) for part in match.groups())
    try:
        rows = data.load(path or data.DATA_FILE)
    except Exception:
        return None
    outcomes = {(r.release, r.recipe): r for r in rows}
    best: UpgradeHint | None = None
    for release in KNOWN_RELEASES:
        if release_tuple(release) <= here:
            continue
        measured = [outcomes.get((release, name)) for names in reproducing.values() for name in names]
        if not any(measured):
            continue
        left = tuple(sorted((bug for bug, names in reproducing.items()
                             if any(outcomes.get((release, n)) is None
                                    or not outcomes[(release, n)].earns_fixed for n in names)),
                            key=bug_order))
        if len(left) < len(reproducing) and (best is None or len(left) < len(best.still_reproducing)):
            best = UpgradeHint(release, left, max(r.measured_on for r in measured if r is not None))
    return best
