"""`kvdoctor diagnose` without vLLM: reading real and synthetic logs, matching, geometry, redaction, CLI."""

from __future__ import annotations

import io
from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple

import pytest

from kvdoctor.diagnose.logline import clean
from kvdoctor.diagnose.match import match_crash
from kvdoctor.diagnose.pyrepr import Unreadable, parse_repr
from kvdoctor.diagnose.reader import read_log, read_stream
from kvdoctor.diagnose.redact import redact_serve_args
from kvdoctor.engine.overrides import Overrides
from kvdoctor.engine.serve_args import SERVE_FLAGS, setup_overrides_from_serve_args
from kvdoctor.recipes.builtins import all_builtins
from kvdoctor.recipes.loader import load_recipe_text

from .cli_runner import invoke
from .conftest import ROOT

LOGS = ROOT / "tests" / "data" / "logs"
RECIPES = all_builtins()
K1 = {"queued-abort", "preemption", "prefetch"}
# Every recipe whose crash is `assert len(offload_keys) == len(offload_block_ids)` in _build_store_jobs
# via schedule -> build_connector_meta: K1's three paths and K6 (keys lagging blocks). A log alone cannot
# tell them apart; diagnose names both bugs and runs both.
SAME_ASSERT = K1 | {"offload-keys-lag-blocks"}

# A synthetic log in vLLM's formats (not from a thread): banner, args line with a secret, request lines,
# interleaved processes, colour codes, CRLF line ends, an elided engine traceback, then the API server's
# EngineDeadError re-raise. Its crash frames are those of the real #51013 log.
SYNTHETIC = (
    "\x1b[1;36m(APIServer pid=1)\x1b[0;0m INFO 08-04 09:40:01 [api_server.py:1896] vLLM API server version 0.26.0\r\n"
    "(APIServer pid=1) INFO 08-04 09:40:01 [utils.py:326] non-default args: {'model_tag': '/home/op/models/Qwen3-8B', "
    "'host': 'node-17.internal', 'api_key': ['sk-abcdefghijklmnop'], 'model': '/home/op/models/Qwen3-8B', "
    "'max_model_len': 32768, 'block_size': 16, 'num_gpu_blocks_override': 100000, "
    "'kv_transfer_config': KVTransferConfig(kv_connector='OffloadingConnector', engine_id='e1', kv_role='kv_both', "
    "kv_rank=None, kv_ip='10.1.2.3', kv_port=14579, kv_connector_extra_config={'cpu_bytes_to_use': 68719476736, "
    "'block_size': 64, 'root_dir': '/mnt/secret'}, kv_connector_module_path=None), 'async_scheduling': True, "
    "'max_num_seqs': 4, 'enable_chunked_prefill': True, 'served': <function f at 0x7f00>}\r\n"
    + "".join(f'(APIServer pid=1) INFO:     10.0.0.{i}:5000 - "POST /v1/completions HTTP/1.1" 200 OK\r\n'
              for i in range(20))
    + "(EngineCore_DP0 pid=7) ERROR 08-04 09:48:15 [core.py:1332] EngineCore encountered a fatal error.\r\n"
    "(EngineCore_DP0 pid=7) ERROR 08-04 09:48:15 [core.py:1332] Traceback (most recent call last):\r\n"
    '(EngineCore_DP0 pid=7) ERROR 08-04 09:48:15 [core.py:1332]   File "/usr/local/lib/python3.12/dist-packages/'
    'vllm/v1/core/sched/scheduler.py", line 1174, in schedule\r\n'
    "(EngineCore_DP0 pid=7) ERROR 08-04 09:48:15 [core.py:1332]     meta = self._build_kv_connector_meta(...)\r\n"
    '(APIServer pid=1) INFO:     10.0.0.99:5000 - "POST /v1/completions HTTP/1.1" 200 OK\r\n'
    "(EngineCore_DP0 pid=7) ERROR 08-04 09:48:15 [core.py:1332]   ...\r\n"
    '(EngineCore_DP0 pid=7) ERROR 08-04 09:48:15 [core.py:1332]   File "/usr/local/lib/python3.12/dist-packages/'
    'vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py", line 700, in build_connector_meta\r\n'
    "(EngineCore_DP0 pid=7) ERROR 08-04 09:48:15 [core.py:1332]     self._build_store_jobs(scheduler_output)\r\n"
    '(EngineCore_DP0 pid=7) ERROR 08-04 09:48:15 [core.py:1332]   File "/usr/local/lib/python3.12/dist-packages/'
    'vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py", line 975, in _build_store_jobs\r\n'
    "(EngineCore_DP0 pid=7) ERROR 08-04 09:48:15 [core.py:1332]     "
    "assert len(offload_keys) == len(offload_block_ids)\r\n"
    "(EngineCore_DP0 pid=7) ERROR 08-04 09:48:15 [core.py:1332]            "
    "^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\r\n"
    "(EngineCore_DP0 pid=7) ERROR 08-04 09:48:15 [core.py:1332] AssertionError\r\n"
    "(APIServer pid=1) ERROR 08-04 09:48:15 [async_llm.py:704] Traceback (most recent call last):\r\n"
    '(APIServer pid=1) ERROR 08-04 09:48:15 [async_llm.py:704]   File "/usr/local/lib/python3.12/dist-packages/'
    'vllm/v1/engine/async_llm.py", line 660, in output_handler\r\n'
    "(APIServer pid=1) ERROR 08-04 09:48:15 [async_llm.py:704] vllm.v1.engine.exceptions.EngineDeadError: "
    "EngineCore encountered an issue. See stack trace (above) for the root cause.\r\n"
)


