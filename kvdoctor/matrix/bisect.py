"""First release where a recipe stops reproducing, testing as few releases as it can.

Binary search over the ordered releases, assuming the bug stays fixed once fixed (a
regression inside the range can hide from it; `kvdoctor matrix` without `--bisect` runs
every release). Outcomes come from `probe(release)`, which runs kvdoctor there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

REPRODUCING = "reproduced"
NOT_REPRODUCING = ("not_reproduced", "not_applicable")


@dataclass
class Bisection:
    """The answer for one recipe. `first_not_reproducing` is None when it reproduces on every
    release tested up to the last; `last_reproducing` is None when it reproduces on none.
    `inconclusive` names a release whose outcome was neither (an error, a setup_error)."""

    recipe: str
    first_not_reproducing: str | None = None
    last_reproducing: str | None = None
    tested: dict[str, str] = field(default_factory=dict)  # release -> outcome, in test order
    inconclusive: str | None = None


def bisect_releases(recipe: str, releases: list[str], probe: Callable[[str], str]) -> Bisection:
    """`releases` oldest first; `probe(release)` -> the installed logic's outcome there."""
    result = Bisection(recipe)
    if not releases:
        return result

    def reproduces(index: int) -> bool | None:
        release = releases[index]
        outcome = result.tested.get(release)
        if outcome is None:
            outcome = result.tested[release] = probe(release)
        if outcome == REPRODUCING:
            return True
        if outcome in NOT_REPRODUCING:
            return False
        result.inconclusive = release
        return None

    first = reproduces(0)
    if first is None:
        return result
    if first is False:  # never reproduces in this range
        result.first_not_reproducing = releases[0]
        return result
    last = len(releases) - 1
    if last == 0:
        result.last_reproducing = releases[0]
        return result
    at_end = reproduces(last)
    if at_end is None:
        return result
    if at_end:
        result.last_reproducing = releases[last]
        return result
    lo, hi = 0, last  # invariant: reproduces at lo, not at hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        found = reproduces(mid)
        if found is None:
            return result
        if found:
            lo = mid
        else:
            hi = mid
    result.last_reproducing, result.first_not_reproducing = releases[lo], releases[hi]
    return result
