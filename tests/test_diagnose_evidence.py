"""`diagnose` names a bug from what operators paste: fragments, old wordings, worker WARNINGs (no vLLM import).

Table-driven over the real logs in tests/data/logs and fragments cut from them, and over every
statement wording that kvdoctor/data/crash_statements.toml measured from the releases' own sources.
"""

from __future__ import annotations

import io
import json
from typing import NamedTuple

import pytest

from kvdoctor.diagnose.match import match_log
from kvdoctor.diagnose.reader import read_log, read_stream
from kvdoctor.diagnose.sites import load as load_sites
from kvdoctor.recipes.builtins import all_builtins

from .cli_runner import invoke
from .test_diagnose import LOGS, SYNTHETIC

RECIPES = all_builtins()
SITES = load_sites()
SCHED = "vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py"
K1_LINES = (LOGS / "vllm-51013-k1-tail.log").read_text().splitlines(keepends=True)
K7_LINES = (LOGS / "1cat-vllm-567-k7-frame-only.log").read_text().splitlines(keepends=True)
SYN = SYNTHETIC.splitlines(keepends=True)


def _match(text: str):
    summary = read_stream(io.BytesIO(text.encode()), "paste")
    return summary, match_log(summary, RECIPES)


def _bugs(result, strength: str | None = None) -> set[str]:
    return {c.recipe.bug for c in result.candidates if strength is None or c.strength == strength}


def _without(lines: list[str], *needles: str) -> str:
    return "".join(line for line in lines if not any(n in line for n in needles))


def _only(lines: list[str], needle: str) -> str:
    return "".join(line for line in lines if needle in line)


class Case(NamedTuple):
    text: str
    best: set[str]  # the bugs of the best strength
    strength: str
    why: str  # the start of the best candidate's `why`


OLD_K3 = ("    assert (\n        num_pending_gpu_blocks\n        <= sliding_window_size_in_blocks * block_size_factor\n"
          "    )\n")
ISSUE_FRAGMENT = ("offloading/scheduler.py, in _build_store_jobs\n"
                  "assert len(offload_keys) == len(offload_block_ids)\n"
                  "EngineCore encountered a fatal error.\n")
K12_WARNING = (
    "(EngineCore_DP0 pid=7) WARNING 08-04 09:41:00 [worker.py:116] Traceback (most recent call last):\n"
    '(EngineCore_DP0 pid=7) WARNING 08-04 09:41:00 [worker.py:116]   File "/x/vllm/v1/kv_offload/cpu/manager.py", '
    'line 145, in prepare_load\n'
    '(EngineCore_DP0 pid=7) WARNING 08-04 09:41:00 [worker.py:116]     assert block is not None, '
    'f"Block {key!r} not found in cache"\n'
    "(EngineCore_DP0 pid=7) WARNING 08-04 09:41:00 [worker.py:116] AssertionError: Block OffloadKey(hash=0x12) not "
    "found in cache\n")

