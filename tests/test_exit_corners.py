"""Exit codes earned in every corner: closed pipes, full disks, errors under --json.

Each case runs kvdoctor as a subprocess through a real shell pipe and reads the
exit code from bash's PIPESTATUS, as a script calling kvdoctor would.
"""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from kvdoctor import SCHEMA_VERSION

from .conftest import KVDOCTOR, ROOT, run_cli

needs_dev_full = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full on this system")


def piped(args: list[str], reader: str, tmp_path: Path) -> tuple[int, str, str]:
    """`kvdoctor ARGS | READER` in bash: kvdoctor's own exit code, what READER printed, kvdoctor's stderr."""
    err = tmp_path / "stderr.txt"
    command = " ".join(shlex.quote(a) for a in [*KVDOCTOR, *args])
    script = f'{command} 2>{shlex.quote(str(err))} | {reader}; echo "kvdoctor-rc=${{PIPESTATUS[0]}}"'
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
    match = re.search(r"kvdoctor-rc=(\d+)\s*$", proc.stdout)
    assert match, (proc.stdout, proc.stderr)
    return int(match.group(1)), proc.stdout[:match.start()], err.read_text()


def test_no_private_typer_or_click_module_is_imported():
    """`typer._click` moved between typer releases: an `except` naming it raised inside itself."""
    private = re.compile(r"\btyper\._click\b|\bclick\._")
    hits = [f"{path.relative_to(ROOT)}:{n}" for path in (ROOT / "kvdoctor").rglob("*.py")
            for n, line in enumerate(path.read_text().splitlines(), 1) if private.search(line)]
    assert hits == []


def test_error_into_a_closed_pipe_keeps_its_code(tmp_path):
    """`repro nosuch --json | true`: the usage error's 2, one line, not 1 ("reproduced") with tracebacks."""
    code, _, stderr = piped(["repro", "nosuch", "--json"], "true", tmp_path)
    assert code == 2, stderr
    assert "Traceback" not in stderr
    assert stderr.strip().splitlines() == [stderr.strip()] and "unknown recipe 'nosuch'" in stderr


def closed_stderr(args: list[str], how: str) -> int:
    """`kvdoctor ARGS` with stderr closed: `2>&1 | true` (its reader gone) or `2>&-` (no stderr at all)."""
    command = " ".join(shlex.quote(a) for a in [*KVDOCTOR, *args])
    script = (f'{command} 2>&1 | true; echo "kvdoctor-rc=${{PIPESTATUS[0]}}"' if how == "pipe"
              else f'{command} 2>&-; echo "kvdoctor-rc=$?"')
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
    match = re.search(r"kvdoctor-rc=(\d+)\s*$", proc.stdout)
    assert match, (proc.stdout, proc.stderr)
    return int(match.group(1))


@pytest.mark.parametrize("how", ["pipe", "closed"])
@pytest.mark.parametrize("args", [
    ["repro", "queued-abort", "--block-size", "0"],  # kvdoctor's own usage error: was 0 (5/5 runs)
    ["repro", "queued-abort", "--bogus"],  # click's: was 1, "reproduced"
    ["repro", "nosuch", "--json"],
])
def test_a_usage_error_into_a_closed_stderr_keeps_its_2(args, how):
    """The one line cannot be shown; the code that says what happened still can."""
    assert closed_stderr(args, how) == 2


def test_a_run_into_a_closed_stderr_keeps_its_verdict():
    """vLLM's import chatter and kvdoctor's notes go to a closed stderr: the verdict's code stays (0.26.0:
    1, reproduced; later releases 0), never 5 or a traceback's 1 from the write that failed."""
    code = closed_stderr(["repro", "queued-abort", "--worker", "simulated", "--logic", "installed"], "pipe")
    assert code in (0, 1)
    assert code == run_cli("repro", "queued-abort", "--worker", "simulated", "--logic", "installed").returncode


