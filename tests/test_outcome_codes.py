"""One outcome -> exit-code mapping, asked by every command; one schema version for every --json document."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from kvdoctor.errors import ExitStatus
from kvdoctor.observe.verdict import Outcome
from kvdoctor.outcome_codes import exit_code_for, exit_code_for_many

from .conftest import ROOT

EXPECTED = {
    Outcome.REPRODUCED: ExitStatus.REPRODUCED,
    Outcome.NOT_REPRODUCED: ExitStatus.NOT_REPRODUCED,
    Outcome.NOT_APPLICABLE: ExitStatus.NOT_REPRODUCED,
    Outcome.NOT_REACHED: ExitStatus.INCONCLUSIVE,
    Outcome.UNTESTED: ExitStatus.INCONCLUSIVE,
    Outcome.SETUP_ERROR: ExitStatus.SETUP_OR_OTHER_FAILURE,
    Outcome.OTHER_FAILURE: ExitStatus.SETUP_OR_OTHER_FAILURE,
}


def test_every_outcome_has_its_code():
    assert set(EXPECTED) == set(Outcome), "a new Outcome needs its exit code here and in outcome_codes"
    for outcome, status in EXPECTED.items():
        assert exit_code_for(outcome) is status
        assert exit_code_for(outcome.value) is status  # a JSON document's string means the same


def test_a_level_that_cannot_play_the_recipe_did_not_test_it():
    """not_applicable to this vLLM (a probe) is 0; not_applicable because the engine level cannot play a
    step (`--engine core` cannot withhold block hashes) is inconclusive: the bug may be there."""
    level = SimpleNamespace(outcome=Outcome.NOT_APPLICABLE, unplayable=True)
    probe = SimpleNamespace(outcome=Outcome.NOT_APPLICABLE, unplayable=False)
    assert exit_code_for(level) is ExitStatus.INCONCLUSIVE
    assert exit_code_for(probe) is ExitStatus.NOT_REPRODUCED
    assert exit_code_for(SimpleNamespace(outcome=Outcome.REPRODUCED, unplayable=False)) is ExitStatus.REPRODUCED
    assert exit_code_for_many([probe, level]) is ExitStatus.INCONCLUSIVE  # audit --engine core


def test_a_cell_that_is_no_outcome_is_a_failure():
    """A matrix cell whose environment or kvdoctor child broke ("vllm_unavailable", "internal_error")."""
    assert exit_code_for("vllm_unavailable") is ExitStatus.SETUP_OR_OTHER_FAILURE


@pytest.mark.parametrize("outcomes, status", [
    ([], ExitStatus.NOT_REPRODUCED),
    ([Outcome.NOT_REPRODUCED, Outcome.NOT_APPLICABLE], ExitStatus.NOT_REPRODUCED),
    ([Outcome.NOT_REPRODUCED, Outcome.UNTESTED], ExitStatus.INCONCLUSIVE),
    ([Outcome.NOT_REACHED, Outcome.SETUP_ERROR], ExitStatus.SETUP_OR_OTHER_FAILURE),
    ([Outcome.OTHER_FAILURE, Outcome.REPRODUCED, Outcome.UNTESTED], ExitStatus.REPRODUCED),
])
def test_many_rows_rank_reproduced_then_failure_then_inconclusive(outcomes, status):
    assert exit_code_for_many(outcomes) is status


def test_matrix_asks_the_one_mapping():
    from kvdoctor.matrix.app import MatrixReport
    from kvdoctor.matrix.runner import Cell

    def report(*outcomes: str) -> MatrixReport:
        cells = {(f"0.{26 + i}.0", "r"): Cell(release=f"0.{26 + i}.0", recipe="r", outcome=o)
                 for i, o in enumerate(outcomes)}
        return MatrixReport(releases=[r for r, _ in cells], recipes=["r"], audit=False, bisect=False, cells=cells)

    assert report("not_reproduced", "not_reached").exit_status is ExitStatus.INCONCLUSIVE
    assert report("not_reached", "vllm_unavailable").exit_status is ExitStatus.SETUP_OR_OTHER_FAILURE
    assert report("not_applicable", "reproduced").exit_status is ExitStatus.REPRODUCED


@pytest.mark.parametrize("outcome", list(Outcome))
def test_diagnose_asks_the_one_mapping(outcome):
    from kvdoctor.diagnose.app import DiagnoseReport, RecipeRun

    run = RecipeRun(recipe=None, setup=None, geometry="recipe",
                    results=[SimpleNamespace(logic="installed", outcome=outcome)])
    report = DiagnoseReport(summary=SimpleNamespace(holds_crash=True), match=SimpleNamespace(candidates=[run]),
                            geometry=None, runs=[run])
    assert report.exit_status is EXPECTED[outcome]


def test_schema_version_is_defined_once():
    import kvdoctor
    from kvdoctor.report import json_doc

    definitions = [f"{path.relative_to(ROOT)}" for path in (ROOT / "kvdoctor").rglob("*.py")
                   if re.search(r"^\s*SCHEMA_VERSION\s*=", path.read_text(), re.M)]
    assert definitions == ["kvdoctor/__init__.py"]
    assert json_doc.SCHEMA_VERSION is kvdoctor.SCHEMA_VERSION
