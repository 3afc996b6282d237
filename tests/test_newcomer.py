"""A newcomer's first hour (issue 14): what to do next, output that fits, nothing left behind.

One real run per recipe (module fixtures, vLLM imported once); the CLI checks
that need no vLLM run first and stay cheap.
"""

from __future__ import annotations

import io
import json
import re

import pytest

from kvdoctor.engine.overrides import Overrides

from .cli_runner import invoke
from .conftest import run_cli

WIDTH = 80


# -- usage errors: one line, exit 2, whoever raised them -------------------------------------------

@pytest.mark.parametrize("args, fragment", [
    (["repro", "--bogus"], "No such option: --bogus"),
    (["inspect"], "Missing argument 'RECIPE'"),
    (["repro", "queued-abort", "--block-size", "abc"], "'--block-size'"),
    (["explore", "--workers", "x"], "'--workers'"),
    (["nosuchcommand"], "No such command"),
    (["repro", "queued-abort", "--kv-offloading-size", "1", "--kv-offloading-backend", "lmcache"],
     "LMCacheMPConnector"),
])
def test_every_usage_error_is_one_line_exit_2(args, fragment):
    proc = invoke(*args)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("kvdoctor: error: ") and fragment in lines[0], lines[0]
    assert "╭" not in proc.stderr and "Traceback" not in proc.stderr


# -- help ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["repro", "inspect", "audit", "explore"])
def test_help_lists_exit_codes_examples_and_no_bool_metavar(command):
    from kvdoctor.errors import ExitStatus

    proc = invoke(command, "--help", env={"COLUMNS": str(WIDTH)})
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert "<bool>" not in text and "…" not in text
    assert all(len(line) <= WIDTH for line in text.splitlines()), text
    flat = " ".join(text.split())
    for status in ExitStatus:
        if status is not ExitStatus.INTERRUPTED:
            assert f"{int(status)} " in flat.split("Exit codes:")[1], (status, text)
    assert ExitStatus.INTERNAL_ERROR.meaning.split(":")[0] in flat
    assert "Examples:" in text and f"kvdoctor {command}" in text.split("Examples:")[1]
    if command in ("repro", "inspect"):
        assert "Serving geometry (overrides the recipe's [setup])" in text
        for flag in ("--enable-prefix-caching", "--kv-offloading-size", "--kv-offloading-backend"):
            assert flag in text


# -- pasted operator flags (no vLLM) ---------------------------------------------------------------

def test_kv_offloading_size_builds_the_transfer_config_vllm_builds():
    from kvdoctor.cli.options import geometry_overrides, kv_offloading_transfer_config

    built = json.loads(kv_offloading_transfer_config(2.5, None, None))
    assert built == {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                     "kv_connector_extra_config": {"cpu_bytes_to_use": int(2.5 * (1 << 30))}}
    merged = json.loads(kv_offloading_transfer_config(
        1, "native", '{"kv_connector_extra_config": {"block_size": 32, "cpu_bytes_to_use": 5}}'))
    assert merged["kv_connector_extra_config"] == {"block_size": 32, "cpu_bytes_to_use": 1 << 30}
    overrides = geometry_overrides(None, None, None, None, None, None, None, None, None,
                                   enable_prefix_caching=False, kv_offloading_size=1)
    assert overrides.cpu_bytes_to_use == 1 << 30 and overrides.enable_prefix_caching is False


def test_no_effect_serve_flags_are_dropped_with_a_note(capsys):
    from kvdoctor.cli.shell import accept_serve_flags

    argv = ["repro", "queued-abort", "--gpu-memory-utilization", "0.9", "-tp=2", "--enforce-eager",
            "--block-size", "4"]
    assert accept_serve_flags(argv) == ["repro", "queued-abort", "--block-size", "4"]
    notes = capsys.readouterr().err.strip().splitlines()
    assert len(notes) == 3 and all("does not change the run" in n for n in notes)
    assert accept_serve_flags(["explore", "--seed", "3"]) == ["explore", "--seed", "3"]


