"""`kvdoctor explore --ray` on a local Ray instance started by kvdoctor on this machine (2 CPUs, no
dashboard): two Ray tasks search with their own seeds, their findings stream to the driver, which
merges them by signature and path (`Finding.key`) and writes one recipe per key that `kvdoctor repro FILE`
replays;
a task whose worker is killed is a lost share (not counted as searched; exit 4 when nothing was
found); Ctrl-C stops every task and the Ray instance; without Ray, `--ray` is refused in one line.

Each search starts its own Ray instance and two vLLM imports (in the tasks): ~40 s on an idle
2-core machine. The test process imports vLLM once (the session `api`) for the replay.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from kvdoctor.explore.app import ExploreReport, exit_status
from kvdoctor.explore.ray_pool import instance_processes, unused_instance_dirs
from kvdoctor.explore.search import ExploreConfig, ExploreResult

from .cli_runner import invoke
from .conftest import KVDOCTOR, ROOT
from .test_explore import K1, SEED, has_k1

pytestmark = pytest.mark.vllm
ray = pytest.importorskip("ray", reason="the --ray tests need Ray (the dev group has it; "
                                       "pip install 'kvdoctor[ray]')")

EXAMPLES = 150  # per task; K1 comes within the first examples of seed 0 on releases that have it
BUDGET_S = 240.0  # an upper bound only: the example budget ends the search first
TOKEN_FILE = Path.home() / ".ray" / "auth_token"  # where Ray would keep a local instance's token


# This module's own Ray processes: every process a Ray instance starts inherits its driver's environment, so
# this marker (set in this process, inherited by the `kvdoctor` children too) tells them from another test
# module's instance running beside this one (xdist: test_matrix_ray).
MARK_NAME, MARK_VALUE = "KVDOCTOR_TEST_RUN", uuid.uuid4().hex
MARK = f"{MARK_NAME}={MARK_VALUE}".encode()


@pytest.fixture(autouse=True, scope="module")
def _marked_environment():
    saved = os.environ.get(MARK_NAME)
    os.environ[MARK_NAME] = MARK_VALUE
    yield
    if saved is None:
        os.environ.pop(MARK_NAME, None)
    else:
        os.environ[MARK_NAME] = saved


def _ray_processes() -> set[int]:
    """The processes of the Ray instances this module's runs started that are still alive."""
    return instance_processes(MARK)


@pytest.fixture(scope="module")
def two_task_search(tmp_path_factory):
    from kvdoctor.explore.app import explore

    out = tmp_path_factory.mktemp("ray-findings")
    config = ExploreConfig(seed=SEED, max_examples=EXAMPLES, workers=2, ray="local", triage=False,
                           time_budget=BUDGET_S)
    before = set(unused_instance_dirs()), TOKEN_FILE.exists()
    report = explore(config, out)
    return report, out, before


def test_two_ray_tasks_find_k1_merged_to_one_recipe_per_signature(api, two_task_search):
    report, out, _ = two_task_search
    result = report.result
    assert not result.errors and not result.lost, (result.errors, result.lost)
    assert len(result.workers) == 2 and {w.vllm for w in result.workers} == {api.version_text}
    assert {w.pid for w in result.workers} and os.getpid() not in {w.pid for w in result.workers}
    assert result.stats.examples == 2 * EXAMPLES  # both shares searched, counted once each
    signatures = [f.signature for f in report.findings]
    keys = [f.key for f in report.findings]
    assert len(keys) == len(set(keys))  # merged: one finding a signature and path
    recipes = sorted(out.glob("*.toml"))
    assert len(recipes) == len(report.findings)  # one file a key, none left from a worker's copy
    if not has_k1(api):
        assert K1 not in signatures
        return
    assert K1 in signatures
    k1 = min((f for f in report.findings if f.signature == K1), key=lambda f: f.steps)
    replay = invoke("repro", k1.file, "--logic", "installed")
    assert replay.returncode == 1, replay.stdout + replay.stderr


def test_the_local_ray_instance_is_stopped_after_the_search(two_task_search):
    _, _, (temp_dirs, token_file) = two_task_search
    assert not _ray_processes()
    assert not set(unused_instance_dirs()) - temp_dirs
    assert TOKEN_FILE.exists() == token_file  # the run's token lived in the environment, not in ~/.ray


