"""The engine levels (issue 25): one step registry, each level's answer for every need, and
`kvdoctor audit` at `--engine core` against kvdoctor's scheduler-level measurements.

The audit runs once per module, in-process (one vLLM import; ~20 s on 0.26.0). Its rows are
compared with kvdoctor/data/release_outcomes.toml, the scheduler level's measurements of this
release: the engine must reach the same outcome at the same failure site, or say
`not_applicable` naming the step (or the setup) it cannot play. A release without rows skips.
"""

from __future__ import annotations

import pytest

from kvdoctor.errors import InternalError
from kvdoctor.levels.table import LEVEL_TABLE, LEVELS, Level, why_not
from kvdoctor.steps import REGISTRY, Need, kinds_needing


def test_every_level_answers_every_need_once() -> None:
    assert set(LEVEL_TABLE) == set(LEVELS)
    for level in LEVEL_TABLE.values():
        assert not (level.meets & set(level.cannot)), level.name
        assert level.meets | set(level.cannot) == set(Need), f"{level.name}: no answer for " \
            f"{set(Need) - level.meets - set(level.cannot)}"
        assert all(reason.strip() for reason in level.cannot.values())
        assert set(level.sync_only) <= level.meets, level.name
    # kvdoctor's scheduler harness meets every need but the engine's own pause (EngineCore.pause_scheduler)
    assert LEVEL_TABLE["scheduler"].meets == frozenset(Need) - {Need.ENGINE_PAUSE}


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_every_step_kind_has_a_handler_and_an_answer_at_every_level(async_scheduling: bool) -> None:
    for kind in REGISTRY:
        for level in LEVELS:
            why = why_not(kind, level, async_scheduling=async_scheduling)  # raises where a level has no answer
            assert why is None or why.strip()


def test_a_level_without_an_answer_for_a_need_is_kvdoctors_bug() -> None:
    silent = Level("silent", "nothing", meets=frozenset({Need.ENGINE_INPUT}))
    assert silent.why_not(Need.ENGINE_INPUT) is None
    with pytest.raises(InternalError, match="no answer for need 'engine_step'"):
        silent.why_not(Need.ENGINE_STEP)
    with pytest.raises(InternalError, match="'teleport' has no handler"):
        why_not("teleport", "core")


def test_the_level_answers_follow_the_kinds_needs() -> None:
    """core cannot intervene inside the scheduler; serve plays what a client sends (requests, an EOS schedule, a
    prefix-cache reset) and paced steps, a drain only under sync scheduling (nothing is in flight then)."""
    assert why_not("delay_block_hashes", "core") is not None and why_not("delay_block_hashes", "scheduler") is None
    assert why_not("hold_transfers", "core") is None and why_not("hold_transfers", "serve") is not None
    client = {Need.ENGINE_INPUT, Need.ENGINE_STEP, Need.MODEL_OUTPUT, Need.ENGINE_UTILITY, Need.IN_FLIGHT_OUTPUT}
    playable = {kind for kind in REGISTRY if why_not(kind, "serve") is None}
    assert playable == {k for k, kind in REGISTRY.items() if set(kind.needs) <= client}
    assert why_not("drain", "serve", async_scheduling=True) is not None


def test_one_table_chooses_the_level() -> None:
    """Every level `--engine` accepts has its runner (and its needs row), and nothing else does; the
    application functions ask the runner and never branch on a level's name."""
    import ast
    from pathlib import Path

    from kvdoctor.levels.runners import RUNNERS, runner

    assert list(RUNNERS) == list(LEVELS) and all(RUNNERS[name].name == name for name in LEVELS)
    with pytest.raises(InternalError, match="unknown engine level 'teleport'"):
        runner("teleport")
    root = Path(__file__).resolve().parents[1] / "kvdoctor"
    for source in (root / "app.py", root / "explore" / "triage.py"):
        compared = [node.lineno for node in ast.walk(ast.parse(source.read_text())) if isinstance(node, ast.Compare)
                    and any(isinstance(side, ast.Constant) and side.value in LEVELS
                            for side in (node.left, *node.comparators))]
        assert compared == [], f"{source.name} compares with a level's name at lines {compared}"


def test_transfer_control_is_what_forces_the_copy_engine() -> None:
    assert set(kinds_needing(Need.TRANSFER_CONTROL)) == {"hold_transfers", "complete_transfers", "fail_transfers"}


# -- kvdoctor audit --engine core ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def core_audit():
    from kvdoctor import app
    from kvdoctor.cli.options import DEFAULT_WORKER, worker_overrides
    from kvdoctor.errors import VllmUnavailableError

    overrides = worker_overrides(None, None, None).replaced(engine="core")
    try:
        return app.audit(command="kvdoctor audit --engine core", overrides=overrides, default_worker=DEFAULT_WORKER)
    except VllmUnavailableError as exc:
        pytest.skip(f"no usable vLLM here: {exc}")