# -- recipes: the workaround field -----------------------------------------------------------------

def test_workaround_field_is_validated_with_its_line_and_round_trips(tmp_path):
    from kvdoctor.errors import RecipeError
    from kvdoctor.recipes.builtins import load_builtin
    from kvdoctor.recipes.loader import load_recipe_text
    from kvdoctor.recipes.writer import recipe_to_toml

    recipe = load_builtin("final-token-slot-stored")
    assert recipe.workaround and "offload_prompt_only" in recipe.workaround
    assert load_recipe_text(recipe_to_toml(recipe), "x.toml").workaround == recipe.workaround
    text = recipe_to_toml(recipe).replace(f'workaround = "{recipe.workaround}"', 'workaround = "  "')
    line = next(i for i, row in enumerate(text.splitlines(), 1) if row.startswith("workaround"))
    with pytest.raises(RecipeError, match=rf"^x\.toml:{line}: \[recipe\] workaround must say"):
        load_recipe_text(text, "x.toml")
    with pytest.raises(RecipeError, match=r"workaround must be a string"):
        load_recipe_text(text.replace('workaround = "  "', "workaround = 3"), "x.toml")


# -- explore findings ------------------------------------------------------------------------------

def test_explore_finding_with_a_known_signature_is_labelled_and_uses_the_message():
    from kvdoctor.explore.findings import finding_recipe, known_bug
    from kvdoctor.explore.runner import Observation
    from kvdoctor.recipes.builtins import load_builtin
    from kvdoctor.recipes.model import Signature

    k1 = known_bug(Signature(exception="AssertionError", function="_build_store_jobs",
                             contains="len(offload_keys) == len(offload_block_ids)"))
    assert k1 is not None and k1[0] == "K1" and "queued-abort" in k1[1]
    assert known_bug(Signature(exception="AssertionError", function="_build_store_jobs", contains="other")) is None
    assert known_bug(Signature(invariant="store-covers-computed-slots"))[0] == "K4"
    obs = Observation(signature="RuntimeError in reset_prefix_cache", kind="exception", exception="RuntimeError",
                      function="reset_prefix_cache", code="raise RuntimeError(", message="cannot reset now",
                      failure_index=1)
    recipe = finding_recipe(load_builtin("queued-abort"), obs, "summary")
    assert recipe.signature.contains == "cannot reset now"


# -- nothing left behind (no vLLM) -----------------------------------------------------------------

def test_hypothesis_storage_goes_to_a_removed_temporary_directory(tmp_path, monkeypatch):
    from hypothesis import configuration

    from kvdoctor.explore.app import hypothesis_storage

    monkeypatch.chdir(tmp_path)
    with hypothesis_storage():
        where = configuration.storage_directory("examples").path
        where.mkdir(parents=True)
        assert tmp_path not in where.parents
    assert not where.exists() and not (tmp_path / ".hypothesis").exists()


# -- real runs -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reports(api):
    from kvdoctor import app

    return {name: app.repro(name, Overrides(), "all", record_timeline=True, command=f"kvdoctor repro {name}")
            for name in ("queued-abort", "preempt-reload-same-step")}


def _render(renderables, width=WIDTH) -> str:
    from rich.console import Console

    console = Console(width=width, record=True, file=io.StringIO(), color_system=None)
    for item in renderables:
        console.print(item)
    return console.export_text()


def test_repro_output_fits_80_columns_and_cuts_nothing(reports):
    from kvdoctor.report.tables import repro_renderables, timeline_renderables

    for name, report in reports.items():
        text = _render(repro_renderables(report)) + _render(timeline_renderables(report.results[0]))
        lines = text.splitlines()
        assert all(len(line) <= WIDTH for line in lines), [line for line in lines if len(line) > WIDTH]
        assert "…" not in text
        assert name in text
        for result in report.results:
            if result.failure is not None:
                assert any(f"{result.failure.file}:{result.failure.line}" in line for line in lines)
            for snap in result.requests:  # every request id starts a line of its own block or row
                assert any(re.match(rf"\s*{re.escape(snap.request)}\s", line) for line in lines), snap.request
        assert "1 chunks" not in text and "+ of its" not in text
        assert text.count("logic: checks") <= 1, "identical checks are shown once, whatever the variants"


