"""Which exit status an outcome earns: the one mapping, shared by every command."""

from __future__ import annotations

from typing import Iterable

from kvdoctor.errors import ExitStatus


def exit_code_for(outcome: str) -> ExitStatus:
    """One run's outcome: reproduced 1; not reproduced / not applicable 0; anything else 4."""
    if outcome == "reproduced":
        return ExitStatus.REPRODUCED
    if outcome in ("not_reproduced", "not_applicable"):
        return ExitStatus.NOT_REPRODUCED
    return ExitStatus.SETUP_OR_OTHER_FAILURE


def exit_code_for_many(outcomes: Iterable[str]) -> ExitStatus:
    """Several rows (audit, matrix): 1 when any reproduced; else 4 when any ended other_failure or
    setup_error; 0 only when every row is not_reproduced / not_applicable."""
    codes = {exit_code_for(o) for o in outcomes}
    if ExitStatus.REPRODUCED in codes:
        return ExitStatus.REPRODUCED
    if ExitStatus.SETUP_OR_OTHER_FAILURE in codes:
        return ExitStatus.SETUP_OR_OTHER_FAILURE
    return ExitStatus.NOT_REPRODUCED