def _read(text: str):
    return read_stream(io.BytesIO(text.encode()), "synthetic.log")


# -- the real logs kept under tests/data/logs -------------------------------------------------------------

class Real(NamedTuple):
    """What the reader must make of one real log (no vLLM needed)."""

    complete: bool | None  # the crash has its exception line; None: no crash traceback at all
    exception: str | None
    function: str | None  # innermost vLLM frame
    process: str | None  # process prefix of the crash
    version: str | None = None
    overrides: Mapping[str, object] = MappingProxyType({})  # geometry flags mapped from its serve arguments


REAL = {
    "vllm-51013-k1-tail.log": Real(True, "AssertionError", "_build_store_jobs", "EngineCore"),
    "vllm-43593-serve-cmd-cut.log": Real(False, None, "run_busy_loop", "EngineCore",
                                         overrides={"max_model_len": 196416, "cpu_bytes_to_use": 32 << 30}),
    "vllm-55503-mtp-cut.log": Real(False, None, "run_busy_loop", "EngineCore"),
    "vllm-52170-mixed-prefix-cut.log": Real(False, None, "run_busy_loop", "EngineCore"),
    "vllm-25856-caret-ansi-cut.log": Real(False, None, "run_busy_loop", "EngineCore_0"),
    "vllm-54914-bare-frames-cut.log": Real(False, None, "schedule", None),
    "1cat-vllm-567-k7-frame-only.log": Real(True, "AssertionError", "update_state_after_alloc", None),
    "1cat-vllm-397-mamba-split-summary.log": Real(True, "AssertionError", "_mamba_block_aligned_split", None),
    # unprefixed frames under the engine's prefixed fatal-error line are the engine's
    "vllm-45268-unprefixed-frames-cut.log": Real(False, None, "_mamba_block_aligned_split", "EngineCore"),
    "vllm-52816-cuda-error-tail.log": Real(True, "AcceleratorError", "get_output", "EngineCore"),
    # the engine's traceback stops at its header: the API server's re-raise is all there is
    "vllm-18572-stamped-reraise-then-cut.log": Real(None, None, None, None),
    "vllm-24162-banner-args-no-crash.log": Real(None, None, None, None, version="0.10.2.dev378+g4d7fe40fc.d20250829"),
    "vllm-44780-dump-input-banner-cut.log": Real(None, None, None, None, version="0.22.0"),
}

# The known bugs the built-in recipes (K1-K12, every one now has one) name for each real log; no real log
# here carries the crash of K2, K3, K8 or K12, and K4, K5, K9, K11 are silent. 1cat-vllm-567 carries
# K7's signature (mamba-align-midblock-hit-load): its source line is one line of the multi-line assert,
# which confirms and never contradicts. A log without a complete crash names nothing whatever the recipes.
MATCHES: dict[str, set[str]] = {name: set() for name in REAL} | {"vllm-51013-k1-tail.log": {"K1", "K6"},
                                                                 "1cat-vllm-567-k7-frame-only.log": {"K7"}}