CASES = {
    "51013 as pasted": Case("".join(K1_LINES), {"K1", "K6"}, "exact",
                            "exact: AssertionError, the statement and `_build_store_jobs`"),
    "51013 first frame removed": Case(_without(K1_LINES, "line 975, in _build_store_jobs"), {"K1", "K6"}, "strong",
                                      "strong: AssertionError and the statement"),
    "51013 only the assert line": Case(_only(K1_LINES, "assert len("), {"K1", "K6"}, "strong",
                                       "strong: the statement alone"),
    "51013 only the function line": Case(_only(K1_LINES, "in _build_store_jobs"), {"K1", "K6"}, "weak",
                                         "weak: `_build_store_jobs` alone"),
    "synthetic full": Case(SYNTHETIC, {"K1", "K6"}, "exact", "exact: AssertionError, the statement"),
    "synthetic fatal line removed": Case(_without(SYN, "EngineCore encountered a fatal"), {"K1", "K6"}, "exact",
                                         "exact: AssertionError, the statement"),
    "synthetic first frame removed": Case(_without(SYN, "line 1174, in schedule"), {"K1", "K6"}, "exact",
                                          "exact: AssertionError, the statement"),
    "synthetic header and prefixes removed": Case(
        "".join(line.split("] ", 1)[-1] for line in SYN if "Traceback" not in line and "EngineCore_DP0" in line),
        {"K1", "K6"}, "exact", "exact: AssertionError, the statement"),
    "the issue's 4-line fragment": Case(ISSUE_FRAGMENT, {"K1", "K6"}, "strong",
                                        "strong: the statement and `_build_store_jobs`"),
    "567 as pasted": Case("".join(K7_LINES), {"K7"}, "strong",
                          "strong: AssertionError, one line of the statement and `update_state_after_alloc`"),
    "567 statement line and exception, no frame": Case(
        "assert (\n" + _only(K7_LINES, "num_locally_computed_tokens") + "AssertionError\n", {"K7"}, "moderate",
        "moderate: AssertionError and one line of the statement"),
    "567 only the function line": Case(_only(K7_LINES, "in update_state_after_alloc"), {"K3", "K7"}, "weak",
                                       "weak: `update_state_after_alloc` alone"),
    "older K3 wording in its frame": Case(
        f'  File "{SCHED}", line 812, in update_state_after_alloc\n{OLD_K3}AssertionError\n', {"K3"}, "strong",
        "strong: AssertionError, the statement and `update_state_after_alloc` (renamed wording)"),
    "older K3 wording alone": Case(OLD_K3, {"K3"}, "moderate", "moderate: the statement alone (renamed wording)"),
    "K12 in a worker WARNING traceback": Case(K12_WARNING, {"K12"}, "exact",
                                              "exact: AssertionError, the statement and `prepare_load`"),
    "K12 exception line alone": Case("AssertionError: Block OffloadKey(hash=0x12) not found in cache\n", {"K12"},
                                     "strong", "strong: AssertionError and the assert's message"),
    "an issue title in prose": Case("The scheduler crashes with an `AssertionError` in `_build_store_jobs()` "
                                    "under a MultiConnector.\n", {"K1", "K6"}, "weak",
                                    "weak: AssertionError and `_build_store_jobs` (function named, no frame)"),
    # vllm-project/vllm#48959 as its reporter condensed it: a file line, a bare `AssertionError:`, then the
    # statement (an older release's names) without its `assert (`
    "48959 condensed": Case(f"{SCHED}\nAssertionError:\n    num_pending_gpu_blocks\n"
                            "    <= sliding_window_size_in_blocks * block_size_factor\n", {"K3"}, "moderate",
                            "moderate: AssertionError and the statement (renamed wording)"),
    "the statement as the exception's message": Case(
        "AssertionError: num_pending_gpu_blocks <= sliding_window_size_in_blocks * block_size_factor\n", {"K3"},
        "moderate", "moderate: AssertionError and the statement (renamed wording)"),
    # vllm-project/vllm#55503's title: the assert in parentheses in prose
    "55503 title": Case("[Bug]: OffloadingConnector multi-tier + MTP crashes EngineCore in _build_store_jobs "
                        "(assert len(offload_keys) == len(offload_block_ids))\n", {"K1", "K6"}, "strong",
                        "strong: the statement and `_build_store_jobs`"),
    # Python 3.13 prints every line of a multi-line statement, with `...<N lines>...` for a gap: the lines it
    # shows are pieces of the statement, never a whole other statement
    "a Python 3.13 traceback with a gap": Case(
        f'Traceback (most recent call last):\n  File "/x/{SCHED}", line 822, in update_state_after_alloc\n'
        "    assert (\n           ^\n        num_pending_gpu_blocks\n        ^^^^^^^^^^^^^^^^^^^^^^\n"
        "    ...<2 lines>...\n    )\n    ^\nAssertionError\n", {"K3"}, "strong",
        "strong: AssertionError, one line of the statement and `update_state_after_alloc`"),
    "condensed frame form": Case(f"{SCHED}:975 in _build_store_jobs\n    assert len(offload_keys) == "
                                 f"len(offload_block_ids)\nAssertionError\n", {"K1", "K6"}, "exact",
                                 "exact: AssertionError, the statement and `_build_store_jobs`"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_fragments_name_the_bug_with_the_stated_strength(name):
    case = CASES[name]
    _, result = _match(case.text)
    assert set(result.best_bugs) == case.best, [c.why for c in result.candidates]
    best = result.best[0]
    assert best.strength == case.strength
    assert best.why.startswith(case.why), best.why
    assert best.reasons  # the why, item by item


def test_prose_naming_a_function_alone_is_no_crash_and_a_quoted_unknown_assert_is_one():
    summary, result = _match("We call `update_state_after_alloc()` here; everything is fine.\n")
    assert not summary.holds_crash and not result.candidates
    summary, result = _match("OffloadingConnector crashes with `assert not req_status.transfer_jobs` when a "
                             "preempted request is re-admitted\n")
    assert summary.holds_crash and not result.candidates


def test_k7_line_rules_out_k3_with_a_reason():
    _, result = _match("".join(K7_LINES))
    (k3,) = [r for r in result.ruled_out if r.bug == "K3"]
    assert "a line of another statement: `num_locally_computed_tokens`" in k3.reason


def test_the_older_k3_wording_says_which_release_it_is_renamed_from():
    _, result = _match(f'  File "{SCHED}", line 812, in update_state_after_alloc\n{OLD_K3}AssertionError\n')
    (k3,) = [c for c in result.candidates]
    assert "renamed: vLLM 0.26.0 writes it `assert (num_pending_gpu_blocks <= group_config." in k3.reasons[0]
    # K7's statement has the same shape (`x <= y * z`) about other things: ruled out, said why
    assert any(r.bug == "K7" and "another statement" in r.reason for r in result.ruled_out)


# -- every wording the releases' own sources write -----------------------------------------------------

WORDINGS = sorted({(s.bug, s.exception, s.function, s.file, s.statement, s.reached)
                   for s in SITES if s.statement}, key=str)


def test_the_data_covers_every_crash_bug_on_every_measured_release():
    crash_bugs = {r.bug for r in RECIPES if r.signature.exception}
    from kvdoctor.releases import KNOWN_RELEASES

    releases = {s.release for s in SITES}
    assert releases == set(KNOWN_RELEASES)  # every release in range, measured from its installed source
    for release in releases:
        assert {s.bug for s in SITES if s.release == release} == crash_bugs, release


@pytest.mark.parametrize("wording", WORDINGS, ids=lambda w: f"{w[0]}-{w[2]}-{w[4][:40]}")
def test_each_releases_wording_names_its_bug(wording):
    bug, exception, function, file, statement, reached = wording
    indented = "".join("    " + line + "\n" for line in statement.splitlines())
    traceback = (f'Traceback (most recent call last):\n  File "/x/{file}", line 1, in {function}\n'
                 f"{indented}{exception}\n")
    _, result = _match(traceback)
    assert bug in result.best_bugs, [c.why for c in result.candidates]
    (mine,) = {c.strength for c in result.candidates if c.recipe.bug == bug}
    # a wording no kvdoctor run reached on any release counts one level lower
    assert mine == ("exact" if reached or _reached_elsewhere(bug, statement) else "strong")
    if statement.startswith("assert"):  # a loose line is read as a statement when it is an assert
        _, alone = _match(statement + "\n")
        assert bug in {c.recipe.bug for c in alone.candidates}


def _reached_elsewhere(bug: str, statement: str) -> bool:
    return any(s.reached for s in SITES if s.bug == bug and s.statement == statement)


# -- a crash no known bug matches, and no crash ------------------------------------------------------

UNKNOWN = ('Traceback (most recent call last):\n'
           f'  File "/opt/v/lib/python3.12/site-packages/{SCHED}", line 420, in update_state_after_alloc\n'
           '    assert not req_status.transfer_jobs\n'
           'AssertionError\n')


def test_an_unknown_assert_in_the_offloading_scheduler_is_an_unnamed_crash():
    from kvdoctor.diagnose.app import diagnose

    report = diagnose(UNKNOWN, run=False)  # a pasted text of several lines, not a path
    assert report.summary.source == "pasted text"
    assert report.match.candidates == [] and report.unnamed_crash
    assert int(report.exit_status) == 7
    nearest = {r.bug: r.reason for r in report.match.nearest}
    assert set(nearest) >= {"K3", "K7"}  # the same exception in the same function, another statement
    assert "another statement: `assert not req_status.transfer_jobs`" in nearest["K3"]
    from kvdoctor.report.diagnose import match_lines

    text = "\n".join(match_lines(report))
    assert "a crash no known bug matches: AssertionError in update_state_after_alloc" in text
    assert "nearest known bugs, and why they are ruled out:" in text and "--write-recipe" in text


def test_cli_unknown_assert_exits_7_and_a_log_without_a_crash_0(tmp_path):
    proc = invoke("diagnose", UNKNOWN, "--json")
    assert proc.returncode == 7, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["unnamed_crash"] is True and doc["exit_code"] == 7
    assert {r["bug"] for r in doc["ruled_out"]} >= {"K3", "K7"}
    quiet = tmp_path / "quiet.log"
    quiet.write_text("(APIServer pid=1) INFO 08-04 09:40:01 [api_server.py:1] vLLM API server version 0.26.0\n"
                     "(APIServer pid=1) INFO:     10.0.0.1:5000 - \"POST /v1/completions HTTP/1.1\" 200 OK\n"
                     "Error: nothing went wrong, this is prose\n")
    proc = invoke("diagnose", str(quiet))
    assert proc.returncode == 0, proc.stdout
    assert "no engine crash found in this log" in proc.stdout


def test_a_warning_traceback_the_process_survived_is_no_crash_unless_it_is_a_known_bug():
    from kvdoctor.diagnose.app import diagnose

    warning = ("(EngineCore_DP0 pid=7) WARNING 08-04 09:41:00 [worker.py:116] Traceback (most recent call last):\n"
               '(EngineCore_DP0 pid=7) WARNING 08-04 09:41:00 [worker.py:116]   File "/x/vllm/v1/kv_offload/worker/'
               'worker.py", line 114, in transfer_async\n'
               "(EngineCore_DP0 pid=7) WARNING 08-04 09:41:00 [worker.py:116] ConnectionResetError: peer\n")
    report = diagnose(warning + "(APIServer pid=1) INFO 08-04 09:41:01 [loggers.py:271] Engine 000: ok\n", run=False)
    assert not report.summary.holds_crash and int(report.exit_status) == 0
    report = diagnose(K12_WARNING + "(APIServer pid=1) INFO 08-04 09:41:01 [loggers.py:271] ok\n", run=False)
    assert report.match.best_bugs == ["K12"]  # a known bug's crash site, even where the worker went on


def test_a_fragment_without_a_whole_traceback_gets_a_starting_recipe():
    from kvdoctor.diagnose.app import diagnose
    from kvdoctor.recipes.loader import load_recipe_text

    report = diagnose("vllm/v1/core/sched/scheduler.py, in _mamba_block_aligned_split\n"
                      "assert num_external_computed_tokens == 0\nEngineCore encountered a fatal error.\n", run=False)
    assert int(report.exit_status) == 7
    recipe = load_recipe_text(report.starting_recipe, "start.toml")
    assert (recipe.signature.exception, recipe.signature.function) == ("AssertionError", "_mamba_block_aligned_split")


# -- the fixing release ---------------------------------------------------------------------------------

def test_the_fixing_release_is_in_text_json_and_report():
    from kvdoctor.diagnose.app import diagnose
    from kvdoctor.matrix.known import fixed_in
    from kvdoctor.report.diagnose import diagnose_document, match_lines, render_diagnose_markdown

    # what the release-outcomes data says (kvdoctor's own matrix runs), looked up by recipe name
    k1 = fixed_in("queued-abort")
    k6 = fixed_in("offload-keys-lag-blocks")
    assert (k1.release, k1.last_reproducing) == ("0.27.0", "0.26.0")
    assert (k6.release, k6.last_reproducing) == ("0.30.0", "0.29.0")
    report = diagnose(str(LOGS / "vllm-51013-k1-tail.log"), run=False)
    text = "\n".join(match_lines(report))
    assert "fixed in vLLM 0.27.0; last reproducing 0.26.0" in text
    assert "fixed in vLLM 0.30.0; last reproducing 0.29.0" in text
    doc = diagnose_document(report)
    fixes = {m["bug"]: (m["fixed_in"], m["last_reproducing"]) for m in doc["matches"]}
    assert fixes == {"K1": ("0.27.0", "0.26.0"), "K6": ("0.30.0", "0.29.0")}
    assert "fixed in vLLM 0.27.0; last reproducing 0.26.0" in render_diagnose_markdown(report)


def test_cli_pasted_text_argument_and_stdin_read_the_same(tmp_path):
    pasted = invoke("diagnose", ISSUE_FRAGMENT, "--no-run", "--json")
    assert pasted.returncode == 0, pasted.stderr
    piped = invoke("diagnose", "-", "--no-run", "--json", stdin=ISSUE_FRAGMENT)
    a, b = json.loads(pasted.stdout), json.loads(piped.stdout)
    assert a["log"]["source"] == "pasted text" and b["log"]["source"] == "-"
    assert a["matches"] == b["matches"] and {m["bug"] for m in a["matches"]} == {"K1", "K6"}
    assert a["matches"][0]["why"] == "strong: the statement and `_build_store_jobs`"
    # a one-line argument is still a path
    assert invoke("diagnose", str(tmp_path / "nope.log")).returncode == 2


def test_progress_is_written_on_a_terminal_only():
    """diagnose hands `Progress.update` to the application (cli/diagnose_cmd.py) only when it draws."""
    from kvdoctor.cli.progress import Progress

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    with Progress("diagnose", stream=Terminal()) as progress:
        assert progress.enabled
        progress.update("queued-abort (K1): installed logic, the recipe's geometry")
        drawn = progress.stream.getvalue()
    assert "queued-abort (K1): installed logic" in drawn
    piped = Progress("diagnose", stream=io.StringIO())
    assert piped.enabled is False


def test_the_real_logs_hold_a_crash_or_not():
    for path in sorted(LOGS.glob("*.log")):
        summary = read_log(str(path))
        assert summary.holds_crash is (path.name != "vllm-24162-banner-args-no-crash.log"), path.name
