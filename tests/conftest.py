"""Shared fixtures: vLLM is imported once per test session (it costs seconds)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
KVDOCTOR = [sys.executable, "-m", "kvdoctor"]


@pytest.fixture(scope="session")
def api():
    from kvdoctor.engine import compat

    return compat.load()


@pytest.fixture(scope="session")
def release(api) -> tuple[int, int]:
    """(major, minor) of the vLLM under test: tests state what each release must show."""
    return api.version[:2]


def expected_for(api, release, table: dict):
    """The outcomes a test module measured for this release; skip releases it did not measure."""
    outcomes = table.get(tuple(release))
    if outcomes is None:
        measured = ", ".join(".".join(map(str, r)) for r in sorted(table))
        pytest.skip(f"this test's outcomes were measured on vLLM {measured}, not {api.version_text}")
    return outcomes


def run_cli(*args: str, timeout: int = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """`kvdoctor ARGS` as a fresh process (a full vLLM import each): for what the process itself does
    (pipes, exit statuses, /dev/full, signals, start-up imports, teardown). Everything else:
    `tests/cli_runner.invoke`, the same call in-process."""
    return subprocess.run([*KVDOCTOR, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, **(env or {})})
