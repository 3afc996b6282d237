"""`--engine serve`: a real `vllm serve` child on 127.0.0.1, kvdoctor as its HTTP client.

Slow (two `import vllm` in each child, minutes on a 2-core machine): one verdict run, compared with
kvdoctor's measured release outcomes, one interrupted run, one that runs out of start-up time, and one
`audit --engine serve` (every recipe a client can drive, their servers at once: the K4 answers, K8's
crash). After each, no child is left and the ports are free.

The platform plugin is an entry point of kvdoctor's distribution (pyproject.toml). An environment
whose kvdoctor was installed before the entry point existed lacks it; the tests then put a
`.dist-info` holding only that entry point on the child's PYTHONPATH (a temporary folder), which is
what an install of this checkout provides.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time

import pytest

from kvdoctor.matrix import data
from tests.conftest import KVDOCTOR, ROOT

pytestmark = pytest.mark.vllm
PID_LINE = re.compile(r"child PID (\d+) on 127\.0\.0\.1:(\d+)")


def _gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def _port_free(port: int) -> bool:
    """Nothing listens there and a new server could bind it (SO_REUSEADDR, as servers bind: the client
    connections the run closed may sit in TIME_WAIT, which is the kernel's, not a process's)."""
    with socket.socket() as probe:
        probe.settimeout(2)
        if probe.connect_ex(("127.0.0.1", port)) == 0:
            return False
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_queued_abort_serve_verdict_from_the_servers_log(serve_env: dict[str, str]) -> None:
    proc = subprocess.run([*KVDOCTOR, "repro", "queued-abort", "--engine", "serve", "--json"], cwd=ROOT,
                          env=serve_env, capture_output=True, text=True, timeout=1500)
    if proc.returncode == 3:
        pytest.skip(f"no usable vLLM here: {proc.stderr.strip()[-300:]}")
    match = PID_LINE.search(proc.stderr)
    assert match, proc.stderr[-3000:]
    pid, port = int(match.group(1)), int(match.group(2))
    assert _gone(pid) and _port_free(port)
    doc = json.loads(proc.stdout)
    assert doc["setup"]["engine"] == "serve"
    rows = [r for r in data.load() if r.release == doc["vllm_version"] and r.recipe == "queued-abort"]
    if not rows:
        pytest.skip(f"no measured queued-abort row for vLLM {doc['vllm_version']}")
    result = doc["results"][0]
    assert result["outcome"] == rows[0].outcome, result.get("detail")
    if rows[0].outcome == "reproduced":
        assert proc.returncode == 1
        assert result["failure"]["function"] == "_build_store_jobs"
        assert any(f["function"] == "run_busy_loop" for f in result["failure"]["vllm_frames"])
    else:
        assert proc.returncode == 0
        assert "aborted while queued" in result["detail"] and "fresh request served" in result["detail"]


def test_interrupted_serve_run_leaves_no_child_and_frees_the_port(serve_env: dict[str, str]) -> None:
    proc = subprocess.Popen([*KVDOCTOR, "repro", "queued-abort", "--engine", "serve"], cwd=ROOT, env=serve_env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        match = None
        while time.monotonic() < deadline and match is None:
            line = proc.stderr.readline()
            if not line:
                break
            match = PID_LINE.search(line)
        assert match, "kvdoctor never named its server child"
        pid, port = int(match.group(1)), int(match.group(2))
        time.sleep(5)  # the server is starting (importing vLLM)
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        assert proc.wait(timeout=120) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (_gone(pid) and _port_free(port)):
        time.sleep(0.5)
    assert _gone(pid), f"server process group {pid} still alive"
    assert _port_free(port)


def test_a_server_that_is_not_ready_in_time_is_stopped_and_named(serve_env: dict[str, str]) -> None:
    """The start-up limit (KVDOCTOR_SERVE_STARTUP_S) runs out while the child still imports vLLM: the
    run says so (other_failure, exit 4: no verdict about the bug), and no child or port is left."""
    started = time.monotonic()
    proc = subprocess.run([*KVDOCTOR, "repro", "queued-abort", "--engine", "serve", "--json"], cwd=ROOT,
                          env={**serve_env, "KVDOCTOR_SERVE_STARTUP_S": "2"}, capture_output=True, text=True,
                          timeout=300)
    if proc.returncode == 3:
        pytest.skip(f"no usable vLLM here: {proc.stderr.strip()[-300:]}")
    match = PID_LINE.search(proc.stderr)
    assert match, proc.stderr[-3000:]
    pid, port = int(match.group(1)), int(match.group(2))
    assert proc.returncode == 4, proc.stderr[-2000:]
    result = json.loads(proc.stdout)["results"][0]
    assert result["outcome"] == "other_failure"
    assert "did not become ready within 2 s" in result["detail"]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (_gone(pid) and _port_free(port)):
        time.sleep(0.5)
    assert _gone(pid), f"server process group {pid} still alive"
    assert _port_free(port)
    assert time.monotonic() - started < 120  # bounded: the limit, the stop, not the server's own start-up


def _loses_hits_only(name: str) -> bool:
    """A silent bug whose harm is lost prefix hits (`explore.impact`): its clients' answers are all equal."""
    from kvdoctor.explore.impact import LOST_HITS, impact_of
    from kvdoctor.recipes.builtins import resolve

    invariant = resolve(name).signature.invariant
    return invariant is not None and impact_of("invariant", invariant, "").kind == LOST_HITS


