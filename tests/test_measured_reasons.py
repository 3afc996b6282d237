"""A recipe's "the trigger needs X" is a measurement, not a sentence (kvdoctor/matrix/reasons.py).

Where the user's flags break a measured reason the planner plays the run (Setup.waived) instead of declaring
it untested; the reason is shown, and the outcome is `untested`, only where the release table measured the
bug reproducing at the recipe's flags and not at the value that breaks the reason. No vLLM needed here: the
runs against real vLLM are tests/test_release_outcomes.py's (each measured reason re-run on the installed
release) and test_honest_verdicts.py's.
"""

from __future__ import annotations

import dataclasses

import pytest

from kvdoctor.engine.overrides import Overrides
from kvdoctor.matrix import data
from kvdoctor.matrix.reasons import alternatives, judge_waived, supports
from kvdoctor.observe.verdict import Outcome
from kvdoctor.recipes.builtins import all_builtins, resolve
from kvdoctor.recipes.geometry import MEASURED_REASONS, measured_reasons
from kvdoctor.resolution import resolve_setup
from kvdoctor.results import RunResult

K11 = "readmitted-stale-store-cursor"  # a built-in whose trigger needs synchronous scheduling


def _row(outcome: str, reasons: dict[str, str] | None, release: str = "0.26.0") -> data.OutcomeRow:
    return data.OutcomeRow(release=release, recipe=K11, bug="K11", outcome=outcome,
                           failure_site=None, measured_on="2026-12-05", kvdoctor_version="0.1.0",
                           reason_outcomes=reasons)


def _table(tmp_path, *rows: data.OutcomeRow):
    path = tmp_path / "outcomes.toml"
    path.write_text(data.render(rows))
    return path


def _async_setup():
    return resolve_setup(resolve(K11), Overrides(async_scheduling=True, worker="simulated"))


def test_a_broken_measured_reason_is_played_not_declared_untested():
    setup = _async_setup()
    assert setup.untested is None
    assert [name for name, _ in setup.waived] == ["sync_scheduling"]
    assert "--async-scheduling prevents it" in setup.waived[0][1]


def test_a_planning_limit_stays_untested():
    """own_geometry is kvdoctor's (its script is not restated), not a claim about vLLM: still untested."""
    setup = resolve_setup(resolve("offload-keys-lag-blocks"), Overrides(block_size=32, worker="simulated"))
    assert setup.untested and "scripted for its own geometry" in setup.untested
    assert setup.waived == ()


def test_the_reason_explains_only_where_measured(tmp_path):
    setup = _async_setup()
    supported = _table(tmp_path, _row("reproduced", {"sync_scheduling": "not_reproduced"}))
    result = judge_waived(RunResult("installed", Outcome.NOT_REPRODUCED), setup, K11,
                          "0.26.0", supported)
    assert result.outcome is Outcome.UNTESTED and result.played_outcome is Outcome.NOT_REPRODUCED
    assert "needs synchronous scheduling" in result.detail and "measured on vLLM 0.26.0" in result.detail


@pytest.mark.parametrize("reasons, outcome", [(None, "reproduced"), ({"sync_scheduling": "reproduced"}, "reproduced"),
                                              ({"sync_scheduling": "not_reproduced"}, "not_reproduced")])
def test_without_a_supporting_measurement_the_run_decides(tmp_path, reasons, outcome):
    """Unmeasured, contradicted (reproduced at the breaking value), or a release where the bug is gone at the
    recipe's flags: the played outcome stands (here: reached and held, not_reproduced)."""
    path = _table(tmp_path, _row(outcome, reasons))
    result = judge_waived(RunResult("installed", Outcome.NOT_REPRODUCED), _async_setup(),
                          K11, "0.26.0", path)
    assert result.outcome is Outcome.NOT_REPRODUCED
    assert "the run at the given flags decides" in result.detail


def test_a_reproduction_at_the_users_flags_is_never_relabelled(tmp_path):
    path = _table(tmp_path, _row("reproduced", {"sync_scheduling": "not_reproduced"}))
    result = judge_waived(RunResult("installed", Outcome.REPRODUCED), _async_setup(), K11,
                          "0.26.0", path)
    assert result.outcome is Outcome.REPRODUCED


def test_another_release_is_not_evidence(tmp_path):
    path = _table(tmp_path, _row("reproduced", {"sync_scheduling": "not_reproduced"}, release="0.27.0"))
    result = judge_waived(RunResult("installed", Outcome.NOT_REPRODUCED), _async_setup(),
                          K11, "0.26.0", path)
    assert result.outcome is Outcome.NOT_REPRODUCED


def test_reason_outcomes_round_trip(tmp_path):
    row = _row("reproduced", {"sync_scheduling": "not_reproduced", "last_token_in_prompt_block": "other_failure"})
    assert data.load(_table(tmp_path, row)) == [row]
    assert supports(row, "last_token_in_prompt_block") and not supports(row, "one_chunk_cpu_tier")


def test_every_measured_reason_of_a_builtin_has_its_alternative():
    """Each measured reason a built-in gives has a run that breaks it, at flags the CLI takes."""
    found = {}
    for recipe in all_builtins():
        runs = alternatives(recipe)
        assert sorted(runs) == sorted(measured_reasons(recipe))
        found.update(runs)
    assert set(found) == set(MEASURED_REASONS), "a measured reason no built-in gives: nothing measures it"


def test_the_alternative_breaks_the_reason():
    for recipe in all_builtins():
        for requirement in measured_reasons(recipe):
            from kvdoctor.recipes.geometry import reason_alternative

            planned = resolve_setup(recipe, Overrides(worker="simulated"))
            values = reason_alternative(recipe, requirement, planned)
            broken = resolve_setup(recipe, Overrides(**values, worker="simulated"))
            assert requirement in [name for name, _ in broken.waived], (recipe.name, requirement, broken.untested)
            assert all(getattr(broken, k) == v for k, v in values.items()), dataclasses.asdict(broken)
