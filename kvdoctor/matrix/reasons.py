"""A recipe's reasons ("the trigger needs synchronous scheduling") as measurements, not sentences.

Where the user's flags break a measured reason (`recipes.geometry.MEASURED_REASONS`), the planner
does not declare the recipe untested: it plays the run at the user's flags (`Setup.waived`), and
the run is what decides. `judge_waived` then lets kvdoctor's own measurement explain it: the reason
sentence is shown, and the outcome is `untested`, only where `matrix --audit --write-data` measured
this release reproducing the bug at the recipe's own flags and not reproducing it at the value that
breaks the reason (`OutcomeRow.reason_outcomes`), and the run here agrees (it did not reproduce).
Everywhere else the run's own outcome stands (reproduced / not_reproduced: reached and held /
not_reached), with a note of what the measurement said; a run whose recipe precondition did not hold
(setup_error) showed the trigger did not come about at those flags: `untested`, saying so.

`alternatives` gives the matrix the runs that measure each reason: the recipe at the value nearest
its own plan that breaks the reason (`recipes.geometry.reason_alternative`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from kvdoctor.matrix import data

# Outcomes a measurement at the breaking value can have that do not contradict "the trigger needs X"
# (the bug's signature did not fire there); reproduced contradicts it, an error measured nothing.
_CONSISTENT = ("not_reproduced", "not_reached", "other_failure", "setup_error", "untested", "not_applicable")


def _release(version_text: str) -> str | None:
    match = re.match(r"(\d+\.\d+\.\d+)", version_text or "")
    return match.group(1) if match else None


def measured_row(recipe_name: str, version_text: str, path: Path | None = None) -> data.OutcomeRow | None:
    release = _release(version_text)
    try:
        rows = data.load(path or data.DATA_FILE)
    except Exception:
        return None
    return next((r for r in rows if r.recipe == recipe_name and r.release == release), None)


def supports(row: data.OutcomeRow | None, requirement: str) -> bool:
    """The measurement on `row`'s release supports "the trigger needs <requirement>": the bug reproduced at
    the recipe's own flags and did not at the value that breaks the requirement."""
    if row is None or row.outcome != "reproduced" or not row.reason_outcomes:
        return False
    return row.reason_outcomes.get(requirement) in _CONSISTENT


def judge_waived(result: Any, setup: Any, recipe_name: str, version_text: str, path: Path | None = None) -> Any:
    """`result` (a scenario.RunResult played at `setup`) judged where `setup.waived` names reasons the user's
    flags break: `untested` with the reasons where the measurement on this release supports every one and
    the run did not reproduce; otherwise the run's outcome, with what the measurement said."""
    if not setup.waived:
        return result
    from kvdoctor.observe.verdict import Outcome

    release = _release(version_text) or version_text
    row = measured_row(recipe_name, version_text, path)
    result.played_outcome = result.outcome
    notes = []
    for requirement, why in setup.waived:
        measured = (row.reason_outcomes or {}).get(requirement) if row is not None else None
        if row is None or measured is None:
            notes.append(f"kvdoctor has not measured on vLLM {release} whether {why}")
        elif supports(row, requirement):
            notes.append(f"{why} (measured on vLLM {release}: {row.outcome} at the recipe's flags, {measured} "
                         f"at the value that breaks it)")
        else:
            notes.append(f"kvdoctor's measurement on vLLM {release} does not support the recipe's reason "
                         f"({row.outcome} at the recipe's flags, {measured} at the value that breaks it): {why}")
    played = f"played at the given flags: {result.outcome.value}" + (f" ({result.detail})" if result.detail else "")
    if result.outcome is not Outcome.REPRODUCED and all(supports(row, r) for r, _ in setup.waived):
        result.outcome = Outcome.UNTESTED
        result.detail = "; ".join(notes) + f"; {played}"
    elif result.outcome is Outcome.SETUP_ERROR:
        # the run itself showed the trigger did not come about at these flags (the recipe's precondition)
        result.outcome = Outcome.UNTESTED
        result.detail = f"{played}: the trigger did not come about at the given flags; " + "; ".join(notes)
    else:
        result.detail = f"{result.detail + '; ' if result.detail else ''}" + "; ".join(notes) + \
            "; so the run at the given flags decides"
    return result


def alternatives(recipe: Any) -> dict[str, list[str]]:
    """requirement -> the command-line flags a measurement of that reason runs the recipe with (no vLLM
    import: the recipe's plan at default flags, and the value nearest it that breaks the requirement)."""
    from kvdoctor.engine.overrides import Overrides
    from kvdoctor.recipes.geometry import measured_reasons, reason_alternative
    from kvdoctor.resolution import resolve_setup

    reasons = measured_reasons(recipe)
    if not reasons:
        return {}
    planned = resolve_setup(recipe, Overrides(worker="simulated"))
    return {requirement: flag_args(reason_alternative(recipe, requirement, planned)) for requirement in reasons}


def flag_args(values: dict[str, Any]) -> list[str]:
    """Setup values as the `kvdoctor repro` flags that set them."""
    from kvdoctor.engine.serve_args import flag_name

    args: list[str] = []
    for name, value in values.items():
        if name == "cpu_bytes_to_use":
            args += ["--kv-transfer-config", json.dumps({"kv_connector": "OffloadingConnector",
                                                         "kv_connector_extra_config": {"cpu_bytes_to_use": value}})]
        elif isinstance(value, bool):
            args.append(flag_name(name, value))
        else:
            args += [flag_name(name), str(value)]
    return args
