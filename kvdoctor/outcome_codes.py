"""Which exit status an outcome earns: the one mapping, shared by every command.

repro, inspect, audit, matrix and diagnose all ask here; nothing else turns an
outcome into an exit code. Outcomes are `Outcome` members (a plain string with an
Outcome's value is taken as that member). `kvdoctor.observe.verdict` is imported
when a code is asked for, so the CLI still starts without it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvdoctor.errors import ExitStatus
from kvdoctor.observe.verdict import Outcome


def exit_code_for(outcome: Any) -> ExitStatus:
    """One run's outcome (an `Outcome`, its string, or a run result with `.outcome`): reproduced 1;
    not reproduced / not applicable to this vLLM 0; not reached / untested 6 (the run did not test the
    bug), and so is a result not applicable only because its engine level cannot play a step or the
    setup (`unplayable`: `--engine core` cannot withhold block hashes; the bug may well be there);
    setup_error, other_failure and anything that is no outcome at all (a matrix cell whose environment
    or kvdoctor child broke) 4."""
    unplayable = bool(getattr(outcome, "unplayable", False))
    outcome = getattr(outcome, "outcome", outcome)
    try:
        member = Outcome(outcome)
    except ValueError:
        return ExitStatus.SETUP_OR_OTHER_FAILURE
    if member is Outcome.REPRODUCED:
        return ExitStatus.REPRODUCED
    if member is Outcome.NOT_APPLICABLE and unplayable:
        return ExitStatus.INCONCLUSIVE
    if member in (Outcome.NOT_REPRODUCED, Outcome.NOT_APPLICABLE):
        return ExitStatus.NOT_REPRODUCED
    if member in (Outcome.NOT_REACHED, Outcome.UNTESTED):
        return ExitStatus.INCONCLUSIVE
    return ExitStatus.SETUP_OR_OTHER_FAILURE


def exit_code_for_many(outcomes: Iterable[Any]) -> ExitStatus:
    """Several rows (audit, matrix): 1 when any reproduced; else 4 when any ended other_failure or
    setup_error (or broke); else 6 when any did not test its bug (not_reached, untested, unplayable at its
    level); 0 only when every row is not_reproduced / not_applicable (and when there is no row)."""
    codes = {exit_code_for(o) for o in outcomes}
    for status in (ExitStatus.REPRODUCED, ExitStatus.SETUP_OR_OTHER_FAILURE, ExitStatus.INCONCLUSIVE):
        if status in codes:
            return status
    return ExitStatus.NOT_REPRODUCED