@pytest.mark.parametrize("args, reader", [
    (["repro", "--list"], "head -1"),
    (["repro", "--list"], "true"),
    (["repro", "--list", "--json"], "head -c 10"),
    (["--help"], "true"),
])
def test_a_reader_closing_stdout_early_is_not_a_failure(args, reader, tmp_path):
    code, shown, stderr = piped(args, reader, tmp_path)
    assert code == 0, stderr
    assert stderr == ""
    if reader == "head -1":
        assert shown.startswith("built-in recipes")


@pytest.mark.parametrize("args, fragment", [
    (["diagnose", "/nonexistent.log", "--json"], "no such file"),
    (["matrix", "queued-abort", "--vllm", "9.9.9", "--json"], "is not a vLLM release in range"),
    (["repro", "queued-abort", "--bogus", "--json"], "No such option: --bogus"),
    (["repro", "queued-abort", "--block-size", "x", "--json"], "--block-size"),
    (["audit", "--json", "--logic", "fixed"], "No such option: --logic"),
])
def test_errors_under_json_print_one_error_document(args, fragment, tmp_path):
    code, shown, stderr = piped(args, "cat", tmp_path)
    assert code == 2, stderr
    assert "Traceback" not in stderr
    assert len(stderr.strip().splitlines()) == 1 and fragment in stderr
    document = json.loads(shown)  # exactly one document: json.loads refuses trailing text
    assert document["schema_version"] == SCHEMA_VERSION
    assert document["error"]["kind"] == "usage_error"
    assert fragment in document["error"]["message"]
    assert document["error"]["exit_code"] == 2


@needs_dev_full
@pytest.mark.parametrize("args", [
    ["repro", "queued-abort", "--worker", "simulated", "--logic", "installed"],  # was 5, "a bug in kvdoctor"
    ["repro", "queued-abort", "--worker", "simulated", "--logic", "installed", "--json"],
    ["repro", "--list"],
    ["--help"],  # click's own write: was a traceback and 1
    ["--version"],
])
def test_stdout_to_a_full_disk_is_exit_2_named(args):
    """`> /dev/full` is no reader gone away: the output asked for is not there (2, one line), and not
    kvdoctor's own failure (5)."""
    command = " ".join(shlex.quote(a) for a in [*KVDOCTOR, *args])
    proc = subprocess.run(["bash", "-c", f"{command} > /dev/full"], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1:] == ["kvdoctor: error: stdout: No space left on device"]
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr


@needs_dev_full
def test_export_script_to_a_full_disk_is_exit_2():
    proc = run_cli("repro", "queued-abort", "--export-script", "/dev/full")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == "kvdoctor: error: --export-script /dev/full: No space left on device"


@needs_dev_full
def test_report_and_svg_to_a_full_disk_exit_2_after_the_verdict(tmp_path):
    """The run happens and its verdict is printed; the files that could not be written are named, exit 2."""
    code, shown, stderr = piped(["repro", "queued-abort", "--worker", "simulated", "--logic", "installed",
                                 "--report", "/dev/full", "--svg", "/dev/full"], "cat", tmp_path)
    assert code == 2, stderr
    assert "Traceback" not in stderr
    assert re.search(r"^installed\s+(reproduced|not_reproduced)\b", shown, re.M), shown  # the verdict table
    assert stderr.strip().splitlines()[-2:] == [
        "kvdoctor: error: --svg /dev/full: No space left on device",
        "kvdoctor: error: --report /dev/full: No space left on device"]


@needs_dev_full
def test_report_to_a_full_disk_under_json_keeps_the_one_result_document(tmp_path):
    code, shown, stderr = piped(["repro", "queued-abort", "--worker", "simulated", "--logic", "installed",
                                 "--report", "/dev/full", "--json"], "cat", tmp_path)
    assert code == 2, stderr
    document = json.loads(shown)  # the verdict's document, and no second (error) document after it
    assert document["results"][0]["outcome"] in ("reproduced", "not_reproduced")  # per release
    assert "error" not in document
    assert stderr.strip().splitlines()[-1] == "kvdoctor: error: --report /dev/full: No space left on device"