def test_every_real_log_is_in_the_tables():
    assert sorted(REAL) == sorted(p.name for p in LOGS.glob("*.log"))


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_logs(name):
    want = REAL[name]
    summary = read_log(str(LOGS / name))
    assert summary.version == want.version
    assert setup_overrides_from_serve_args(summary.serve_args).overrides.given() == want.overrides
    crash = summary.crash
    result = match_crash(crash, RECIPES)
    assert {c.recipe.bug for c in result.candidates} == MATCHES[name]
    if want.complete is None:
        assert crash is None
        return
    assert crash is not None
    assert crash.process == want.process
    assert crash.cut_short is not want.complete
    assert crash.exception == want.exception
    assert crash.vllm_frames[-1].function == want.function
    if not MATCHES[name]:
        assert ("no known bug matches" if want.complete else "cut short") in result.why_none


@pytest.mark.parametrize("name", sorted(REAL))
def test_reports_of_real_logs_quote_no_machine_paths(name):
    from kvdoctor.diagnose.app import diagnose
    from kvdoctor.report.diagnose import render_diagnose_markdown

    text = render_diagnose_markdown(diagnose(str(LOGS / name), run=False))
    for leak in ("/usr/local", "/opt/", "/mnt/", "/home/", "/data/", "/workspace", "10.116.", "192.168."):
        assert leak not in text


def test_51013_names_k1_by_its_three_paths_with_reasons():
    result = match_crash(read_log(str(LOGS / "vllm-51013-k1-tail.log")).crash, RECIPES)
    assert {c.recipe.name for c in result.best} == SAME_ASSERT
    assert result.best[0].recipe.name == "queued-abort"  # K1 before K6, then the simplest path
    first = result.best[0]
    assert first.why == "exact: AssertionError, the statement and `_build_store_jobs`"
    assert first.reasons[0].startswith("statement `assert len(offload_keys) == len(offload_block_ids)`: as vLLM "
                                       "0.26.0")
    assert "frame _build_store_jobs in offloading/scheduler.py (where the crash is raised)" in first.reasons
    assert first.gaps == ["the frames above it are not in the log"]  # the paste starts at that frame


def test_43593_command_line_geometry_and_the_reraise():
    summary = read_log(str(LOGS / "vllm-43593-serve-cmd-cut.log"))
    assert summary.args_source == "command line"
    assert summary.serve_args == {"model": "Qwen/Qwen3.5-4B", "max_model_len": "196416",
                                  "kv_offloading_backend": "native", "kv_offloading_size": "32"}
    assert summary.reraise_seen and not summary.crash.is_reraise
    mapped = setup_overrides_from_serve_args(summary.serve_args)
    assert mapped.overrides.given() == {"max_model_len": 196416, "cpu_bytes_to_use": 32 << 30}


def test_caret_notation_colour_codes_are_stripped():
    line = clean("^[[1;36m(EngineCore_0 pid=271)^[[0;0m ERROR 09-21 17:33:21 [core.py:714]   File \"x\", line 1, in f")
    assert (line.process, line.level, line.body) == ("EngineCore_0", "ERROR", '  File "x", line 1, in f')


# -- synthetic logs --------------------------------------------------------------------------------------

def test_synthetic_full_log():
    summary = _read(SYNTHETIC)
    assert (summary.version, summary.version_source) == ("0.26.0", "banner")
    assert summary.args_source == "non-default args"
    assert "api_key" not in summary.serve_args and "host" not in summary.serve_args
    crash = summary.crash
    assert (crash.process, crash.exception, crash.elided) == ("EngineCore_DP0", "AssertionError", True)
    assert [f.function for f in crash.vllm_frames] == ["schedule", "build_connector_meta", "_build_store_jobs"]
    assert summary.reraise_seen
    result = match_crash(crash, RECIPES)
    assert {c.recipe.name for c in result.best} == SAME_ASSERT
    assert "same caller chain (schedule → build_connector_meta → _build_store_jobs)" in result.best[0].reasons
    mapped = setup_overrides_from_serve_args(summary.serve_args)
    assert mapped.overrides.block_size == 16
    assert mapped.overrides.gpu_blocks == 100000
    assert mapped.overrides.offloaded_block_size == 64
    assert mapped.overrides.cpu_bytes_to_use == 64 << 30
    assert mapped.overrides.async_scheduling is True
    assert mapped.overrides.extra_connector_config is None  # root_dir stays in the deployment


