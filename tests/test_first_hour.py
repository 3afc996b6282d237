"""The first hour at an 80-column terminal: lists a user scans fit, one line a row.

Issue 28: `repro --list` cut 10 of 13 recipe names at 80 columns; `audit` took ~130 lines.
"""

from __future__ import annotations

from kvdoctor.recipes.builtins import builtin_names

from .conftest import run_cli

NARROW = {"COLUMNS": "80", "LINES": "50"}


def _assert_fits(text: str, width: int = 80) -> None:
    wide = [line for line in text.splitlines() if len(line) > width]
    assert not wide, f"lines wider than {width}: {wide}"


def test_repro_list_is_one_whole_name_a_line_at_80_columns():
    proc = run_cli("repro", "--list", env=NARROW)
    assert proc.returncode == 0, proc.stderr
    _assert_fits(proc.stdout)
    names = builtin_names()
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith("  ")]
    assert [row[0] for row in rows] == names, proc.stdout  # every name whole, once, one line each
    assert all(row[1].startswith("K") for row in rows), proc.stdout  # the bug id


def test_repro_list_verbose_and_one_recipe_show_refs_and_signature():
    verbose = run_cli("repro", "--list", "--verbose", env=NARROW)
    assert verbose.returncode == 0, verbose.stderr
    _assert_fits(verbose.stdout)
    assert "signature: AssertionError in _build_store_jobs" in verbose.stdout
    assert "vllm#49146 (fix: cap by allocated chunks)" in verbose.stdout
    one = run_cli("repro", "--list", "queued-abort", env=NARROW)
    assert one.returncode == 0, one.stderr
    _assert_fits(one.stdout)
    assert one.stdout.startswith("queued-abort (K1)")
    assert "vllm#49146" in one.stdout and "signature" in one.stdout and "workaround" in one.stdout
    unknown = run_cli("repro", "--list", "no-such-recipe", env=NARROW)
    assert unknown.returncode == 2 and "unknown recipe" in unknown.stderr
