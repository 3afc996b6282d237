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
    if outcome in ("not_reached", "untested"):
        return ExitStatus.INCONCLUSIVE
    return ExitStatus.SETUP_OR_OTHER_FAILURE


def exit_code_for_many(outcomes: Iterable[str]) -> ExitStatus:
    """Several rows (audit, matrix): 1 when any reproduced; else 4 when any ended other_failure or
    setup_error; else 6 when any did not test its bug (not_reached, untested); 0 only when every row is
    not_reproduced / not_applicable."""
    codes = {exit_code_for(o) for o in outcomes}
    for status in (ExitStatus.REPRODUCED, ExitStatus.SETUP_OR_OTHER_FAILURE, ExitStatus.INCONCLUSIVE):
        if status in codes:
            return status
    return ExitStatus.NOT_REPRODUCED
