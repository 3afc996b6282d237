"""`explore --ray`: the search's workers as Ray tasks, across every node of a cluster.

Ray is vLLM's own multi-node runtime (its executor for pipeline/tensor parallelism; KubeRay on
operators' clusters), so kvdoctor uses it rather than a job runner of its own. Each worker is one
task running the same body as a local worker (`search.worker_main`), on the node's installed vLLM
and kvdoctor, with its own seeds (its worker index) and the whole run's deadline (`stop_at`). Its
messages reach the driver through a `ray.util.queue.Queue` actor, so findings stream back as they
are shrunk and the driver writes each at once. Ray is optional (`pip install 'kvdoctor[ray]'`).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import tempfile
import time
from typing import Any

from kvdoctor.errors import UsageError
from kvdoctor.explore.search import ExploreConfig, worker_main

EXTRA = "kvdoctor[ray]"
LOCAL = "local"  # start a Ray instance on this machine for this run, and stop it after
# What Ray reserves for one task: a CPU, and the memory a worker with vLLM imported peaks at
# (measured here: 1.5-1.9 GB a worker process), so Ray never packs more workers onto a node
# than it can hold.
TASK_MEMORY_BYTES = 2 * 1024**3
LOCAL_OBJECT_STORE_BYTES = 128 * 1024**2  # the queue's messages are small: keep /dev/shm free
_AUTH_VARIABLES = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
# One token for every local instance this process starts: Ray's driver keeps the first token it read
# for the life of the process, so a second instance with another token would refuse this driver.
_RUN_TOKEN = secrets.token_hex(32)
# How long a stopped local instance's processes get to exit on their own after `ray.shutdown()` before
# they are killed (measured: under a loaded 2-core CI machine one of them was still alive 2 s after).
REAP_GRACE_S = 15.0


def import_ray() -> Any:
    """Ray, or a usage error naming the extra that brings it (exit 2, before anything starts)."""
    try:
        import ray
    except ImportError:
        raise UsageError(f"--ray needs Ray: pip install '{EXTRA}' (or run without --ray: --workers N uses this "
                         f"machine's processes)") from None
    return ray


def _task_body(config: ExploreConfig, worker: int, queue: Any) -> None:
    """One Ray task: `worker_main` with hypothesis' files in a directory it removes (a remote node
    has none of the driver's)."""
    from hypothesis import configuration

    with tempfile.TemporaryDirectory(prefix="kvdoctor-hypothesis-") as directory:
        os.environ["HYPOTHESIS_STORAGE_DIRECTORY"] = directory
        configuration.set_hypothesis_home_dir(directory)
        worker_main(config, worker, queue)


