"""The first hour at an 80-column terminal: lists a user scans fit, one line a row.

Issue 28: `repro --list` cut 10 of 13 recipe names at 80 columns; `audit` took ~130 lines.
"""

from __future__ import annotations

import re

from kvdoctor.recipes.builtins import builtin_names

from .cli_runner import invoke
from .conftest import exit_tail_limit

NARROW = {"COLUMNS": "80", "LINES": "50"}


def _assert_fits(text: str, width: int = 80) -> None:
    wide = [line for line in text.splitlines() if len(line) > width]
    assert not wide, f"lines wider than {width}: {wide}"


def test_repro_list_is_one_whole_name_a_line_at_80_columns():
    proc = invoke("repro", "--list", env=NARROW)
    assert proc.returncode == 0, proc.stderr
    _assert_fits(proc.stdout)
    names = builtin_names()
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith("  ")]
    assert [row[0] for row in rows] == names, proc.stdout  # every name whole, once, one line each
    assert all(row[1].startswith("K") for row in rows), proc.stdout  # the bug id


def test_repro_list_verbose_and_one_recipe_show_refs_and_signature():
    verbose = invoke("repro", "--list", "--verbose", env=NARROW)
    assert verbose.returncode == 0, verbose.stderr
    _assert_fits(verbose.stdout)
    assert "signature: AssertionError in _build_store_jobs" in verbose.stdout
    assert "vllm#49146 (fix: cap by allocated chunks)" in verbose.stdout
    one = invoke("repro", "--list", "queued-abort", env=NARROW)
    assert one.returncode == 0, one.stderr
    _assert_fits(one.stdout)
    assert one.stdout.startswith("queued-abort (K1)")
    assert "vllm#49146" in one.stdout and "signature" in one.stdout and "workaround" in one.stdout
    unknown = invoke("repro", "--list", "no-such-recipe", env=NARROW)
    assert unknown.returncode == 2 and "unknown recipe" in unknown.stderr


def _timed_run(args: list[str], env: dict, stderr_on_a_terminal: bool = False) -> tuple[int, str, str, float]:
    """(exit code, stdout, stderr, seconds from the last output to the process's end). stderr goes to a
    pseudo-terminal when asked (progress is drawn there), else into stdout's pipe."""
    import os
    import pty
    import select
    import subprocess
    import sys
    import time

    from .conftest import ROOT

    master = slave = None
    if stderr_on_a_terminal:
        master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "kvdoctor", *args], stdout=subprocess.PIPE,
                            stderr=slave if slave is not None else subprocess.STDOUT, cwd=ROOT,
                            env={**os.environ, **env})
    if slave is not None:
        os.close(slave)
    chunks: dict[int, list[bytes]] = {proc.stdout.fileno(): []}
    if master is not None:
        chunks[master] = []
    open_fds, last = list(chunks), time.monotonic()
    deadline = last + 900
    while open_fds and time.monotonic() < deadline:  # both at once: a full pty would block the child
        ready, _, _ = select.select(open_fds, [], [], 1)
        for fd in ready:
            try:
                data = os.read(fd, 65536)
            except OSError:  # the pty's other end closed
                data = b""
            if not data:
                open_fds.remove(fd)
                continue
            chunks[fd].append(data)
            last = time.monotonic()
    code = proc.wait(timeout=60)
    tail = time.monotonic() - last
    if master is not None:
        os.close(master)
    stdout = b"".join(chunks[proc.stdout.fileno()]).decode(errors="replace")
    stderr = b"".join(chunks[master]).decode(errors="replace") if master is not None else ""
    return code, stdout, stderr, tail


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


def test_audit_is_compact_shows_progress_exits_at_once_and_leaves_nothing(tmp_path, api):
    """`audit` at 80 columns: at most 40 lines, every recipe name whole, a one-line summary; progress
    (the recipe, a count, the time) on a terminal's stderr; the prompt back within 1 s of the last
    output; nothing left in $TMPDIR or $HOME."""
    env, folders = _isolated(tmp_path)
    code, out, err, tail = _timed_run(["audit"], env, stderr_on_a_terminal=True)
    assert code in (0, 1, 4, 6), out + err
    lines = out.splitlines()
    assert len(lines) <= 40, out
    _assert_fits(out)
    names = builtin_names()
    for name in names:
        assert any(line.split()[1:2] == [name] for line in lines if line.startswith("  K")), (name, out)
    assert any(f"on vLLM {api.version_text}" in line and "reproduce" in line for line in lines[-4:]), out
    total = len(names) + 1  # and the K10 measurement
    for done, name in enumerate(names, start=1):  # each recipe was named as it ran, with its count
        assert re.search(rf"audit  {done}/{total}  K\d+ {re.escape(name)}  (\d+m)?\d+s", err), (name, err[-2000:])
    assert "\r\x1b[2K" in err and err.rstrip(" ").endswith("\r\x1b[2K"), "the line is cleared at the end"
    assert tail < exit_tail_limit(), f"the process ended {tail:.2f}s after its last output"
    assert _left_behind(folders) == []


def test_a_model_run_leaves_no_cache_shows_no_progress_when_piped_and_exits_at_once(tmp_path):
    """`--model` makes vLLM write ~/.cache/vllm/modelinfos, torch an empty torchinductor_<user>;
    piped, stderr carries no progress line."""
    env, folders = _isolated(tmp_path)
    code, out, _, tail = _timed_run(["repro", "queued-abort", "--logic", "installed",
                                     "--model", "kvdoctor/models/swa-full"], env)
    assert code in (0, 1, 6), out  # a verdict (6: not reached with this layout, measured on 0.34)
    assert "queued-abort" in out
    assert "\r" not in out and "\x1b" not in out and "importing vLLM" not in out, out
    assert tail < exit_tail_limit(), f"the process ended {tail:.2f}s after its last output"
    assert _left_behind(folders) == []


def test_progress_draws_on_a_terminal_only():
    """The Progress API itself (what diagnose, matrix and explore can reuse): on a pty, one line redrawn
    in place and cleared at the end; on a pipe, nothing."""
    import os
    import pty
    import select

    from kvdoctor.cli.progress import Progress

    master, slave = pty.openpty()
    with os.fdopen(slave, "w") as terminal, Progress("audit", stream=terminal) as progress:
        progress.callback(3, 13, "K1 queued-abort")
        assert progress.line().startswith("audit  4/13  K1 queued-abort  ")
    drawn = b""
    while select.select([master], [], [], 0.5)[0]:
        try:
            data = os.read(master, 65536)
        except OSError:  # the other end is closed and everything was read
            break
        if not data:
            break
        drawn += data
    drawn = drawn.decode()
    os.close(master)
    assert "\r\x1b[2Kaudit  4/13  K1 queued-abort  0s" in drawn and drawn.endswith("\r\x1b[2K")
    read_end, write_end = os.pipe()
    with os.fdopen(write_end, "w") as pipe, Progress("audit", stream=pipe) as progress:
        progress.callback(3, 13, "K1 queued-abort")
    with os.fdopen(read_end) as reader:
        assert reader.read() == ""


def test_a_fractional_cpu_bytes_to_use_is_a_usage_error_not_cut():
    config = ('{"kv_connector": "OffloadingConnector", "kv_role": "kv_both", '
              '"kv_connector_extra_config": {"cpu_bytes_to_use": 1000000.5}}')
    proc = invoke("repro", "queued-abort", "--kv-transfer-config", config)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == ("kvdoctor: error: --kv-transfer-config: cpu_bytes_to_use must be a whole "
                                   "number, got 1000000.5")
