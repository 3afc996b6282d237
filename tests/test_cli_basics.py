"""The CLI stays instant and never shows a traceback for bad input."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .cli_runner import invoke
from .conftest import ROOT

SCRIPT = shutil.which("kvdoctor", path=str(Path(sys.executable).parent)) or "kvdoctor"


@pytest.mark.parametrize("flag", ["--help", "--version"])
def test_help_and_version_are_instant(flag):
    """CPU seconds, not wall: CI runs this beside workers importing vLLM at full load.

    Measured: 0.15 s wall on an idle machine, 0.68 s wall in CI at 0.34.0 beside
    two xdist workers; the CPU the command itself spends does not grow with load.
    """
    best = min(_cpu_seconds([SCRIPT, flag]) for _ in range(3))
    assert best < 0.5, f"kvdoctor {flag} spent {best:.2f} CPU-s"


def _cpu_seconds(cmd):
    """User + system CPU of the one child process (os.wait4 reads only its usage)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    out, err = proc.stdout.read(), proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    assert proc.returncode == 0, err
    assert out, "no help or version printed"
    return usage.ru_utime + usage.ru_stime


def test_cli_import_does_not_import_vllm():
    # kvdoctor.app too: a command resolves its input (exit 2) and checks vLLM is installed (exit 3) before any
    # vLLM import (a stand-in connector imported at module level once broke that: test_compat's exit-3 line)
    code = "import sys, kvdoctor.cli.app, kvdoctor.app; print('vllm' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_version_prints_version():
    from kvdoctor import __version__

    assert invoke("--version").stdout.strip() == f"kvdoctor {__version__}"


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
def test_bad_input_is_one_line_exit_2(api, args, fragment):
    proc = invoke(*args)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], proc.stderr


def test_unknown_recipe_lists_known_ones():
    proc = invoke("repro", "no-such-recipe")
    assert "queued-abort" in proc.stderr


def test_list_shows_builtin_recipes_with_refs_and_signature():
    proc = invoke("repro", "--list", "--json")
    assert proc.returncode == 0, proc.stderr
    recipes = {r["name"]: r for r in json.loads(proc.stdout)["recipes"]}
    assert "queued-abort" in recipes
    assert any("49118" in ref for ref in recipes["queued-abort"]["refs"])
    assert "_build_store_jobs" in recipes["queued-abort"]["signature"]


@pytest.mark.parametrize("command, usage", [
    ("repro", "kvdoctor repro [OPTIONS] [RECIPE]"), ("inspect", "kvdoctor inspect [OPTIONS] RECIPE"),
    ("diagnose", "kvdoctor diagnose [OPTIONS] LOG [-- SERVE_FLAGS]..."),
    ("matrix", "kvdoctor matrix [OPTIONS] [RECIPE]..."),
])
def test_usage_lines_name_arguments_plainly(command, usage):
    """Typer writes `{log}` and `RECIPE <list[str]>`; the help names an argument as a user types it."""
    proc = invoke(command, "--help", env={"COLUMNS": "100"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == f"Usage: {usage}"
    arguments = proc.stdout.split("Arguments:")[1].split("\n\n")[0]
    assert "{" not in arguments and "<str>" not in arguments and "<list[str]>" not in arguments, arguments


# -- the injected environment (`streams.Environment`): what the CLI reads instead of sys.* / os.environ --

def test_a_variable_given_to_the_command_is_read_from_its_environment_and_not_left_behind():
    assert "VLLM_USE_SIMPLE_KV_OFFLOAD" not in os.environ
    proc = invoke("repro", "queued-abort", "--kv-offloading-size", "1", env={"VLLM_USE_SIMPLE_KV_OFFLOAD": "1"})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("kvdoctor: error: VLLM_USE_SIMPLE_KV_OFFLOAD is set")
    assert "VLLM_USE_SIMPLE_KV_OFFLOAD" not in os.environ


def test_the_command_line_and_columns_come_from_the_environment():
    from kvdoctor.cli import streams
    from kvdoctor.cli.common import command_line

    with streams.use(streams.Environment(argv=["kvdoctor", "repro", "a b"], env={"COLUMNS": "64"})):
        assert command_line() == "kvdoctor repro 'a b'"
        assert streams.current().width() == 64
    narrow = invoke("repro", "--list", columns=60)
    assert narrow.returncode == 0 and max(len(line) for line in narrow.stdout.splitlines()) <= 60, narrow.stdout


def test_progress_draws_on_the_injected_terminal_only(api):
    args = ("repro", "queued-abort", "--worker", "simulated", "--logic", "installed", "--json")
    on_terminal = invoke(*args, stderr_isatty=True, env={"KVDOCTOR_NO_SPINNER": ""})
    assert on_terminal.returncode in (0, 1), on_terminal.stderr
    assert "\r\x1b[2Krepro" in on_terminal.stderr and on_terminal.stderr.endswith("\r\x1b[2K")
    piped = invoke(*args)
    assert piped.returncode == on_terminal.returncode and "\x1b" not in piped.stderr
    assert json.loads(piped.stdout)["recipe"]["name"] == "queued-abort"
