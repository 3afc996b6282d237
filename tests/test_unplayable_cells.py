"""A recipe an engine level cannot play is `not_applicable` and `unplayable` (the run did not test the bug,
exit 6) at every in-process level the same way (`ScenarioRun`), and it stays so through `--json` into
`kvdoctor matrix`'s cells: the table says so, the exit status is 6, and a bisection reads no answer there.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvdoctor.engine.overrides import Overrides
from kvdoctor.errors import ExitStatus
from tests.cli_runner import invoke


def _unplayable_at_core():
    from kvdoctor.levels.core import run_core_scenario
    from kvdoctor.recipes.builtins import resolve
    from kvdoctor.resolution import resolve_setup

    recipe = resolve("offload-keys-lag-blocks")  # its delay_block_hashes step is the scheduler's
    setup = resolve_setup(recipe, Overrides(worker="simulated", engine="core"))
    return run_core_scenario(None, recipe, setup, "installed")  # decided before vLLM builds anything


def test_the_core_level_marks_a_step_it_cannot_play_as_the_scheduler_level_does():
    from kvdoctor.report.json_doc import result_dict

    result = _unplayable_at_core()
    assert (result.outcome.value, result.unplayable) == ("not_applicable", True)
    assert "`delay_block_hashes`" in result.detail
    assert result_dict(result)["unplayable"] is True


@pytest.mark.vllm
def test_core_json_carries_unplayable_where_the_scheduler_plays_it(api):
    core = invoke("repro", "offload-keys-lag-blocks", "--engine", "core", "--logic", "installed", "--json")
    assert core.returncode == 6, core.stderr
    result = json.loads(core.stdout)["results"][0]
    assert (result["outcome"], result["unplayable"]) == ("not_applicable", True)


def _cells(monkeypatch, unplayable: bool):
    from kvdoctor.matrix.envs import ReleaseEnv
    from kvdoctor.matrix.runner import Runner

    row = {"recipe": "offload-keys-lag-blocks", "bug": "K6", "outcome": "not_applicable", "hint": "a step",
           "fixed_logic_outcome": "not_applicable", "unplayable": unplayable}
    doc = {"vllm_version": "0.26.0", "rows": [row]}
    monkeypatch.setattr(Runner, "_kvdoctor", lambda self, env, args: (6, doc, ""))
    return Runner(engine="core").audit(ReleaseEnv("0.26.0", Path("/nonexistent"), lent=True))


@pytest.mark.parametrize("unplayable, status", [(True, ExitStatus.INCONCLUSIVE), (False, ExitStatus.NOT_REPRODUCED)])
def test_a_matrix_cell_keeps_unplayable_and_earns_its_exit(monkeypatch, unplayable, status):
    from kvdoctor.matrix.app import MatrixReport
    from kvdoctor.report.matrix import _cell_text

    [cell] = _cells(monkeypatch, unplayable)
    assert cell.unplayable is unplayable
    report = MatrixReport(releases=["0.26.0"], recipes=[cell.recipe], audit=True, bisect=False, engine="core")
    report.cells[("0.26.0", cell.recipe)] = cell
    assert report.exit_status is status
    assert ("not tested" in _cell_text(cell)) is unplayable