def test_audit_at_serve_agrees_with_the_scheduler_level_and_k4_is_a_clients_wrong_answer(
        serve_env: dict[str, str]) -> None:
    """`audit --engine serve`: every recipe a client can drive (their servers started at once) agrees with the
    scheduler level's measurement on this release (release_outcomes.toml), but a silent bug that only loses
    prefix hits (K11: its transfer hold and A's late finish played by the served executor) is not_reproduced
    there: A's and B's completions are compared and equal (measured; B re-admitted after its preemption is
    answered from the KV bytes, V1 runner on 0.26.0 / 0.30.0); every other recipe is
    not_applicable naming the step or setup a server cannot express. K4 (silent): A's client asks for EOS as
    its first token (vllm_xargs), C's client continues A's conversation, and C's completion is compared with
    the same traffic on a second server with offloading off: C differs at token 0 exactly where the
    scheduler level measured K4, completions equal elsewhere. K9 (silent): D's completion differs exactly where
    the scheduler level measured K9. No server or port is left."""
    proc = subprocess.run([*KVDOCTOR, "audit", "--engine", "serve", "--json"], cwd=ROOT, env=serve_env,
                          capture_output=True, text=True, timeout=1500)
    if proc.returncode == 3:
        pytest.skip(f"no usable vLLM here: {proc.stderr.strip()[-300:]}")
    children = [(int(pid), int(port)) for pid, port in PID_LINE.findall(proc.stderr)]
    assert len(children) >= 8, proc.stderr[-3000:]  # queued-abort, K8, K4, K9 and K11 with offloading on and off
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not all(_gone(pid) and _port_free(port) for pid, port in children):
        time.sleep(0.5)
    assert all(_gone(pid) and _port_free(port) for pid, port in children)
    doc = json.loads(proc.stdout)
    measured = {r.recipe: r.outcome for r in data.load() if r.release == doc["vllm_version"]}
    if not measured:
        pytest.skip(f"no measured rows for vLLM {doc['vllm_version']}")
    rows = {row["recipe"]: row for row in doc["rows"]}
    played = {name for name, row in rows.items() if row["outcome"] != "not_applicable"}
    assert {"queued-abort", "final-token-slot-stored", "preempt-reload-same-step", "readmitted-stale-store-cursor",
            "reused-block-unfenced-multiconnector"} <= played, sorted(played)
    for name, row in rows.items():
        if name in played and _loses_hits_only(name):  # K11: no client reads wrong KV, so none is reproduced
            # every request answered by the stand-in from the KV bytes (no unanswered token voids it) and equal
            assert row["outcome"] == "not_reproduced", (name, row)
            answers = row["answers"]
            assert answers is not None and answers["not_compared"] is None and not answers["reproduced"], row
            assert {r["request"] for r in answers["requests"]} == {"A", "B"}, answers
        elif name in played:
            assert row["outcome"] == measured[name], (name, row)
        else:
            assert "cannot be played through vllm serve" in row["hint"] or "--engine core" in row["hint"], row
    k4 = rows["final-token-slot-stored"]
    answers = k4["answers"]
    assert answers is not None and answers["not_compared"] is None, k4
    by_request = {r["request"]: r for r in answers["requests"]}
    assert set(by_request) == {"A", "C"} and by_request["A"]["position"] is None, answers
    if measured["final-token-slot-stored"] == "reproduced":  # C's prefix read A's never-written slot
        assert by_request["C"]["position"] == 0, answers
        assert answers["line"].startswith("request C's completion differs from the reference (offloading off, a "
                                          "second server) at token 0: "), answers
    else:
        assert by_request["C"]["got_tokens"] == by_request["C"]["expected_tokens"] == 3, answers
    # K9 (silent): D reads A's chunk from the watched connector's tier, which holds what the second connector loaded
    # into A's reused block (vLLM's worker drives the MultiConnector in the server's executor)
    k9 = rows["reused-block-unfenced-multiconnector"]["answers"]
    assert k9 is not None and k9["not_compared"] is None, rows["reused-block-unfenced-multiconnector"]
    k9_by_request = {r["request"]: r for r in k9["requests"]}
    assert set(k9_by_request) == {"A", "C", "D", "P"}, k9
    differing = {name for name, r in k9_by_request.items() if r["position"] is not None}
    assert differing == ({"D"} if measured["reused-block-unfenced-multiconnector"] == "reproduced" else set()), k9
