"""One output seam: `--format text|json|markdown|svg` on every command (`--json` its alias), one
formatter per format, and every command's exit-code help generated from `ExitStatus`."""

from __future__ import annotations

import json

import pytest

from kvdoctor.errors import ExitStatus

from .cli_runner import invoke

COMMANDS = ["repro", "inspect", "audit", "explore", "matrix", "diagnose"]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_takes_format_and_lists_every_exit_code(command):
    proc = invoke(command, "--help", env={"COLUMNS": "100"})
    assert proc.returncode == 0, proc.stderr
    flat = " ".join(proc.stdout.split())
    assert "--format FORMAT" in flat and "--json" in flat
    codes = flat.split("Exit codes:")[1]
    for status in ExitStatus:
        if status is not ExitStatus.INTERRUPTED:
            assert f" {int(status)} " in f" {codes}", (status, proc.stdout)
    assert ExitStatus.INTERNAL_ERROR.meaning in flat  # generated, not written by hand


def test_list_in_every_format():
    text = invoke("repro", "--list", "--format", "text")
    assert text.returncode == 0 and text.stdout.startswith("built-in recipes"), text.stderr
    as_json = invoke("repro", "--list", "--format", "json")
    alias = invoke("repro", "--list", "--json")
    assert as_json.stdout == alias.stdout
    assert "queued-abort" in {r["name"] for r in json.loads(as_json.stdout)["recipes"]}
    markdown = invoke("repro", "--list", "--format", "markdown")
    assert markdown.stdout.startswith("| name | bug |") and "| queued-abort |" in markdown.stdout
    svg = invoke("repro", "--list", "--format", "svg")
    assert svg.stdout.startswith("<svg") and svg.stdout.rstrip().endswith("</svg>")


@pytest.mark.parametrize("args, message", [
    (["repro", "--list", "--format", "yaml"], "--format must be one of text|json|markdown|svg, got 'yaml'"),
    (["repro", "--list", "--json", "--format", "text"], "--json is --format json; it cannot be combined"),
    (["repro", "queued-abort", "--format", "markdown", "--svg", "x.svg"], "cannot be combined with --format"),
    (["diagnose", "x.log", "--format", "xml"], "--format must be one of"),
    (["matrix", "queued-abort", "--format", "xml"], "--format must be one of"),
])
def test_a_bad_format_is_a_usage_error(args, message):
    proc = invoke(*args)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvdoctor: error: ") and message in lines[0], proc.stderr


def test_format_json_error_is_a_document():
    proc = invoke("repro", "nosuch", "--format", "json")
    assert proc.returncode == 2
    assert json.loads(proc.stdout)["error"]["exit_code"] == 2


@pytest.mark.vllm
def test_markdown_on_stdout_is_the_report_attachment(api, tmp_path):
    report = tmp_path / "issue.md"
    proc = invoke("repro", "queued-abort", "--worker", "simulated", "--logic", "installed",
                   "--format", "markdown", "--report", str(report))
    assert proc.returncode in (0, 1), proc.stderr  # the verdict's own code, whichever it is
    assert proc.stdout == report.read_text()
    assert proc.stdout.startswith("#") and "queued-abort" in proc.stdout


@pytest.mark.vllm
def test_svg_on_stdout_is_the_svg_file(api, tmp_path):
    image = tmp_path / "out.svg"
    proc = invoke("repro", "queued-abort", "--worker", "simulated", "--logic", "installed",
                   "--format", "svg", "--svg", str(image), env={"COLUMNS": "100"})
    assert proc.returncode in (0, 1), proc.stderr
    assert proc.stdout.startswith("<svg") and proc.stdout == image.read_text()
