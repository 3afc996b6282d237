"""Reading what operators really paste (issue 35's reading defects, issue 34's compressed logs); no vLLM import.

Table-driven over short fragments of real vLLM crash reports, each quoted from the upstream thread named
beside it (only the lines the case needs; a pasting detail such as a stray indent is the reporter's). Every
case runs through the reader, the matcher and the report, and the CLI's exit code.
"""

from __future__ import annotations

import bz2
import gzip
import importlib.util
import io
import json
import lzma
import os
import shutil
import subprocess
from typing import NamedTuple

import pytest

from kvdoctor.diagnose.app import diagnose
from kvdoctor.diagnose.kinds import crash_site
from kvdoctor.diagnose.reader import read_stream
from kvdoctor.report.diagnose import (
    crash_lines,
    diagnose_document,
    next_lines,
    render_diagnose_markdown,
)

from .cli_runner import invoke
from .test_diagnose import LOGS

# vllm-project/vllm#54415: a multi-node engine's start-up, pasted as one line.
MMAP_TIMEOUT = "TimeoutError: Timed out waiting for mmap file to reach 4144029696 bytes"
# vllm-project/vllm#46949 (as quoted in #47073): the oversized CPU region; the exception line pasted with
# one leading space under the first line of a multi-line `madvise(` call.
BAD_ADDRESS = ('  File ".../vllm/v1/kv_offload/cpu/shared_offload_region.py", line 100, in __init__\n'
               "    self.mmap_obj.madvise(\n"
               " OSError: [Errno 14] Bad address\n")
# vllm-project/vllm#51013's K1 tail with its exception line pasted above the frames.
K1_ABOVE = ("(EngineCore pid=755) ERROR 08-04 09:48:15 [core.py:1332] AssertionError\n"
            '(EngineCore pid=755) ERROR 08-04 09:48:15 [core.py:1332]   File "/usr/local/lib/python3.12/dist-packages/'
            'vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py", line 975, in _build_store_jobs\n'
            "(EngineCore pid=755) ERROR 08-04 09:48:15 [core.py:1332]     "
            "assert len(offload_keys) == len(offload_block_ids)\n")
# vllm-project/vllm#42348: torch's segfault banner and the innermost native frames.
SEGFAULT = ("!!!!!!! Segfault encountered !!!!!!!\n"
            '  File "<unknown>", line 0, in cudaMemcpyAsync\n'
            '  File "<unknown>", line 0, in swap_blocks(at::Tensor&, at::Tensor&, long, at::Tensor const&)\n'
            '  File "<unknown>", line 0, in c10::Dispatcher::callBoxed(c10::OperatorHandle const&, '
            "std::vector<c10::IValue, std::allocator<c10::IValue> >*) const [clone .isra.0]\n")
# vllm-project/vllm#28950: the offloading worker's failed transfer, logged as a WARNING, cut before its last line.
_W = "(EngineCore_DP0 pid=143) WARNING 11-18 07:48:24 [worker.py:116] "
TRANSFER = (f"{_W}Exception in ('CPU', 'GPU') transfer 235: AssertionError()\n"
            f"{_W}Traceback (most recent call last):\n"
            f'{_W}  File "/usr/local/lib/python3.12/dist-packages/vllm/v1/kv_offload/worker/worker.py", line 114, '
            f"in transfer_async\n"
            f"{_W}    success = handler.transfer_async(job_id, spec)\n"
            f'{_W}  File "/usr/local/lib/python3.12/dist-packages/vllm/v1/kv_offload/worker/cpu_gpu.py", line 129, '
            f"in transfer_async\n"
            f"{_W}    src_sub_block_count == dst_blocks.size * dst_block_size_factor -\n")
# vllm-project/vllm#44888: Ray's nested process prefixes and a logger tag with a path; the first frame is the
# worker's generic busy loop.
_R = ("(API Server pid=11) (RayWorkerProc pid=12505) (Worker_DPO_TP6_EP6 pid=12505) ERROR 06-08 14:19:55 "
      "[v1/executor/multiproc_executor.py:962] ")