def test_a_killed_task_is_a_lost_share_not_counted_as_searched(api, tmp_path):
    from kvdoctor.explore.app import explore

    killed: list[int] = []

    def kill_worker_1(result: ExploreResult) -> None:
        for identity in result.workers:
            if not killed and identity.pid != os.getpid() and result.workers.index(identity) == 1:
                os.kill(identity.pid, signal.SIGKILL)
                killed.append(identity.pid)

    config = ExploreConfig(seed=SEED, max_examples=EXAMPLES, workers=2, ray="local", triage=False,
                           time_budget=BUDGET_S)
    report = explore(config, tmp_path, on_progress=kill_worker_1)
    assert killed, "the test never saw a second worker report ready"
    result = report.result
    assert len(result.lost) == 1 and "its share is not counted as searched" in result.lost[0], result.lost
    assert result.stats.examples <= EXAMPLES  # only the surviving task's examples
    assert exit_status(report) == (1 if report.findings else 4)


def test_lost_share_without_a_finding_exits_4_and_with_one_exits_1(tmp_path):
    result = ExploreResult(vllm_version="x", config=ExploreConfig(workers=2, ray="local"),
                           lost=["worker 1 (Ray, local instance): WorkerCrashedError; its share is not counted"])
    report = ExploreReport(result=result, out_dir=tmp_path, wall_s=1.0)
    assert exit_status(report) == 4
    result.findings = [object()]  # any finding: found is found, the lost share is a warning beside it
    assert exit_status(report) == 1


def test_ray_refused_in_one_line_without_the_extra(tmp_path):
    code = ("import sys; sys.modules['ray'] = None\n"
            "from kvdoctor.cli.app import main\n"
            f"sys.argv = ['kvdoctor', 'explore', '--ray', '--out', {str(tmp_path / 'o')!r}]\n"
            "main()")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "kvdoctor[ray]" in lines[0], proc.stderr
    assert "vllm" not in proc.stderr.lower()


def test_ray_address_without_ray_is_a_usage_error(tmp_path):
    result = invoke("explore", "--ray-address", "auto", "--out", str(tmp_path / "o"))
    assert result.returncode == 2 and "--ray-address needs --ray" in result.stderr


def test_more_workers_than_the_cluster_has_slots_is_refused_before_any_starts(tmp_path):
    result = invoke("explore", "--ray", "--workers", "64", "--out", str(tmp_path / "o"), "--time-budget", "30")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "worker slot" in result.stderr and "--workers 64" in result.stderr
    assert not _ray_processes()


def test_ctrl_c_stops_every_task_and_the_ray_instance(tmp_path):
    temp_dirs = set(unused_instance_dirs())  # left by an earlier run, not this one's
    out = tmp_path / "o"
    proc = subprocess.Popen([*KVDOCTOR, "explore", "--ray", "--workers", "2", "--time-budget", "300",
                             "--no-triage", "--out", str(out)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    try:  # wait until the tasks are running (their Ray workers exist), then interrupt the driver
        while time.monotonic() < deadline and len(_ray_processes()) < 4 and proc.poll() is None:
            time.sleep(1)
        time.sleep(15)  # let the tasks import vLLM and start searching
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-2000:]
    # The driver waits for its instance's processes (killing what outlives ray_pool.REAP_GRACE_S) before it exits.
    assert not _ray_processes(), "Ray processes left after Ctrl-C"
    assert not set(unused_instance_dirs()) - temp_dirs


def test_local_workers_share_the_driver_loop_and_merge_rule(api, tmp_path):
    """`--workers 2` without Ray: the same driver loop (`search._explore_in_pool`) over spawned processes."""
    from kvdoctor.explore.app import explore

    config = ExploreConfig(seed=SEED, max_examples=40, workers=2, triage=False, time_budget=BUDGET_S)
    report = explore(config, tmp_path)
    result = report.result
    assert not result.errors and not result.lost, (result.errors, result.lost)
    assert len(result.workers) == 2 and {w.vllm for w in result.workers} == {api.version_text}
    assert result.stats.examples == 2 * 40
    keys = [f.key for f in report.findings]
    assert len(keys) == len(set(keys)) == len(list(tmp_path.glob("*.toml")))
