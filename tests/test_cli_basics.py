"""The CLI stays instant and never shows a traceback for bad input."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import ROOT, run_cli

SCRIPT = shutil.which("kvdoctor", path=str(Path(sys.executable).parent)) or "kvdoctor"


@pytest.mark.parametrize("flag", ["--help", "--version"])
def test_help_and_version_are_instant(flag):
    best = min(_timed([SCRIPT, flag]) for _ in range(3))
    assert best < 0.5, f"kvdoctor {flag} took {best:.2f}s"


def _timed(cmd):
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr
    return elapsed


def test_cli_import_does_not_import_vllm():
    code = "import sys, kvdoctor.cli.app; print('vllm' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_version_prints_version():
    from kvdoctor import __version__

    assert run_cli("--version").stdout.strip() == f"kvdoctor {__version__}"


@pytest.mark.parametrize("args, fragment", [
    (["repro", "no-such-recipe"], "built-in recipes: "),
    (["repro", "queued-abort", "--gpu-blocks", "0"], "must be a positive integer"),
    (["repro", "queued-abort", "--block-size", "0"], "must be a positive integer"),
    (["repro", "queued-abort", "--block-size", "4", "--kv-transfer-config",
      '{"kv_connector_extra_config": {"block_size": 6}}'], "not a whole number of GPU blocks"),
    (["repro", "queued-abort", "--kv-transfer-config", "{not json"], "not valid JSON"),
    (["repro", "queued-abort", "--kv-transfer-config", '{"kv_connector": "NixlConnector"}'], "OffloadingConnector"),
    (["repro", "queued-abort", "--logic", "bogus"], "--logic must be one of"),
    (["repro"], "give a RECIPE"),
    (["repro", "queued-abort", "--json", "--svg", "x.svg"], "cannot be combined"),
    (["repro", "queued-abort", "--max-num-seqs", "32", "--max-num-batched-tokens", "16"], ">= --max-num-seqs"),
    (["inspect", "queued-abort", "--logic", "all"], "one timeline"),
    (["repro", "missing-file.toml"], "no such recipe file"),
    (["repro", "queued-abort", "--model", "/nonexistent/model"], "not a directory"),
])
def test_bad_input_is_one_line_exit_2(args, fragment):
    proc = run_cli(*args)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], proc.stderr


def test_unknown_recipe_lists_known_ones():
    proc = run_cli("repro", "no-such-recipe")
    assert "queued-abort" in proc.stderr


def test_list_shows_builtin_recipes_with_refs_and_signature():
    proc = run_cli("repro", "--list", "--json")
    assert proc.returncode == 0, proc.stderr
    recipes = {r["name"]: r for r in json.loads(proc.stdout)["recipes"]}
    assert "queued-abort" in recipes
    assert any("49118" in ref for ref in recipes["queued-abort"]["refs"])
    assert "_build_store_jobs" in recipes["queued-abort"]["signature"]


@pytest.mark.parametrize("command, usage", [
    ("repro", "kvdoctor repro [OPTIONS] [RECIPE]"), ("inspect", "kvdoctor inspect [OPTIONS] RECIPE"),
    ("diagnose", "kvdoctor diagnose [OPTIONS] LOG"), ("matrix", "kvdoctor matrix [OPTIONS] [RECIPE]..."),
])
def test_usage_lines_name_arguments_plainly(command, usage):
    """Typer writes `{log}` and `RECIPE <list[str]>`; the help names an argument as a user types it."""
    proc = run_cli(command, "--help", env={"COLUMNS": "100"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == f"Usage: {usage}"
    arguments = proc.stdout.split("Arguments:")[1].split("\n\n")[0]
    assert "{" not in arguments and "<str>" not in arguments and "<list[str]>" not in arguments, arguments
