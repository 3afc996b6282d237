"""Run kvdoctor inside a release's environment and read its `--json` answer.

The child is `python -m kvdoctor` of the environment, with PYTHONPATH holding only a link
to *this* kvdoctor's package: the question is asked by the same kvdoctor (same recipes,
same logic variants) on every release, and nothing is installed into the environment for
it. The link (not the package's parent folder) keeps a site-packages that happens to hold
kvdoctor from shadowing the environment's own packages.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kvdoctor
from kvdoctor.matrix.envs import ReleaseEnv

# Outcomes a cell can have besides the recipe outcomes (reproduced, not_reproduced, ...).
ENV_FAILURE = "vllm_unavailable"  # the environment's vLLM would not import or is refused
KVDOCTOR_FAILURE = "internal_error"  # kvdoctor failed in the child (a kvdoctor bug)
# What a bisection reads from a not_applicable cell whose engine level could not play the recipe (`Cell.unplayable`)
UNPLAYABLE = "unplayable"


@dataclass
class Cell:
    """One recipe on one release, under the installed logic."""

    release: str
    recipe: str
    outcome: str
    bug: str | None = None
    failure_site: str | None = None
    detail: str | None = None
    fixed_logic_outcome: str | None = None
    vllm_version: str | None = None
    seconds: float = 0.0
    coverage: str | None = None  # the crash site's coverage line ("reached 2x: held", "site gone: ...")
    # The same recipe under --async-scheduling (a second audit, for --write-data); None: not measured.
    async_outcome: str | None = None
    async_fixed_logic_outcome: str | None = None
    # Each measured reason of the recipe -> the outcome at the value that breaks it (matrix/reasons.py).
    reason_outcomes: dict[str, str] | None = None
    # not_applicable only because the run's engine level (--engine) cannot play a step or the setup: the run
    # did not test the bug (exit 6, `outcome_codes.exit_code_for`), as a repro or audit at that level says
    unplayable: bool = False

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def failure_site(failure: dict | None, violations: list[dict] | None) -> str | None:
    """Where a reproduction fired: the raising vLLM frame, or the invariant it broke."""
    if failure:
        return f"{failure['exception']} at {failure['file']}:{failure['line']} in {failure['function']}"
    if violations:
        return "invariant " + ", ".join(sorted({v["invariant"] for v in violations}))
    return None


def coverage_line(coverage: dict | None) -> str | None:
    """The crash site's coverage as the JSON says it (None from a kvdoctor that did not measure it)."""
    return coverage.get("summary") if isinstance(coverage, dict) else None


