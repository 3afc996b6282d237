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


def _timed_run(args: list[str], env: dict) -> tuple[int, str, float]:
    """(exit code, stdout, seconds from the last line of output to the process's end)."""
    import os
    import subprocess
    import sys
    import time

    from .conftest import ROOT

    proc = subprocess.Popen([sys.executable, "-m", "kvdoctor", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=ROOT, env={**os.environ, **env})
    last = time.monotonic()
    lines = []
    for line in proc.stdout:
        lines.append(line)
        last = time.monotonic()
    code = proc.wait(timeout=600)
    return code, "".join(lines), time.monotonic() - last


def _isolated(tmp_path) -> tuple[dict, list]:
    """TMPDIR and HOME in empty folders, to see what a run leaves behind."""
    temp, home = tmp_path / "tmp", tmp_path / "home"
    temp.mkdir()
    home.mkdir()
    env = {**NARROW, "TMPDIR": str(temp), "HOME": str(home)}
    for name in ("TORCHINDUCTOR_CACHE_DIR", "VLLM_CACHE_ROOT", "TRITON_CACHE_DIR", "KVDOCTOR_SCRATCH_DIR"):
        env[name] = ""  # as on a fresh shell (an empty value reads as unset below)
    return env, [temp, home]


def _left_behind(folders: list) -> list[str]:
    return [str(p) for folder in folders for p in folder.rglob("*")]


def test_audit_is_compact_exits_at_once_and_leaves_nothing(tmp_path, api):
    """`audit` at 80 columns: at most 40 lines, every recipe name whole, a one-line summary; the
    prompt is back within 1 s of the last line; nothing is left in $TMPDIR or $HOME."""
    env, folders = _isolated(tmp_path)
    code, out, tail = _timed_run(["audit"], env)
    assert code in (0, 1, 4, 6), out
    lines = out.splitlines()
    assert len(lines) <= 40, out
    _assert_fits(out)
    for name in builtin_names():
        assert any(line.split()[1:2] == [name] for line in lines if line.startswith("  K")), (name, out)
    assert any(f"known bugs reproduce on vLLM {api.version_text}" in line
               or "known bugs reproduces on vLLM" in line or "known bug reproduces" in line for line in lines), out
    assert tail < 1.0, f"the process ended {tail:.2f}s after its last line of output"
    assert _left_behind(folders) == []


def test_a_model_run_leaves_no_cache_in_home_and_exits_at_once(tmp_path):
    """`--model` makes vLLM write ~/.cache/vllm/modelinfos; torch an empty torchinductor_<user>."""
    env, folders = _isolated(tmp_path)
    code, out, tail = _timed_run(["repro", "queued-abort", "--logic", "installed",
                                  "--model", "kvdoctor/models/swa-full"], env)
    assert code in (0, 1), out
    assert "queued-abort" in out
    assert tail < 1.0, f"the process ended {tail:.2f}s after its last line of output"
    assert _left_behind(folders) == []