@pytest.mark.vllm
def test_audit_at_core_matches_the_scheduler_level_measurements(core_audit) -> None:
    from kvdoctor.matrix import data
    from kvdoctor.matrix.runner import failure_site
    from kvdoctor.report.json_doc import audit_document

    doc = audit_document(core_audit)
    release = doc["vllm_version"]
    measured = {row.recipe: row for row in data.load() if row.release == release}
    if not measured:
        pytest.skip(f"kvdoctor/data/release_outcomes.toml has no measurements for vLLM {release}")
    assert doc["engine"] == "core"
    differ, compared = [], 0
    for row in doc["rows"]:
        assert row["setup"]["engine"] == "core", row["recipe"]
        if row["outcome"] == "not_applicable":  # a step (or a setup) the engine cannot play, named
            detail = next(r.installed.detail for r in core_audit.rows if r.recipe.name == row["recipe"])
            assert "`" in detail or "EAGLE" in detail, (row["recipe"], detail)
            continue
        site = failure_site(row["failure"], row["violations"]) if row["outcome"] == "reproduced" else None
        want = measured[row["recipe"]]
        compared += 1
        if (row["outcome"], site) != (want.outcome, want.failure_site):
            differ.append(f"{row['recipe']}: scheduler {want.outcome} ({want.failure_site}), core "
                          f"{row['outcome']} ({site})")
    assert not differ, f"vLLM {release}: " + "; ".join(differ)
    assert compared > len(doc["rows"]) // 2, f"only {compared} of {len(doc['rows'])} recipes played at --engine core"


@pytest.mark.vllm
def test_audit_reports_name_the_engine_level(core_audit) -> None:
    from kvdoctor.report.markdown import render_markdown
    from kvdoctor.report.tables import audit_summary

    assert "through vLLM's EngineCore" in audit_summary(core_audit)
    assert render_markdown("audit", core_audit).splitlines()[0].endswith("through vLLM's EngineCore")
    unplayed = [row for row in core_audit.rows if row.installed.outcome.value == "not_applicable"]
    if unplayed:
        assert f"{len(unplayed)} of {len(core_audit.rows)} recipes cannot be played" in audit_summary(core_audit)


# -- kvdoctor matrix --engine ----------------------------------------------------------------------------

def _recording_env(tmp_path, release: str):
    """A release environment whose `python` records the kvdoctor command it was given and answers it."""
    from kvdoctor.matrix.envs import ReleaseEnv

    bindir = tmp_path / "env" / "bin"
    bindir.mkdir(parents=True)
    script = bindir / "python"
    script.write_text("#!/bin/sh\n"
                      f"echo \"$@\" > {tmp_path / 'args'}\n"
                      "echo '{\"recipe\": {\"name\": \"queued-abort\"}, \"vllm_version\": \"" + release + "\", "
                      "\"results\": [{\"outcome\": \"not_reproduced\"}]}'\n")
    script.chmod(0o755)
    return ReleaseEnv(release, tmp_path / "env", lent=True)


@pytest.mark.parametrize("engine, passed", [("scheduler", ""), ("core", " --engine core"),
                                            ("serve", " --engine serve")])
def test_matrix_passes_the_engine_level_to_each_child_command(tmp_path, engine: str, passed: str) -> None:
    from kvdoctor.matrix.runner import Runner

    env = _recording_env(tmp_path, "0.26.0")
    with Runner(engine=engine) as runner:
        cell = runner.recipe(env, "queued-abort")
    assert cell.outcome == "not_reproduced"
    assert (tmp_path / "args").read_text().strip() == f"-m kvdoctor repro queued-abort --logic installed --json{passed}"


def test_matrix_reports_name_the_engine_level() -> None:
    from kvdoctor.matrix.app import MatrixReport
    from kvdoctor.matrix.runner import Cell
    from kvdoctor.report.matrix import matrix_document, matrix_markdown

    report = MatrixReport(releases=["0.26.0"], recipes=["queued-abort"], audit=False, bisect=False, engine="core")
    report.cells[("0.26.0", "queued-abort")] = Cell("0.26.0", "queued-abort", "reproduced")
    assert matrix_document(report)["engine"] == "core"
    assert "## Outcome under the installed logic through vLLM's EngineCore" in matrix_markdown(report)


def test_matrix_write_data_refuses_an_engine_level_in_one_line(tmp_path) -> None:
    from tests.conftest import run_cli

    proc = run_cli("matrix", "--audit", "--engine", "core", "--write-data", str(tmp_path / "x.toml"),
                   "--vllm", "0.26.0", timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "scheduler-level measurements" in lines[0] and "--engine core" in lines[0]
    proc = run_cli("matrix", "queued-abort", "--engine", "gpu", "--vllm", "0.26.0", timeout=120)
    assert proc.returncode == 2 and "--engine must be one of scheduler|core|serve" in proc.stderr