def test_redaction_keeps_geometry_and_drops_secrets_paths_and_hosts():
    summary = _read(SYNTHETIC)
    shown = redact_serve_args(summary.serve_args)
    text = repr(shown)
    for secret in ("sk-", "/home", "node-17", "10.1.2.3", "14579", "/mnt/secret", "root_dir"):
        assert secret not in text
    assert shown["model"] == "Qwen3-8B"
    assert shown["kv_transfer_config"]["kv_connector_extra_config"] == {"cpu_bytes_to_use": 68719476736,
                                                                        "block_size": 64}


def test_the_engine_traceback_is_the_crash_not_the_api_servers_reraise():
    only_reraise = SYNTHETIC.split("(EngineCore_DP0 pid=7) ERROR 08-04 09:48:15 [core.py:1332] EngineCore")[0] + \
        SYNTHETIC.split("AssertionError\r\n", 1)[1]
    assert _read(only_reraise).crash is None  # the re-raise alone names no crash


def test_no_crash_and_empty_logs():
    assert _read("(APIServer pid=1) INFO:  started\n" * 50).crash is None
    assert _read("").crash is None
    assert match_crash(None, RECIPES).why_none == "no engine crash found in this log"


def test_a_pasted_traceback_alone_and_a_no_match_starting_recipe(tmp_path):
    paste = ('Traceback (most recent call last):\n'
             '  File "/opt/venv/lib/python3.12/site-packages/vllm/v1/core/sched/scheduler.py", line 610, in schedule\n'
             '    self.connector.update_state_after_alloc(request, blocks, n)\n'
             '  File "/opt/venv/lib/python3.12/site-packages/vllm/distributed/kv_transfer/kv_connector/v1/'
             'offloading/scheduler.py", line 420, in update_state_after_alloc\n'
             '    assert not req_status.transfer_jobs\n'
             'AssertionError\n')
    summary = _read(paste)
    assert summary.crash.exception == "AssertionError"
    assert match_crash(summary.crash, RECIPES).candidates == []
    from kvdoctor.diagnose.app import starting_recipe_toml

    recipe = load_recipe_text(starting_recipe_toml(summary, Overrides(block_size=16)), "start.toml")
    assert recipe.signature.exception == "AssertionError"
    assert recipe.signature.function == "update_state_after_alloc"
    assert recipe.signature.contains == "assert not req_status.transfer_jobs"
    assert recipe.signature.callers == ("schedule",)
    assert recipe.setup == {"block_size": 16}


def test_a_different_assertion_in_the_same_function_does_not_match():
    text = SYNTHETIC.replace("assert len(offload_keys) == len(offload_block_ids)", "assert job_id not in self._jobs")
    assert match_crash(_read(text).crash, RECIPES).candidates == []


def test_over_long_lines_and_binary_junk_are_read_in_bounded_lines():
    blob = b"x" * (1 << 20) + b"\n" + bytes(range(256)) * 10 + b"\n" + SYNTHETIC.encode()
    summary = read_stream(io.BytesIO(blob), "junk")
    assert summary.crash.exception == "AssertionError"


def test_pyrepr_reads_literals_and_never_evaluates():
    value = parse_repr("{'a': 1, 'b': [1.5, None, True], 'c': C(x='y', z=(1, 2)), 'd': __import__('os'), "
                       "'e': <bound method X>, 'f': 'it''s'")
    assert value["a"] == 1 and value["b"] == [1.5, None, True]
    assert value["c"] == {"__class__": "C", "x": "y", "z": [1, 2]}
    assert value["d"] == {"__class__": "__import__"}  # read as a repr, never called
    assert isinstance(value["e"], Unreadable)
    assert isinstance(parse_repr("[" * 100_000), list)


def test_one_mapping_for_serve_args():
    assert {row.field for row in SERVE_FLAGS.values() if row.from_log == "mapped" and row.field} == {
        "block_size", "gpu_blocks", "async_scheduling", "enable_chunked_prefill", "max_num_batched_tokens",
        "max_num_seqs", "max_model_len"}
    mapped = setup_overrides_from_serve_args({"block_size": "0", "max_num_seqs": "x", "kv_offloading_backend":
                                              "lmcache"})
    assert mapped.overrides.given() == {} and len(mapped.notes) == 3


def test_signature_callers_are_validated_with_lines():
    from kvdoctor.errors import RecipeError

    base = (ROOT / "repros" / "queued-abort.toml").read_text()
    bad = base.replace('callers = ["schedule", "build_connector_meta"]', 'callers = ["schedule", "not a name"]')
    line = next(i for i, text in enumerate(bad.splitlines(), 1) if text.startswith("callers"))
    with pytest.raises(RecipeError, match=f"bad.toml:{line}: \\[signature\\] callers entries must be function"):
        load_recipe_text(bad, "bad.toml")



