"""`matrix --ray`: each release's kvdoctor run as a Ray task, so the releases run side by side.

A task runs exactly what the local `Runner` runs (`kvdoctor repro|audit --json` in the release's
environment, from the node's kvdoctor), so a cell is the same measurement wherever it ran, and the
report and `--bisect` logic are the same code as without Ray. The environment is the one the driver
found or built (`EnvStore`): on a cluster, give `--env-dir` (or `$KVDOCTOR_CACHE_DIR`) a volume
every node mounts at the same path. Without `--bisect`, every release's cells are submitted at once
(`prefetch`); a bisection asks one release at a time, as locally.
"""

from __future__ import annotations

from typing import Any

from kvdoctor.explore.ray_pool import TASK_MEMORY_BYTES, RayPool
from kvdoctor.matrix.envs import ReleaseEnv
from kvdoctor.matrix.runner import KVDOCTOR_FAILURE, Cell, Runner

# ("recipe", env, (recipe ref, its flags)) | ("audit", env, async_scheduling)
Call = tuple[str, ReleaseEnv, Any]


def _run_call(engine: str, timeout_s: float, only: tuple[str, ...], call: Call) -> list[Cell]:
    """One Ray task: the local runner, on the node the task landed on."""
    kind, env, argument = call
    with Runner(timeout_s=timeout_s, engine=engine, only=only) as runner:
        if kind == "recipe":
            ref, flags = argument
            return [runner.recipe(env, ref, flags)]
        return runner.audit(env, async_scheduling=argument)


class RayRunner:
    """The local `Runner`'s interface, each call a Ray task (a CPU and 2 GiB reserved: a child
    kvdoctor process with vLLM imported)."""

    def __init__(self, address: str, engine: str = "scheduler", timeout_s: float = 1800.0,
                 only: tuple[str, ...] = ()) -> None:
        self.engine = engine
        self.only = only
        self.timeout_s = timeout_s
        self._pool = RayPool(address)  # joining, the local instance and its clean-up are explore's
        self._task: Any = None
        self._pending: dict[tuple[str, str, Any], Any] = {}

    def __enter__(self) -> RayRunner:
        self._pool.connect()
        ray = self._pool.ray
        self._task = ray.remote(_run_call).options(num_cpus=1, memory=TASK_MEMORY_BYTES, max_retries=0)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._pending.clear()
        self._pool.close()

    def prefetch(self, calls: list[Call]) -> None:
        """Submit these calls now (they run side by side on the cluster); `recipe`/`audit` collect them."""
        for call in calls:
            key = _key(call)
            if key not in self._pending:
                self._pending[key] = self._task.remote(self.engine, self.timeout_s, self.only, call)

    def recipe(self, env: ReleaseEnv, recipe_ref: str, flags: tuple[str, ...] = ()) -> Cell:
        return self._collect(("recipe", env, (recipe_ref, tuple(flags))))[0]

    def audit(self, env: ReleaseEnv, async_scheduling: bool = False) -> list[Cell]:
        return self._collect(("audit", env, async_scheduling))

    def _collect(self, call: Call) -> list[Cell]:
        self.prefetch([call])
        ref = self._pending.pop(_key(call))
        try:
            cells: list[Cell] = self._pool.ray.get(ref)
        except Exception as exc:  # the task died (a lost node, a killed worker): this cell is unmeasured
            kind, env, argument = call
            name = "(audit)" if kind == "audit" else str(argument[0])
            return [Cell(env.release, name, KVDOCTOR_FAILURE,
                         detail=f"the Ray task running it failed: {type(exc).__name__}")]
        return cells


def _key(call: Call) -> tuple[str, str, Any]:
    kind, env, argument = call
    return kind, env.release, argument