@dataclass
class Runner:
    """Runs kvdoctor commands in release environments; one temporary PYTHONPATH folder."""

    timeout_s: float = 1800.0
    engine: str = "scheduler"  # --engine of every child command (the default level is not passed)
    only: tuple[str, ...] = ()  # built-in recipes an audit is limited to (`audit --recipe`); empty: every one
    _pythonpath: tempfile.TemporaryDirectory | None = field(default=None, init=False)

    def __enter__(self) -> Runner:
        self._pythonpath = tempfile.TemporaryDirectory(prefix="kvdoctor-matrix-")
        os.symlink(Path(kvdoctor.__file__).resolve().parent, Path(self._pythonpath.name) / "kvdoctor")
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._pythonpath is not None:
            self._pythonpath.cleanup()

    def prefetch(self, calls: list[tuple[str, ReleaseEnv, Any]]) -> None:
        """Local runs go one at a time, when asked: nothing to start ahead (`matrix.ray_runner` starts them)."""

    def recipe(self, env: ReleaseEnv, recipe_ref: str, flags: tuple[str, ...] = ()) -> Cell:
        """`kvdoctor repro RECIPE --logic installed --json [FLAGS]` on the release; a run judged by a measured
        reason (matrix/reasons.py) counts as it played (`played_outcome`): the matrix measures, never reads
        its own data back."""
        started = time.monotonic()
        code, doc, err = self._kvdoctor(env, ["repro", recipe_ref, "--logic", "installed", "--json",
                                              *self._engine_args(), *flags])
        name = Path(recipe_ref).stem if recipe_ref.endswith(".toml") else recipe_ref
        if doc is None or "results" not in doc:
            return self._failed(env, name, code, doc, err, started)
        result = doc["results"][0]
        return Cell(env.release, doc["recipe"]["name"], result.get("played_outcome") or result["outcome"],
                    bug=doc["recipe"].get("bug"),
                    failure_site=failure_site(result.get("failure"), result.get("violations")),
                    detail=result.get("detail"), vllm_version=doc.get("vllm_version"),
                    seconds=round(time.monotonic() - started, 1), coverage=coverage_line(result.get("coverage")),
                    unplayable=bool(result.get("unplayable")))

    def audit(self, env: ReleaseEnv, async_scheduling: bool = False) -> list[Cell]:
        """`kvdoctor audit --json` on the release (with `--async-scheduling` when asked): one cell per
        built-in recipe (per recipe of `only`, where given)."""
        started = time.monotonic()
        limit = [arg for name in self.only for arg in ("--recipe", name)]
        code, doc, err = self._kvdoctor(env, ["audit", "--json", *self._engine_args(), *limit,
                                              *(["--async-scheduling"] if async_scheduling else [])])
        if doc is None or "rows" not in doc:
            return [self._failed(env, "(audit)", code, doc, err, started)]
        seconds = round((time.monotonic() - started) / max(1, len(doc["rows"])), 1)
        return [Cell(env.release, row["recipe"], row.get("played_outcome") or row["outcome"], bug=row.get("bug"),
                     failure_site=failure_site(row.get("failure"), row.get("violations")),
                     detail=None if row["outcome"] == "reproduced" else row.get("hint"),
                     fixed_logic_outcome=row.get("fixed_logic_played_outcome") or row.get("fixed_logic_outcome"),
                     vllm_version=doc.get("vllm_version"),
                     seconds=seconds, coverage=coverage_line(row.get("coverage")),
                     unplayable=bool(row.get("unplayable")))
                for row in doc["rows"]]

    def _engine_args(self) -> list[str]:
        return [] if self.engine == "scheduler" else ["--engine", self.engine]

    def _failed(self, env: ReleaseEnv, name: str, code: int, doc: dict | None, err: str,
                started: float) -> Cell:
        message = _error_message(doc, err) or f"kvdoctor exited {code} without a JSON answer"
        outcome = ENV_FAILURE if code == 3 else KVDOCTOR_FAILURE
        return Cell(env.release, name, outcome, detail=message, seconds=round(time.monotonic() - started, 1))

    def _kvdoctor(self, env: ReleaseEnv, args: list[str]) -> tuple[int, dict | None, str]:
        assert self._pythonpath is not None, "use Runner as a context manager"
        child_env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
        child_env["PYTHONPATH"] = self._pythonpath.name
        try:
            proc = subprocess.run([str(env.python), "-m", "kvdoctor", *args], capture_output=True, text=True,
                                  cwd=self._pythonpath.name, env=child_env, timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            return 124, None, f"timed out after {self.timeout_s:.0f} s"
        except OSError as exc:
            return 3, None, f"cannot run {env.python}: {exc.strerror}"
        try:
            doc = json.loads(proc.stdout) if proc.stdout.strip() else None
        except json.JSONDecodeError:
            doc = None
        return proc.returncode, doc if isinstance(doc, dict) else None, proc.stderr


def _error_message(doc: dict | None, stderr: str) -> str | None:
    if doc and isinstance(doc.get("error"), dict):
        return doc["error"].get("message")
    if doc and isinstance(doc.get("error"), str):
        return doc["error"]
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    for line in reversed(lines):
        if line.startswith("kvdoctor: error:"):
            return line[len("kvdoctor: error:"):].strip()
    return lines[-1][:300] if lines else None