def test_the_adapters_spellings_apply_to_a_known_bugs_function_and_callers():
    """Issue 33: aliases apply to every crash-site field. A recipe naming `_lookup` with no `function_aliases` of
    its own still knows the frame `_lookup_complete_chunks` (the adapter's names table: 0.28 moved the assert), and
    a caller chain naming `_lookup` is met by frames spelling it `_lookup_complete_chunks`."""
    from kvdoctor.diagnose.match import _in_order, known_bugs

    text = (ROOT / "repros" / "withheld-hashes-lookup.toml").read_text()
    plain = text.replace('function_aliases = ["_lookup_complete_chunks"]', "")
    assert plain != text
    known = known_bugs([load_recipe_text(plain, "plain.toml")], sites=[])
    assert "_lookup_complete_chunks" in known[0].functions, known[0].functions
    above = ["step", "schedule", "get_num_new_matched_tokens", "_lookup_complete_chunks"]
    assert _in_order(("schedule", "_lookup"), above)
    assert not _in_order(("_lookup", "schedule"), above)  # the order still counts
    assert not _in_order(("schedule", "_build_store_jobs"), above)  # a name with no such spelling does not match

# -- the command line (no vLLM import: --no-run, or nothing to run) -------------------------------------

def test_cli_no_crash_exit_0(tmp_path):
    log = tmp_path / "ok.log"
    log.write_text("(APIServer pid=1) INFO 08-04 09:40:01 [api_server.py:1] vLLM API server version 0.26.0\n")
    proc = invoke("diagnose", str(log))
    assert proc.returncode == 0, proc.stderr
    assert "no engine crash found in this log" in proc.stdout


def test_cli_bad_path_one_line_exit_2(tmp_path):
    proc = invoke("diagnose", str(tmp_path / "missing.log"))
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "no such file" in proc.stderr
    proc = invoke("diagnose", str(tmp_path))
    assert proc.returncode == 2 and "is a directory" in proc.stderr


def test_cli_stdin_json_and_report_without_leaks(tmp_path):
    import json

    report = tmp_path / "r.md"
    proc = invoke("diagnose", "-", "--no-run", "--json", "--report", str(report), stdin=SYNTHETIC)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    from kvdoctor import __version__

    assert doc["kvdoctor_version"] == __version__  # as every other command's document
    assert doc["log"]["vllm_version"] == "0.26.0"
    assert {m["recipe"] for m in doc["matches"]} >= SAME_ASSERT
    assert doc["crash"]["file"] == "vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py"
    text = report.read_text() + proc.stdout
    for leak in ("sk-", "/home", "node-17", "10.1.2.3", "10.0.0.", "POST", "/usr/local", "/mnt/secret"):
        assert leak not in text


def test_many_earlier_tracebacks_and_a_stale_cut_one_do_not_hide_the_crash():
    warning = ("(EngineCore_DP0 pid=7) WARNING 08-04 09:41:00 [worker.py:116] Traceback (most recent call last):\n"
               '(EngineCore_DP0 pid=7) WARNING 08-04 09:41:00 [worker.py:116]   File "/x/vllm/v1/kv_offload/worker/'
               'worker.py", line 114, in transfer_async\n'
               "(EngineCore_DP0 pid=7) WARNING 08-04 09:41:00 [worker.py:116] AssertionError\n")
    stale = '(APIServer pid=1) ERROR 08-04 09:40:00 [x.py:1] Traceback (most recent call last):\n'
    requests = '(APIServer pid=1) INFO:     10.0.0.1:5000 - "POST /v1/completions HTTP/1.1" 200 OK\n' * 600
    summary = _read(stale + requests + warning * 100 + SYNTHETIC)
    assert summary.crash.vllm_frames[-1].function == "_build_store_jobs"
    assert summary.crash.after_fatal_marker


