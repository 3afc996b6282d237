"""Shared fixtures: vLLM is imported once per test session (it costs seconds); and how the suite runs
in parallel (pytest-xdist, configured in pyproject's addopts: `--numprocesses=auto --dist=loadfile`)."""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
KVDOCTOR = [sys.executable, "-m", "kvdoctor"]

# kvdoctor's cache directory (vLLM's model-info cache: `kvdoctor.user_cache`) is one folder of this session's,
# never the developer's ~/.cache/kvdoctor (nor ~/.cache/vllm): the session pays vLLM's model inspection (a second
# vLLM import) once. Made by the process that loads this first (xdist's workers inherit it), removed at its exit.
if not os.environ.get("KVDOCTOR_CACHE_DIR"):
    os.environ["KVDOCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="kvdoctor-test-cache-")
    atexit.register(shutil.rmtree, os.environ["KVDOCTOR_CACHE_DIR"], ignore_errors=True)
# The suite's own processes (xdist's workers) keep Python's bytecode setting: with kvdoctor's bytecode cache on in
# them (`user_cache.keep_bytecode`), a 0.34.0 worker crashed twice in test_explore_coverage's in-process run under
# coverage.py's tracer and the session then hung (2026-12-06; cause not established). Each `kvdoctor` child still
# keeps its bytecode, as the console script does.

# -- parallel runs (pytest-xdist) ----------------------------------------------------------------------------
# Each worker imports vLLM (~1 GB) and builds its modules' harnesses; many tests start a `kvdoctor` child that
# imports vLLM again, and the serve tests a `vllm serve` child with its EngineCore. Measured on 0.26.0: two
# workers with their children peaked at 3.5-3.8 GB (proportional set size of the whole tree, sampled every 3 s).
# `-n auto` asks for one worker a CPU, at most one a WORKER_BYTES of available memory.
WORKER_BYTES = 5 << 29  # 2.5 GiB
# The session's one audit (tests/recipe_runs.cli_audit_run) is shared by test_audit_and_reports, test_readme
# and test_release_outcomes: once per worker that runs one of them (at most twice; see below on loadgroup).
# The slowest modules first, longest first (the other worker takes the short ones meanwhile, and the last to
# start is a short one), from `pytest --durations=0` on 0.26.0; the rest keep collection order.
SLOW_FIRST = ("test_audit_and_reports", "test_explore_ray", "test_matrix_cli", "test_first_hour", "test_explore",
              "test_refusals_at_once", "test_exit_corners", "test_explore_findings_honest", "test_engine_serve",
              "test_engine_core", "test_newcomer", "test_memory_bound", "test_vllm_worker", "test_compat")


def pytest_addoption(parser, pluginmanager):
    """pyproject's addopts name xdist's options; with xdist off (`-p no:xdist`) they are accepted and ignored,
    so one test still runs in this process as before."""
    if not pluginmanager.has_plugin("xdist"):
        group = parser.getgroup("xdist (not loaded: -p no:xdist)")
        group.addoption("--numprocesses", dest="numprocesses", default=None, help="ignored without xdist")
        group.addoption("--dist", dest="dist", default="no", help="ignored without xdist")
        group.addoption("--no-loadscope-reorder", dest="loadscopereorder", action="store_false",
                        help="ignored without xdist")


@pytest.hookimpl(optionalhook=True)  # xdist's hook: unknown under -p no:xdist
def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker a CPU this process may use, at most one a WORKER_BYTES of available memory, at
    least one; none (this process) when the command line names one test module, whose tests would share one
    worker anyway. PYTEST_XDIST_AUTO_NUM_WORKERS (xdist's own variable) overrides."""
    from kvdoctor.engine.memory import available_memory_bytes

    chosen = os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS")
    if chosen:
        return int(chosen)
    modules = {arg.split("::", 1)[0] for arg in config.args}
    if len(modules) == 1 and next(iter(modules)).endswith(".py"):
        return 0
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    memory = available_memory_bytes()
    by_memory = cpus if memory is None else memory // WORKER_BYTES
    return max(1, min(cpus, by_memory))


def _module(item) -> str:
    return item.nodeid.split("::", 1)[0].rsplit("/", 1)[-1].removesuffix(".py")


def pytest_collection_modifyitems(config, items):
    """On an xdist worker (`--dist loadfile`: a module's tests, and its module-scoped harnesses, stay on one
    worker): the SLOW_FIRST modules at the head of the queue. Every worker collects the same order (xdist
    checks). `--dist loadgroup` could keep the audit's three modules together, but xdist 3.8 marks a group by
    rewriting `item._nodeid`, which pytest 9 no longer reads (its nodeid comes from `_id`): under pytest 9.2
    loadgroup silently distributes test by test."""
    if not hasattr(config, "workerinput"):
        return
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(_module(item), len(rank)))  # stable: the rest keep their order


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


@pytest.fixture(scope="module")
def serve_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment a `vllm serve` child needs to find kvdoctor's platform plugin (test_engine_serve,
    test_leftovers): the installed entry point, or a throw-away dist-info naming it."""
    from kvdoctor.levels.serve import plugin_registered

    env = dict(os.environ)
    if not plugin_registered():
        folder = tmp_path_factory.mktemp("plugin")
        info = folder / "kvdoctor_engine_plugin-0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvdoctor-engine-plugin\nVersion: 0\n")
        (info / "entry_points.txt").write_text(
            "[vllm.platform_plugins]\nkvdoctor_cpu = kvdoctor.engine.core.platform:register\n")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), str(folder), env.get("PYTHONPATH")]))
    return env


def exit_tail_limit(idle_seconds: float = 1.0) -> float:
    """How long a process may take to end after its last output: `idle_seconds` on an idle machine, scaled by
    how oversubscribed the CPUs are when asked. CI runs these beside xdist workers importing vLLM: a `--model`
    run's tail measured 1.68 s in the 0.34.0 suite at 8afece9 and under 1 s alone."""
    load = os.getloadavg()[0] / (os.cpu_count() or 1)
    return idle_seconds * max(1.0, load)