def test_what_to_do_next_after_a_reproduced_verdict(reports, release):
    from kvdoctor.report.tables import repro_renderables

    text = " ".join(_render(repro_renderables(reports["preempt-reload-same-step"]), width=200).split())
    if reports["preempt-reload-same-step"].decisive.outcome.value != "reproduced":
        pytest.skip(f"K8 does not reproduce on vLLM {release}: no next steps to show")
    assert "what to do next" in text
    assert "fix vllm#57810" in text
    assert "workaround reset the offload tier" in text
    assert "report it kvdoctor repro preempt-reload-same-step --report issue.md" in text
    assert "needs its own upstream fix" not in text
    assert "'fixed logic' = the installed vLLM with the PR #49146 cap" in text


def test_markdown_report_embeds_recipe_and_reproduce_section(reports):
    from kvdoctor.recipes.loader import load_recipe_text
    from kvdoctor.report.markdown import render_markdown

    report = reports["queued-abort"]
    text = render_markdown("repro", report)
    assert "vllm-project/vllm#49118" in text and "vllm-project/vllm#49146" in text
    toml = text.split("```toml\n", 1)[1].split("\n```", 1)[0]
    embedded = load_recipe_text(toml, "embedded.toml")
    assert [(s.action, s.args) for s in embedded.steps] == [(s.action, s.args) for s in report.recipe.steps]
    reproduce = text.split("## Reproduce", 1)[1]
    assert f'pip install "vllm=={report.vllm_version}"' in reproduce and "kvdoctor repro queued-abort" in reproduce
    for field in ("max_model_len", "enable_chunked_prefill", "enable_prefix_caching", "model", "block_size"):
        assert f"| `{field}` |" in text
    assert not any(re.fullmatch(r"(Upstream|Workaround|Fixed in|Setup|Reproduced means):\s*", line)
                   for line in text.splitlines()), "a label with nothing after it"
    assert text.count("Checks under") <= 1


def test_audit_table_fits_80_columns_with_long_recipe_names(reports):
    from kvdoctor.report.tables import audit_renderables
    from kvdoctor.results import AuditReport, AuditRow

    audit = AuditReport(vllm_version=reports["queued-abort"].vllm_version)
    for report in reports.values():
        by_logic = {r.logic: r for r in report.results}
        audit.rows.append(AuditRow(report.recipe.bug, report.recipe, report.setup, by_logic["installed"],
                                   by_logic["fixed"]))
    text = _render(audit_renderables(audit))
    assert all(len(line) <= WIDTH for line in text.splitlines())
    assert "…" not in text and "preempt-reload-same-step" in text and "queued-abort" in text


def test_pasted_operator_flags_run_piped_at_columns_80_and_leave_no_temp_dirs(tmp_path):
    temp = tmp_path / "tmp"
    temp.mkdir()
    proc = run_cli("repro", "queued-abort", "--logic", "installed", "--kv-offloading-size", "1",
                   "--no-enable-prefix-caching", "--gpu-memory-utilization", "0.9", "--tensor-parallel-size", "2",
                   env={"COLUMNS": str(WIDTH), "TMPDIR": str(temp)})
    assert proc.returncode in (0, 1), proc.stderr
    notes = [line for line in proc.stderr.splitlines() if line.startswith("kvdoctor: note:")]
    assert len(notes) == 2 and "--gpu-memory-utilization" in notes[0]
    lines = proc.stdout.splitlines()
    assert lines and all(len(line) <= WIDTH and line == line.rstrip() for line in lines), proc.stdout
    flat = " ".join(proc.stdout.split())
    assert f"cpu_bytes_to_use={1 << 30}" in flat and "enable_prefix_caching=False" in flat
    left = [p.name for p in temp.iterdir() if p.name.startswith(("kvdoctor-", "kv-repro-"))]
    assert left == [], left
