"""Line coverage of vLLM's offloading connector code, for `explore --coverage` (coverage.py's tracer).

Not the crash-site count of `kvdoctor.observe.coverage` (one statement of one recipe's site): this
measures every line of the connector's packages that runs (`CONNECTOR_PACKAGES` of the installed vLLM,
those that exist), so a search can say how much of the connector it reached, per file, and favour
examples that reach lines no earlier example did (`LineCoverage.take_new`).

Measured with coverage.py (its C tracer, restricted to those files), never by writing into
site-packages: `start` before vLLM is imported also counts the lines an import runs (class and
function definitions), as `coverage run` would. A search in several processes measures in each one;
`executed` is plain data (file -> lines) that the parent merges with `merge_executed` and turns into
the report with `report`, where a file nothing imported counts as wholly missed.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The connector's code, relative to vLLM's package directory: the OffloadingConnector's package and
# the offloading managers, tiers and policies (whichever the installed release has; 8,754 statements on
# 0.34.0, as issue 36 counted them).
CONNECTOR_PACKAGES = ("distributed/kv_transfer/kv_connector/v1/offloading", "v1/kv_offload")

Executed = dict[str, list[int]]  # file (absolute) -> executed line numbers, sorted


def vllm_root() -> Path | None:
    """The installed vLLM's package directory, found without importing vLLM (None: not installed)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))).resolve()


def connector_files(root: Path | None = None) -> list[Path]:
    """Every Python file of the connector's code in the installed vLLM (sorted; empty without vLLM)."""
    root = root or vllm_root()
    if root is None:
        return []
    files: set[Path] = set()
    for package in CONNECTOR_PACKAGES:
        folder = root / package
        if folder.is_dir():
            files.update(path.resolve() for path in folder.rglob("*.py"))
    return sorted(files)


class LineCoverage:
    """coverage.py measuring the connector's files in this process, from `start` to `stop`; each
    example between `begin_example` and `end_example` is recorded under a context of its own
    (coverage.py's dynamic contexts), so what one example reached is known."""

    def __init__(self, root: Path | None = None) -> None:
        import coverage

        self.root = root or vllm_root()
        patterns = [str(self.root / package / "*") for package in CONNECTOR_PACKAGES] if self.root else []
        # No data file, no user configuration (.coveragerc, pyproject) read: only these files, in memory.
        self._cov = coverage.Coverage(data_file=None, config_file=False, include=patterns or ["<none>"])
        # a search whose vLLM was imported before `start` may read before its first connector line ran
        self._cov.set_option("run:disable_warnings", ["no-data-collected"])
        self._seen: dict[str, set[int]] = {}
        self._example: str | None = None
        self._examples = 0
        self.running = False

    def start(self) -> None:
        self._cov.start()
        self.running = True

    def stop(self) -> None:
        if self.running:
            self._cov.stop()
            self.running = False

    def executed(self) -> Executed:
        """Every line measured so far, per file."""
        data = self._cov.get_data()
        data.set_query_contexts(None)
        return {path: sorted(data.lines(path) or ()) for path in data.measured_files()}

    def mark_seen(self) -> None:
        """Count everything measured so far as seen (vLLM's import, the warm-up): not new to a search."""
        for path, lines in self.executed().items():
            self._seen.setdefault(path, set()).update(lines)

    def begin_example(self) -> None:
        self._examples += 1
        self._example = f"example {self._examples}"
        self._cov.switch_context(self._example)

    def end_example(self) -> tuple[int, int]:
        """(lines the example reached, of which never reached before it), counted in the connector's files."""
        if self._example is None:
            return 0, 0
        data = self._cov.get_data()
        self._cov.switch_context("between examples")
        data.set_query_context(self._example)
        reached = new = 0
        try:
            for path in data.measured_files():
                lines = data.lines(path) or ()
                if not lines:
                    continue
                seen = self._seen.setdefault(path, set())
                before = len(seen)
                seen.update(lines)
                reached += len(lines)
                new += len(seen) - before
        finally:
            data.set_query_contexts(None)
            self._example = None
        return reached, new


def merge_executed(parts: list[Executed]) -> Executed:
    """The union of several processes' executed lines."""
    merged: dict[str, set[int]] = {}
    for part in parts:
        for path, lines in part.items():
            merged.setdefault(path, set()).update(lines)
    return {path: sorted(lines) for path, lines in sorted(merged.items())}


@dataclass(frozen=True)
class FileCoverage:
    file: str  # relative to vLLM's package directory, e.g. v1/kv_offload/cpu/manager.py
    statements: int
    executed: int

    @property
    def percent(self) -> float:
        return 100.0 * self.executed / self.statements if self.statements else 100.0

    def as_dict(self) -> dict[str, Any]:
        return {"file": self.file, "statements": self.statements, "executed": self.executed,
                "percent": round(self.percent, 1)}


@dataclass
class CoverageReport:
    """Per file of the connector's code: its statements and how many of them ran."""

    files: list[FileCoverage] = field(default_factory=list)

    @property
    def statements(self) -> int:
        return sum(f.statements for f in self.files)

    @property
    def executed(self) -> int:
        return sum(f.executed for f in self.files)

    @property
    def percent(self) -> float:
        return 100.0 * self.executed / self.statements if self.statements else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"files": [f.as_dict() for f in self.files],
                "total": {"statements": self.statements, "executed": self.executed,
                          "percent": round(self.percent, 1)}}


_STATEMENTS: dict[str, frozenset[int]] = {}


def statements_of(path: str) -> frozenset[int]:
    """coverage.py's executable statements of one source file (parsed once per process)."""
    known = _STATEMENTS.get(path)
    if known is None:
        import coverage

        cov = coverage.Coverage(data_file=None, config_file=False)
        try:
            _, statements, _, _, _ = cov.analysis2(path)
        except Exception:  # not parsable as Python (a template, a broken file): no statement counted
            statements = []
        known = _STATEMENTS[path] = frozenset(statements)
    return known


def report(executed: Executed, root: Path | None = None) -> CoverageReport:
    """The per-file report of `executed` over every file of the connector's code (a file no process
    imported counts with 0 executed); files without statements (empty `__init__`s) are left out."""
    root = root or vllm_root()
    files = connector_files(root)
    by_path = {str(Path(path).resolve()): set(lines) for path, lines in executed.items()}
    out: list[FileCoverage] = []
    for path in files:
        statements = statements_of(str(path))
        if not statements:
            continue
        ran = len(statements & by_path.get(str(path), set()))
        name = str(path.relative_to(root)) if root is not None else str(path)
        out.append(FileCoverage(file=name, statements=len(statements), executed=ran))
    return CoverageReport(files=out)