RAY_WORKER = (f"{_R}WorkerProc hit an exception.\n"
              f"{_R}Traceback (most recent call last):\n"
              f'{_R}  File "/usr/local/lib/python3.12/dist-packages/vllm/v1/executor/multiproc_executor.py", '
              f"line 957, in worker_busy_loop\n"
              f"{_R}    output = func(*args, **kwargs)\n"
              f'{_R}  File "/usr/local/lib/python3.12/dist-packages/vllm/v1/kv_offload/cpu/spec.py", line 99, '
              f"in get_handlers\n"
              f"{_R}    self._handlers = self.create_handlers(kv_caches)\n"
              f"{_R}OSError: [Errno 22] Invalid argument\n")


class Reading(NamedTuple):
    text: str
    exception: str | None  # of the crash the reader assembles (None: no traceback, loose lines only)
    site: str | None  # the frame named as the crash site
    kind: str  # kinds.CrashKind.name
    exit: int  # `kvdoctor diagnose TEXT --no-run`
    says: str  # in the text report
    never: str  # never in the text report


CASES = {
    "one-line paste": Reading(MMAP_TIMEOUT, None, None, "start-up", 7, "pasted text (1 line read)", "no such file"),
    "indented exception": Reading(BAD_ADDRESS, "OSError", "__init__", "start-up", 7, "/dev/shm", "cut short"),
    "exception above frames": Reading(K1_ABOVE, "AssertionError", "_build_store_jobs", "engine", 0,
                                      "pasted above its frames", "cut short"),
    "segfault": Reading(SEGFAULT, "SIGSEGV", "swap_blocks", "native", 7,
                        "SIGSEGV in swap_blocks (inside cudaMemcpyAsync: a CUDA copy)", "engine traceback"),
    "transfer worker": Reading(TRANSFER, "AssertionError", "transfer_async", "transfer worker", 0,
                               "transfer worker traceback", "engine traceback"),
    "ray worker": Reading(RAY_WORKER, "OSError", "get_handlers", "start-up", 7, "in Worker_DPO_TP6_EP6",
                          "worker_busy_loop()"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_real_fragments_are_read_as_what_they_are(name):
    case = CASES[name]
    report = diagnose(case.text, run=False)
    crash = report.summary.crash
    if case.exception is None:
        assert crash is None
    else:
        assert crash is not None and crash.exception == case.exception
        assert not crash.cut_short
        assert crash_site(crash).function == case.site
    assert report.kind is not None and report.kind.name == case.kind
    shown = "\n".join(crash_lines(report) + next_lines(report))
    proc = invoke("diagnose", case.text, "--no-run", columns=400)
    assert proc.returncode == case.exit, proc.stdout + proc.stderr
    assert case.says in proc.stdout, proc.stdout
    assert case.never not in proc.stdout
    assert "Traceback" not in proc.stderr
    if case.kind != "engine":  # named as such, with what kvdoctor can and cannot check there
        assert "kvdoctor can:" in shown and "kvdoctor cannot:" in shown


def test_native_frames_are_named_without_their_signatures():
    crash = read_stream(io.BytesIO(SEGFAULT.encode()), "paste").crash
    assert [f.function for f in crash.frames] == ["c10::Dispatcher::callBoxed", "swap_blocks", "cudaMemcpyAsync"]
    doc = diagnose_document(diagnose(SEGFAULT, run=False))
    assert doc["crash"]["kind"] == "native" and doc["crash"]["native"] is True
    assert "--worker vllm" in doc["crash"]["kvdoctor_can"]


def test_faulthandler_dump_keeps_the_current_threads_frames_outermost_first():
    dump = ("Fatal Python error: Segmentation fault\n\n"
            "Thread 0x00007f01 (most recent call first):\n"
            '  File "/x/threading.py", line 320 in wait\n\n'
            "Current thread 0x00007f02 (most recent call first):\n"
            '  File "/x/vllm/v1/kv_offload/worker/cpu_gpu.py", line 129 in transfer_async\n'
            '  File "/x/vllm/v1/kv_offload/worker/worker.py", line 114 in transfer_async\n'
            '  File "/x/vllm/v1/executor/multiproc_executor.py", line 957 in worker_busy_loop\n')
    crash = read_stream(io.BytesIO(dump.encode()), "paste").crash
    assert crash.native and crash.exception == "SIGSEGV"
    assert [f.function for f in crash.frames] == ["worker_busy_loop", "transfer_async", "transfer_async"]
    assert crash.frames[-1].file.endswith("cpu_gpu.py")


def test_a_warning_tracebacks_json_agrees_with_itself():
    """#28950's worker traceback: no engine crash, and the reason says so (not "cut short")."""
    proc = invoke("diagnose", TRANSFER, "--no-run", "--json")
    doc = json.loads(proc.stdout)
    assert doc["holds_crash"] is False and doc["exit_code"] == 0 == proc.returncode
    assert "cut short" not in doc["no_match_reason"] and "WARNING" in doc["no_match_reason"]
    assert doc["crash"]["kind"] == "transfer worker" and doc["crash"]["exception_from"] == "header"


def test_the_named_site_skips_generic_frames():
    text = ('Traceback (most recent call last):\n'
            '  File "/x/vllm/v1/executor/multiproc_executor.py", line 957, in worker_busy_loop\n'
            "    output = func(*args, **kwargs)\n"
            '  File "/usr/lib/python3.12/mmap_helpers.py", line 12, in populate\n'
            "    m.madvise(23, 0, n)\n"
            "OSError: [Errno 14] Bad address\n")
    crash = read_stream(io.BytesIO(text.encode()), "paste").crash
    assert crash_site(crash).function == "populate"


def test_a_one_line_path_that_is_not_there_is_still_no_such_file(tmp_path):
    proc = invoke("diagnose", str(tmp_path / "crash.log"))
    assert proc.returncode == 2 and "no such file" in proc.stderr and proc.stderr.count("\n") == 1


def test_write_recipe_without_a_recipe_keeps_the_exit_code_and_says_why(tmp_path):
    out = tmp_path / "r.toml"
    proc = invoke("diagnose", SEGFAULT, "--no-run", "--write-recipe", str(out))
    assert proc.returncode == 7 and not out.exists()
    assert "not written: the crash is a native crash" in proc.stderr
    assert "a known bug matches" not in proc.stderr
    proc = invoke("diagnose", str(LOGS / "vllm-51013-k1-tail.log"), "--no-run", "--write-recipe", str(out))
    assert proc.returncode == 0 and not out.exists()
    assert "a known bug matches (K1, K6)" in proc.stderr


def test_the_report_file_does_not_tell_its_reader_to_make_a_report(tmp_path):
    for text in (SEGFAULT, str(LOGS / "vllm-51013-k1-tail.log")):
        markdown = render_diagnose_markdown(diagnose(text, run=False))
        assert "--report" not in markdown
        assert "--report FILE" in "\n".join(next_lines(diagnose(text, run=False)))


def test_version_from_a_header_line_and_the_features_the_text_names():
    text = ("# vllm/vllm-openai, version: 0.26.0 (CPU offload + fs tier + MTP)\n"
            "(APIServer pid=1) INFO 09-05 19:30:01 [utils.py:326] non-default args: {'model': 'm', "
            "'async_scheduling': True, 'kv_transfer_config': {'kv_connector': 'MultiConnector', "
            "'kv_role': 'kv_consumer'}}\n" + MMAP_TIMEOUT + "\n")
    summary = diagnose(text, run=False).summary
    assert (summary.version, summary.version_source) == ("0.26.0", "header line")
    found = {name: named.detail for name, named in summary.features.items()}
    assert found == {"speculative decoding": "MTP", "KV tiers (TieringOffloadingSpec)": "",
                     "async scheduling": "", "MultiConnector": "", "P/D disaggregation": "kv_consumer"}
    # vLLM's own engine line wins over a header; collect_env's line is a header too
    banner = "(EngineCore pid=5) INFO 09-05 19:30:02 [core.py:100] Initializing a V1 LLM engine (v0.26.0) with config\n"
    assert diagnose(banner, run=False).summary.version_source == "banner"
    assert diagnose("vLLM Version: 0.8.4\n" + MMAP_TIMEOUT, run=False).summary.version == "0.8.4"
    # and a real log's: #55503's EAGLE/MTP kernel warning
    named = diagnose(str(LOGS / "vllm-55503-mtp-cut.log"), run=False).summary.features
    assert "speculative decoding" in named
    doc = diagnose_document(diagnose(text, run=False))
    assert {f["feature"] for f in doc["log"]["features"]} == set(found)


# -- compressed and binary logs (issue 34) ---------------------------------------------------------------

K1_LOG = (LOGS / "vllm-51013-k1-tail.log").read_bytes()


@pytest.mark.parametrize(("suffix", "compress"), [(".gz", gzip.compress), (".xz", lzma.compress),
                                                  (".bz2", bz2.compress)])
def test_compressed_logs_are_read(tmp_path, suffix, compress):
    path = tmp_path / f"crash.log{suffix}"
    path.write_bytes(compress(K1_LOG))
    proc = invoke("diagnose", str(path), "--no-run", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert {m["bug"] for m in doc["matches"]} == {"K1", "K6"}
    piped = invoke("diagnose", "-", "--no-run", "--json", stdin=compress(K1_LOG))
    assert json.loads(piped.stdout)["matches"] == doc["matches"]


def test_a_compressed_log_cut_short_is_read_up_to_the_cut(tmp_path):
    path = tmp_path / "crash.log.gz"
    whole = gzip.compress(K1_LOG + os.urandom(200_000).hex().encode())
    path.write_bytes(whole[: len(whole) // 2])
    proc = invoke("diagnose", str(path), "--no-run", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert "ends early" in doc["log"]["read_note"] and {m["bug"] for m in doc["matches"]} == {"K1", "K6"}


def test_binary_and_undecompressable_files_are_refused_in_one_line(tmp_path):
    cases = {"blob.bin": os.urandom(1 << 20), "blob.gz": gzip.compress(os.urandom(1 << 16)),
             "fake.gz": b"\x1f\x8bnot gzip at all\n" * 10}
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        proc = invoke("diagnose", str(tmp_path / name), "--no-run")
        assert proc.returncode == 2, (name, proc.stdout)
        assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr


def test_zstd_logs_are_read_where_the_module_is_and_refused_in_one_line_where_not(tmp_path):
    if shutil.which("zstd") is None:
        pytest.skip("no zstd command here to compress the test log with")
    path = tmp_path / "crash.log"
    path.write_bytes(K1_LOG)
    subprocess.run(["zstd", "-q", str(path)], check=True)
    proc = invoke("diagnose", str(path) + ".zst", "--no-run")
    if importlib.util.find_spec("zstandard") is None:
        assert proc.returncode == 2 and "zstandard" in proc.stderr and proc.stderr.count("\n") == 1
    else:
        assert proc.returncode == 0 and "K1" in proc.stdout


def test_long_one_word_lines_are_read_in_linear_time():
    """A 60,000-character word after a backtick, before `()`, after `in ` or before `.py` took seconds a line (the
    frame and mention patterns backtracked quadratically); a compressed log's cut hex tail took 25 s."""
    import time

    n = 60_000
    lines = ["`" + "a_" * (n // 2), "a_" * (n // 2) + "()", "in " + "a_" * (n // 2), "x" * n + ".py, in f",
             os.urandom(n // 2).hex(), "assert " + "a" * n, "(" * n]
    started = time.process_time()
    summary = read_stream(io.BytesIO(("\n".join(lines) + "\n").encode() + K1_LOG), "long")
    assert time.process_time() - started < 5
    assert summary.crash is not None and summary.crash.exception == "AssertionError"
