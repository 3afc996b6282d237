"""Where a parallel search's workers run: spawned processes on this machine.

`kvdoctor.explore.search` owns the worker body (`worker_main`) and the driver's loop; a pool only
starts workers, carries their messages and stops them. `ProcessPool` is `--workers N` on one
machine; `kvdoctor.explore.ray_pool.RayPool` is `--ray`, the same workers as Ray tasks.
"""

from __future__ import annotations

import queue as queue_mod
from typing import Any

from kvdoctor.explore.search import ExploreConfig, worker_main


class ProcessPool:
    """`config.workers` spawned processes (never forked: the parent may have imported torch), one
    multiprocessing queue."""

    name = "local process"

    def __init__(self) -> None:
        self._processes: list[Any] = []
        self._queue: Any = None
        self._finished: set[int] = set()  # workers whose last message ("done" / "error") has been read

    def start(self, config: ExploreConfig) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self._queue = ctx.Queue()
        self._processes = [ctx.Process(target=worker_main, args=(config, i, self._queue), daemon=True)
                           for i in range(config.workers)]
        for process in self._processes:
            process.start()

    def get(self, timeout: float) -> tuple[str, int, Any] | None:
        try:
            message: tuple[str, int, Any] = self._queue.get(timeout=timeout)
        except queue_mod.Empty:
            return None
        if message[0] in ("done", "error"):
            self._finished.add(message[1])
        return message

    def gone(self, workers: set[int]) -> dict[int, str]:
        return {i: f"process died (exit code {self._processes[i].exitcode})"
                for i in sorted(workers) if not self._processes[i].is_alive()}

    def cancel(self, worker: int) -> None:
        self._processes[worker].terminate()

    def close(self) -> None:
        """A worker that said its last word gets 5 s to exit (vLLM's teardown); one still searching (Ctrl-C,
        SIGTERM, a stopped run) is terminated at once."""
        for index, process in enumerate(self._processes):
            if index in self._finished:
                process.join(timeout=5)
            if process.is_alive():
                process.terminate()
                process.join(timeout=5)