class RayPool:
    """Workers as Ray tasks. `address`: `local` (a Ray instance started here and stopped at the end),
    `auto` (the cluster this machine belongs to: `ray start`, KubeRay) or `HOST:PORT` / `ray://...`."""

    def __init__(self, address: str = LOCAL) -> None:
        self.address = address
        self.name = "Ray, local instance" if address == LOCAL else f"Ray cluster at {address}"
        self._ray: Any = None
        self._queue: Any = None
        self._tasks: list[Any] = []
        self._temp_dir: str | None = None
        self._connected = False
        self._saved_env: dict[str, str | None] = {}

    @property
    def ray(self) -> Any:
        """The `ray` module, once connected (for callers that submit tasks of their own: matrix)."""
        return self._ray

    def slots(self) -> int:
        """Workers the cluster can run at once: its CPUs, and its memory at TASK_MEMORY_BYTES a worker."""
        resources = self._ray.cluster_resources()
        by_memory = int(resources.get("memory", TASK_MEMORY_BYTES) // TASK_MEMORY_BYTES)
        return max(0, min(int(resources.get("CPU", 0)), by_memory))

    def connect(self) -> int:
        """Join (or start) the cluster; returns its worker slots. Separate from `start` so the caller
        can size `--workers` by the cluster before any worker starts."""
        ray = self._ray = import_ray()
        options: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False, "configure_logging": False}
        if self.address == LOCAL:
            # Short path: Ray's socket names must fit in 107 bytes. Removed in close().
            self._temp_dir = tempfile.mkdtemp(prefix="kvd-ray-", dir="/tmp" if os.path.isdir("/tmp") else None)
            # Ray's token authentication stays on, with this run's token in the run's directory (the
            # instance's processes inherit the variables): Ray would otherwise write ~/.ray/auth_token
            # and warn about it on stderr.
            token = os.path.join(self._temp_dir, "auth_token")
            with open(os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as handle:
                handle.write(_RUN_TOKEN)
            self._saved_env = {name: os.environ.get(name) for name in _AUTH_VARIABLES}
            os.environ.pop("RAY_AUTH_TOKEN", None)
            os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=token)
            _reread_ray_config()
            options.update(num_cpus=len(os.sched_getaffinity(0)), object_store_memory=LOCAL_OBJECT_STORE_BYTES,
                           _temp_dir=self._temp_dir)
        else:
            options["address"] = self.address
        self._connected = True  # from here on close() stops what ray.init started, even half-way
        try:
            ray.init(**options)
            return self.slots()
        except (ConnectionError, ValueError, RuntimeError) as exc:
            self.close()
            raise UsageError(f"--ray-address {self.address}: cannot join the cluster: "
                             f"{str(exc).splitlines()[0]}") from None
        except BaseException:  # Ctrl-C while Ray starts
            self.close()
            raise

    def size(self, asked: int) -> int:
        """Join the cluster and size the search by it: `asked` workers (0: one per slot), refused in one
        line (exit 2) beyond the cluster's slots, before any worker starts."""
        slots = self.connect()
        if slots < 1 or asked > slots:
            self.close()
            raise UsageError(f"--workers {asked or 'per slot'}: the {self.name} has {slots} worker slot(s) "
                             f"(a CPU and {TASK_MEMORY_BYTES // 1024**3} GiB of memory each); ask for at most "
                             f"{max(slots, 1)}")
        return asked or slots

    def start(self, config: ExploreConfig) -> None:
        from ray.util.queue import Queue

        if not self._connected:
            self.connect()
        ray = self._ray
        self._queue = Queue(actor_options={"num_cpus": 0})
        task = ray.remote(_task_body).options(num_cpus=1, memory=TASK_MEMORY_BYTES, max_retries=0)
        self._tasks = [task.remote(config, i, self._queue) for i in range(config.workers)]

    def get(self, timeout: float) -> tuple[str, int, Any] | None:
        from ray.util.queue import Empty

        try:
            message: tuple[str, int, Any] = self._queue.get(block=True, timeout=timeout)
        except Empty:
            return None
        return message

    def gone(self, workers: set[int]) -> dict[int, str]:
        refs = {self._tasks[i]: i for i in workers}
        done, _ = self._ray.wait(list(refs), num_returns=len(refs), timeout=0)
        gone: dict[int, str] = {}
        for ref in done:
            try:
                self._ray.get(ref)
                gone[refs[ref]] = "the task ended without a last word"
            except Exception as exc:  # a task's failure, as Ray reports it: one line
                gone[refs[ref]] = f"{type(exc).__name__}: {_first_line(exc)}"
        return gone

    def cancel(self, worker: int) -> None:
        self._ray.cancel(self._tasks[worker], force=True)

    def close(self) -> None:
        ray, self._ray = self._ray, None
        if ray is not None and self._connected:
            for task in self._tasks:
                with contextlib.suppress(Exception):  # already finished or gone: nothing to stop
                    ray.cancel(task, force=True)
            ray.shutdown()  # a local instance: stops it; a cluster: disconnects the driver only
            if self._temp_dir is not None:
                reap(f"RAY_AUTH_TOKEN_PATH={os.path.join(self._temp_dir, 'auth_token')}".encode())
        self._connected = False
        self._tasks = []
        for name, value in self._saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if self._saved_env:
            self._saved_env = {}
            _reread_ray_config()
        if self._temp_dir is not None:
            shutil.rmtree(self._temp_dir, ignore_errors=True)
            self._temp_dir = None


def instance_processes(marker: bytes) -> set[int]:
    """This machine's processes whose environment holds `marker` (a local instance's own variable: every
    process Ray starts for it inherits the driver's environment, and no other instance has the same
    value), the caller excluded."""
    found: set[int] = set()
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as handle:
                if marker in handle.read().split(b"\0"):
                    found.add(int(entry))
        except OSError:  # gone meanwhile, or another user's
            continue
    return found


def unused_instance_dirs(root: str = "/tmp") -> list[str]:
    """kvdoctor's local-instance folders (`kvd-ray-*` under `root`) that no live process of their instance uses:
    left behind (a live one beside them, another run's, keeps its folder until it stops)."""
    import glob

    return [d for d in glob.glob(os.path.join(root, "kvd-ray-*"))
            if not instance_processes(f"RAY_AUTH_TOKEN_PATH={os.path.join(d, 'auth_token')}".encode())]


def reap(marker: bytes, grace: float = REAP_GRACE_S) -> None:
    """Wait (at most `grace` seconds) for the processes `ray.shutdown()` asked to stop, then kill what is
    left: a local instance leaves nothing behind, however slowly a loaded machine lets it exit."""
    deadline = time.monotonic() + grace
    left = instance_processes(marker)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = instance_processes(marker)
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def _reread_ray_config() -> None:
    """Ray reads its RAY_AUTH_* variables into its config when first imported, which the driver did
    before this run set them: have it read them again (Ray's own refresh, as `ray.init` does when it
    turns token authentication on). Without it the driver's client would present no token."""
    try:
        from ray._raylet import Config  # type: ignore[attr-defined]  # Ray's compiled module: no stubs
    except ImportError:  # a Ray without that config object reads the variables when used
        return
    Config.initialize("")


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0][:200] if lines else ""