def test_explore_that_ran_no_example_is_inconclusive(tmp_path):
    """A budget spent before the first example: nothing tested is not "nothing found" (was 0), one line."""
    proc = run_cli("explore", "--time-budget", "0.001", "--no-triage", "--out", str(tmp_path / "found"))
    assert proc.returncode == 6, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "kvdoctor: explore: 0 examples ran in --time-budget 0.001 s (after vLLM's import): nothing was tested; "
        "give it a longer --time-budget"]
    assert "no example ran: nothing tested" in proc.stdout


def test_explore_budget_starts_after_vllms_import(tmp_path):
    """`--time-budget 5` ran 0 examples: vLLM's import (6 s, far more under load) spent it. Now the import
    is not counted: examples run, and the code is a search's (0 nothing found, 1 found), never 6."""
    proc = run_cli("explore", "--time-budget", "3", "--max-examples", "3", "--no-triage", "--json",
                   "--out", str(tmp_path / "found"))
    assert proc.returncode in (0, 1), proc.stderr
    document = json.loads(proc.stdout)
    assert document["examples"] >= 1, document


@pytest.mark.parametrize("workers", ["1000", str(2**70)])
def test_explore_workers_beyond_the_machine_are_refused_before_anything_starts(workers, tmp_path):
    """`--workers 1000` started 1000 vLLM imports (load 305, the OOM killer): now one line, exit 2, fast,
    with no worker started, no vLLM imported and no --out folder made."""
    script = ("import sys, time\n"
              "from kvdoctor.cli.app import app\n"
              "start = time.monotonic()\n"
              f"code = app(args=['explore', '--workers', {workers!r}, '--out', {str(tmp_path / 'found')!r}], "
              "standalone_mode=False)\n"
              "print('rc', code, 'vllm' in sys.modules, round(time.monotonic() - start, 1))\n")
    proc = subprocess.run([KVDOCTOR[0], "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    code, imported, took = proc.stdout.split()[1:]
    assert (code, imported) == ("2", "False"), proc.stderr
    assert float(took) < 30
    line, = proc.stderr.strip().splitlines()
    assert line.startswith(f"kvdoctor: error: --workers {workers}: this machine has ") and "at most " in line
    assert not (tmp_path / "found").exists()


def test_workers_fit_cpus_and_memory():
    from kvdoctor.explore.app import WORKER_BYTES, usable_cpus, workers_refusal

    assert workers_refusal(1) is None
    assert workers_refusal(usable_cpus() + 1) is not None
    from kvdoctor.engine.memory import available_memory_bytes

    available = available_memory_bytes()
    if available is not None:
        assert workers_refusal(available // WORKER_BYTES + 1) is not None


def test_a_recipe_the_core_level_cannot_play_is_inconclusive():
    """`repro withheld-hashes-lookup --engine core`: every logic not_applicable (EngineCore cannot withhold
    block hashes), exit 0, though the bug reproduces here at the scheduler level. The run did not test it:
    6, and one line saying what to do."""
    proc = run_cli("repro", "withheld-hashes-lookup", "--engine", "core")
    assert proc.returncode == 6, proc.stderr
    assert re.search(r"^installed\s+not_applicable", proc.stdout, re.M), proc.stdout
    assert proc.stderr.strip().splitlines()[-1] == (
        "kvdoctor: not tested: --engine core cannot play its delay_block_hashes, release_block_hashes step(s); "
        "the bug may still be in this vLLM (run it at --engine scheduler, the default)")


@pytest.mark.parametrize("columns", ["0", "-5", "3", "abc"])
def test_a_nonsense_width_is_the_default_80(columns):
    """`COLUMNS=0 kvdoctor audit` lost all its text (rich took the 0 at its word): a width that is no
    width (<= 0, tiny, not a number) is 80."""
    from kvdoctor.cli.streams import DEFAULT_WIDTH, Environment

    from .cli_runner import invoke

    assert Environment(env={"COLUMNS": columns}).width() == DEFAULT_WIDTH
    proc = invoke("repro", "--list", env={"COLUMNS": columns})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("built-in recipes") and len(lines) >= 15
    assert max(len(line) for line in lines) <= DEFAULT_WIDTH
    assert any(len(line) > 60 for line in lines)  # drawn at 80, not squeezed into 3 columns


def test_a_sane_width_is_kept():
    from kvdoctor.cli.streams import Environment

    assert Environment(env={"COLUMNS": "120"}).width() == 120
    assert Environment(env={}).width() is None  # no $COLUMNS: the terminal (or rich's 80) decides


@pytest.mark.parametrize("line, message", [
    ("gpu_blocks = 4000001", "[setup] gpu_blocks 4000001: kvdoctor simulates pools up to 4,000,000 blocks"),
    ("gpu_blocks = 99999999999999999999999", "[setup] gpu_blocks must fit in 64 bits"),
    ("gpu_blocks = -99999999999999999999999", "[setup] gpu_blocks must fit in 64 bits"),
])
def test_recipe_integers_beyond_what_runs_are_refused_at_their_line(line, message):
    """An int past int64 got past the loader; `gpu_blocks = 4000001` was refused naming
    --num-gpu-blocks-override, a flag the user never gave, without file:line. Now the recipe key, at its line."""
    from kvdoctor.errors import RecipeError
    from kvdoctor.recipes.loader import load_recipe_text

    source = (ROOT / "repros" / "queued-abort.toml").read_text()
    text = source.replace("gpu_blocks = 8", line, 1)
    at = text.splitlines().index(line) + 1
    with pytest.raises(RecipeError) as caught:
        load_recipe_text(text, "big.toml")
    assert str(caught.value).startswith(f"big.toml:{at}: {message}"), str(caught.value)
    assert "--num-gpu-blocks-override" not in str(caught.value) and len(str(caught.value)) < 200


def test_a_step_integer_past_int64_is_refused_at_its_line():
    from kvdoctor.errors import RecipeError
    from kvdoctor.recipes.loader import load_recipe_text

    source = (ROOT / "repros" / "queued-abort.toml").read_text()
    text = source.replace("max_tokens = 8", f"max_tokens = {2**64}", 1)
    at = text.splitlines().index(f"max_tokens = {2**64}") + 1
    with pytest.raises(RecipeError, match=rf"^x.toml:{at}: .*max_tokens must fit in 64 bits"):
        load_recipe_text(text, "x.toml")


def test_repro_list_json_names_kvdoctors_version():
    from kvdoctor import __version__

    from .cli_runner import invoke

    proc = invoke("repro", "--list", "--json")
    assert proc.returncode == 0, proc.stderr
    document = json.loads(proc.stdout)
    assert document["kvdoctor_version"] == __version__ and document["schema_version"] == SCHEMA_VERSION


@pytest.mark.parametrize("name", ["a" * 100_000, "a\nb" * 2000])
def test_a_huge_unknown_name_is_shown_cut_on_one_line(name):
    """A 100 KB argument was echoed whole (and one too long for a file name was kvdoctor's own failure, 5)."""
    from .cli_runner import invoke

    proc = invoke("repro", name)
    assert proc.returncode == 2, proc.stderr
    line, = proc.stderr.strip().splitlines()
    assert line.startswith("kvdoctor: error: unknown recipe '") and f"({len(name):,} characters)" in line
    assert len(line) < 1000


def test_a_huge_recipe_name_is_refused_at_its_line(tmp_path):
    """A recipe file whose [recipe] name was 2 MB printed 60,734 lines (the name heads every report)."""
    from .cli_runner import invoke

    source = (ROOT / "repros" / "queued-abort.toml").read_text()
    path = tmp_path / "big-name.toml"
    path.write_text(source.replace('name = "queued-abort"', 'name = "' + "ab " * 700_000 + '"', 1))
    proc = invoke("repro", str(path), "--worker", "simulated")
    assert proc.returncode == 2, proc.stderr[:500]
    line, = proc.stderr.strip().splitlines()
    assert "big-name.toml:3: [recipe] name must be one line of at most 100 characters" in line and len(line) < 400
    assert proc.stdout == ""


def test_matrix_progress_never_shows_none():
    """The run task has no total (bisect picks releases as it goes): its count read "0/None"."""
    import io

    from rich.console import Console

    from kvdoctor.cli.matrix_cmd import _Display, count_text
    from kvdoctor.matrix.runner import Cell

    assert count_text(0, None) == "0 done" and count_text(3, 8) == "3/8"
    display = _Display()
    display.console = Console(file=io.StringIO(), force_terminal=True, width=100)
    display.live = True
    with display:
        callbacks = display.callbacks()
        callbacks.building("0.26.0", 0, 2)
        callbacks.running("0.26.0", "queued-abort")
        display.progress.refresh()
        callbacks.ran(Cell(release="0.26.0", recipe="queued-abort", outcome="reproduced"))
        display.progress.refresh()
    shown = display.console.file.getvalue()
    assert "None" not in shown and "1 done" in shown and "0/2" in shown, shown


def test_a_line_written_under_a_progress_line_starts_on_a_cleared_line():
    """`--engine serve` printed its child-PID note onto the progress line ("repro  4s kvdoctor: `vllm serve`
    child PID ..."): the process's stderr clears a drawn progress line before anyone else's text."""
    import io

    from kvdoctor.cli.progress import Progress
    from kvdoctor.cli.streams import CLEAR_LINE, QuietWhenClosed

    terminal = io.StringIO()
    stderr = QuietWhenClosed(terminal)
    with Progress("repro", total=3, stream=stderr, enabled=True) as progress:
        progress.update("queued-abort", done=0)
        print("kvdoctor: `vllm serve` child PID 1234 on 127.0.0.1:8000", file=stderr, flush=True)
    shown = terminal.getvalue()
    before, _, _ = shown.partition("kvdoctor: `vllm serve`")
    assert before.endswith(CLEAR_LINE), repr(shown)  # the note starts on a cleared line at column 0
    assert "repro  1/3  queued-abort" in before


def test_an_exception_without_a_message_has_no_empty_heading():
    """A bare `assert` in vLLM: "AssertionError: " with nothing after it; now the name alone."""
    from types import SimpleNamespace

    from rich.console import Console

    from kvdoctor.report.tables import failure_panel

    failure = SimpleNamespace(exception="AssertionError", message="", file="vllm/x.py", line=9, function="f",
                              code="assert a", vllm_frames=[])
    console = Console(width=80, record=True, file=io.StringIO())
    console.print(failure_panel(SimpleNamespace(failure=failure, failure_step=3, logic="installed")))
    text = console.export_text()
    assert "AssertionError" in text and "AssertionError:" not in text, text


def test_version_probe_lines_wrap_at_the_width():
    """Probe answers ran to 84-102 columns at 80: wrapped, each continuation under its answer."""
    from types import SimpleNamespace

    from kvdoctor.report.version import version_text

    probe = SimpleNamespace(name="storable_chunks-signature", holds=True,
                            answer="storable_chunks(group_config, num_offloadable_tokens) and a long tail of words")
    report = SimpleNamespace(kvdoctor="0.1.0", vllm="0.26.0", torch="2.11.0", platform="Linux",
                             python="3.11.7 (/opt/a/virtual/environment/bin/python3.11) " + "word " * 12,
                             problem=None, note=None, probes=[probe])
    for width in (80, 60):
        lines = version_text(report, width).splitlines()
        assert max(len(line) for line in lines) <= width, lines
        at = lines.index(next(line for line in lines if "storable_chunks-signature" in line))
        assert lines[at + 1].startswith(" " * 20) and lines[at + 1].strip(), lines


@pytest.mark.vllm
def test_version_shows_progress_on_a_terminal(api):
    """`version` took ~19 s with nothing on the screen: a progress line on a terminal, none elsewhere."""
    from .cli_runner import invoke

    shown = invoke("version", stderr_isatty=True)
    assert shown.returncode == 0, shown.stderr
    assert "version" in shown.stderr and "importing vLLM" in shown.stderr
    assert invoke("version").stderr == ""


def test_ctrl_c_in_explore_says_what_was_kept_and_where(tmp_path, monkeypatch):
    """Ctrl-C in explore said nothing of the findings already written: now one line, how many and where,
    exit 130 (a finding is written as soon as it is shrunk, before an interrupt can lose it)."""
    from types import SimpleNamespace

    import kvdoctor.explore.app as explore_app
    import kvdoctor.explore.search as search_module
    from kvdoctor.engine import compat

    from .cli_runner import invoke

    written: list[str] = []
    finding = SimpleNamespace(signature="AssertionError in f", key="AssertionError in f", label="AssertionError in f",
                              steps=3, elapsed_s=1.0)

    def interrupted_search(config, on_progress=None, on_finding=None, api=None, pool=None, **_):
        on_finding(finding)  # written at once, as the real search does
        raise KeyboardInterrupt

    monkeypatch.setattr(explore_app, "write_findings",  # the name explore's application writes through
                        lambda found, out: written.extend(f.signature for f in found))
    monkeypatch.setattr(search_module, "explore", interrupted_search)
    monkeypatch.setattr(search_module, "warm_up", lambda api: None)
    monkeypatch.setattr(compat, "load", lambda: SimpleNamespace())
    out = tmp_path / "found"
    proc = invoke("explore", "--time-budget", "5", "--no-triage", "--out", str(out))
    assert proc.returncode == 130, proc.stderr
    assert written == ["AssertionError in f"]
    assert proc.stderr.strip().splitlines()[-1] == f"kvdoctor: error: interrupted: 1 finding(s) kept in {out}"


def test_wrapped_lines_keep_their_hanging_indent():
    """diagnose's and explore's indented lines wrapped to column 0 (plain rich Text): now under their indent."""
    from rich.console import Console

    from kvdoctor.report.layout import Hanging

    console = Console(width=40, record=True, file=io.StringIO())
    console.print(Hanging("    impact: " + "word " * 20, extra=8))
    console.print(Hanging("  short line"))
    lines = console.export_text().splitlines()
    assert lines[0].startswith("    impact: ") and len(lines) > 2
    assert all(line.startswith(" " * 12) and line.strip() for line in lines[1:-1]), lines
    assert lines[-1] == "  short line"
    assert max(len(line) for line in lines) <= 40


def test_diagnose_wraps_under_the_indent():
    """Wrapping at a narrow width makes no new line at column 0: every continuation is indented."""
    from .cli_runner import invoke

    log = ROOT / "tests" / "data" / "logs" / "vllm-51013-k1-tail.log"
    if not log.exists():
        pytest.skip("tests/data/logs has no K1 log")
    narrow = invoke("diagnose", str(log), "--no-run", columns=50).stdout.splitlines()
    wide = invoke("diagnose", str(log), "--no-run", columns=1000).stdout.splitlines()
    assert len(narrow) > len(wide)  # something wrapped
    flush_left = [[line for line in lines if line and not line.startswith(" ")] for lines in (narrow, wide)]
    assert [line.split()[0] for line in flush_left[0]] == [line.split()[0] for line in flush_left[1]]