def test_cli_no_match_writes_a_starting_recipe_that_loads(tmp_path):
    paste = tmp_path / "paste.txt"
    paste.write_text('Traceback (most recent call last):\n'
                     '  File "/opt/v/site-packages/vllm/distributed/kv_transfer/kv_connector/v1/offloading/'
                     'scheduler.py", line 420, in update_state_after_alloc\n'
                     '    assert not req_status.transfer_jobs\n'
                     'AssertionError\n')
    recipe = tmp_path / "start.toml"
    report = tmp_path / "r.md"
    proc = invoke("diagnose", str(paste), "--write-recipe", str(recipe), "--report", str(report))
    assert proc.returncode == 7, proc.stderr  # a crash, and no known bug fits it
    assert "a crash no known bug matches: AssertionError in update_state_after_alloc" in proc.stdout
    loaded = load_recipe_text(recipe.read_text(), str(recipe))
    assert (loaded.signature.exception, loaded.signature.function) == ("AssertionError", "update_state_after_alloc")
    assert "```toml" in report.read_text() and "/opt/v" not in report.read_text()
    proc = invoke("diagnose", str(paste), "--report", str(tmp_path / "nodir" / "r.md"))
    assert proc.returncode == 2 and "no such directory" in proc.stderr


@pytest.mark.parametrize("text", ["{)", "{]", "{>", "{'a': 1 ) 'b': 2}", "{" + ")" * 50])
def test_args_reader_always_moves_on(text):
    """A stray closer in a mapping once made the reader loop for ever (found by the fuzz test)."""
    from kvdoctor.diagnose.pyrepr import parse_repr

    assert isinstance(parse_repr(text), dict)


def _recipe_with_signature(function: str, contains: str, name: str = "k7-like"):
    """A built-in recipe's file with another signature: how a recipe for another bug would read."""
    base = (ROOT / "repros" / "queued-abort.toml").read_text()
    text = base.replace('function = "_build_store_jobs"', f'function = "{function}"').replace(
        'contains = "len(offload_keys) == len(offload_block_ids)"', f'contains = "{contains}"').replace(
        'callers = ["schedule", "build_connector_meta"]', 'callers = ["schedule"]')
    return load_recipe_text(text.replace('name = "queued-abort"', f'name = "{name}"'), f"{name}.toml")


def test_one_line_of_a_multi_line_assert_confirms_and_never_contradicts():
    """The 1Cat #567 log shows `num_locally_computed_tokens`, one line of K7's multi-line assert."""
    crash = read_log(str(LOGS / "1cat-vllm-567-k7-frame-only.log")).crash
    k7 = _recipe_with_signature("update_state_after_alloc",
                                "num_locally_computed_tokens <= num_locally_computed_gpu_blocks * tokens_per_block")
    other = _recipe_with_signature("update_state_after_alloc", "assert not req_status.transfer_jobs", "other")
    result = match_crash(crash, [k7, other])
    # the shown line names only what `other`'s assertion does not: it is another assertion
    assert [c.recipe.name for c in result.candidates] == ["k7-like"]
    (first,) = result.candidates
    assert first.strength == "strong" and any("one line of it" in r for r in first.reasons)
    # a whole assert line still rules out another assertion in the same function
    whole = _read('Traceback (most recent call last):\n'
                  '  File "/x/vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py", line 646, in '
                  'update_state_after_alloc\n    assert not req_status.transfer_jobs\nAssertionError\n').crash
    assert [c.recipe.name for c in match_crash(whole, [k7, other]).candidates] == ["other"]


def test_a_log_collectors_stamp_and_separator_are_stripped():
    line = clean("2025-07-17 11:38:23.679826  >> ERROR 07-17 03:38:23 [async_llm.py:405]   File \"x\", line 1, in f")
    assert (line.process, line.level, line.body) == (None, "ERROR", '  File "x", line 1, in f')


def test_cli_fatal_error_without_its_frames_is_said_so():
    proc = invoke("diagnose", str(LOGS / "vllm-18572-stamped-reraise-then-cut.log"))
    assert proc.returncode == 7, proc.stderr  # the engine crashed: a crash no known bug can be named from
    assert "the engine's fatal error is at line 8 of the log, but its traceback is cut short" in proc.stdout
    assert "no engine crash found" not in proc.stdout


@pytest.mark.parametrize("name", sorted(n for n, r in REAL.items() if r.complete and not MATCHES[n]))
def test_complete_real_crashes_no_bug_matches_get_a_starting_recipe(name):
    from kvdoctor.diagnose.app import diagnose

    report = diagnose(str(LOGS / name), run=False)
    recipe = load_recipe_text(report.starting_recipe, "start.toml")
    assert (recipe.signature.exception, recipe.signature.function) == (REAL[name].exception, REAL[name].function)
    assert int(report.exit_status) == 7  # ExitStatus.UNNAMED_CRASH
