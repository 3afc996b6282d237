"""The `explore` application function: validate, search, write the findings, return plain data.

Free of Typer and of formatting (`kvdoctor.report.explore` formats `ExploreReport`); imports
hypothesis and vLLM only when called.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvdoctor.engine import compat
from kvdoctor.engine.memory import available_memory_bytes
from kvdoctor.errors import ExitStatus, InternalError, KvdoctorError, UsageError
from kvdoctor.explore.findings import write_findings
from kvdoctor.explore.pools import ProcessPool
from kvdoctor.explore.search import WorkerPool
from kvdoctor.explore.triage import triage
from kvdoctor.logic.variants import LOGIC_VARIANTS


class ExploreInterrupted(KvdoctorError):
    """Ctrl-C during a search: what was found so far is on disk already; the message says how much, where."""

    exit_code = ExitStatus.INTERRUPTED
    kind = "interrupted"


@dataclass
class ExploreReport:
    result: Any  # search.ExploreResult
    out_dir: Path
    wall_s: float
    command: str = ""
    notes: list[str] = field(default_factory=list)
    coverage: Any = None  # --coverage: line_coverage.CoverageReport of the connector's files

    @property
    def findings(self) -> list[Any]:
        return self.result.findings


def validate(logic: str, max_examples: int | None, time_budget: float, workers: int, max_events: int,
             worker: str = "simulated", ray: str | None = None) -> None:
    if logic not in LOGIC_VARIANTS:
        raise UsageError(f"--logic must be one of {', '.join(LOGIC_VARIANTS)} for explore, got {logic!r}")
    if max_examples is not None and max_examples < 1:
        raise UsageError(f"--max-examples must be >= 1, got {max_examples}")
    if not time_budget > 0:
        raise UsageError(f"--time-budget must be > 0 seconds, got {time_budget}")
    if workers < (0 if ray is not None else 1):  # 0 under Ray: one per slot of the cluster
        raise UsageError(f"--workers must be >= 1, got {workers}")
    if workers > 1 and ray is None:  # Ray sizes its tasks by the cluster (`RayPool.size`)
        refusal = workers_refusal(workers)
        if refusal:
            raise UsageError(refusal)
    if max_events < 1:
        raise UsageError(f"--max-events must be >= 1, got {max_events}")
    if worker not in ("simulated", "vllm"):
        raise UsageError(f"--worker must be simulated or vllm, got {worker!r}")


# One explore worker is one busy process with its own vLLM import: measured 1.0 GiB peak RSS after the
# import and warm-up on 0.26.0 (searching adds to it), so 1.5 GiB a worker is the estimate checked.
WORKER_BYTES = 3 << 29


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity, where the system says)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def workers_refusal(workers: int) -> str | None:
    """Why `--workers N` is more than this machine holds, in one line (None: it fits). Each worker
    imports vLLM: more workers than CPUs only share them, and more than memory allows is the OOM
    killer's (1000 workers drove one machine's load to 305 and killed another process)."""
    cpus = usable_cpus()
    available = available_memory_bytes()
    by_memory = cpus if available is None else max(1, available // WORKER_BYTES)
    most = max(1, min(cpus, by_memory))
    if workers <= most:
        return None
    memory = "" if available is None else f" and {available / 2**30:.1f} GiB available"
    return (f"--workers {workers}: this machine has {cpus} CPU(s){memory}; each worker is a process with its "
            f"own vLLM import (~{WORKER_BYTES / 2**30:.1f} GiB): at most {most} here")


@contextmanager
def hypothesis_storage() -> Iterator[None]:
    """Keep hypothesis' files out of the user's current directory.

    The search keeps no example database (`database=None`: examples live in
    memory), but hypothesis still writes caches under `./.hypothesis`. They go
    to a temporary directory instead (its path is inherited by spawned
    workers through the environment) that is removed when the search ends.
    """
    from hypothesis import configuration

    variable = "HYPOTHESIS_STORAGE_DIRECTORY"
    before = os.environ.get(variable)
    with tempfile.TemporaryDirectory(prefix="kvdoctor-hypothesis-") as directory:
        os.environ[variable] = directory
        configuration.set_hypothesis_home_dir(directory)
        try:
            yield
        finally:
            configuration.set_hypothesis_home_dir(None)
            if before is None:
                os.environ.pop(variable, None)
            else:
                os.environ[variable] = before


def explore(config: Any, out_dir: Path, command: str = "",
            on_progress: Callable[[Any], None] | None = None,
            on_finding: Callable[[Any], None] | None = None, api: Any = None,
            write_attachment: Callable[[Any, Any], str | None] | None = None) -> ExploreReport:
    """Search (see `kvdoctor.explore.search`), writing each finding's recipe under `out_dir` (and,
    with one worker, triaging it and writing its report) as soon as it is shrunk: a run killed at its
    time limit keeps what it found. `write_attachment(finding, triage)`: writes a candidate's report
    attachment beside its recipe (the CLI supplies it; formatting is not this module's job).
    `--time-budget` bounds the run from vLLM's import on (several workers: each one's own): search,
    shrinking and triage (a triage started before the end may finish a few seconds after)."""
    import dataclasses

    from kvdoctor.explore.search import explore as search

    validate(config.logic, config.max_examples, config.time_budget, config.workers, config.max_events,
             config.worker, ray=config.ray)
    parallel = config.ray is not None or config.workers > 1
    if config.ray is not None:
        from kvdoctor.explore.ray_pool import import_ray

        import_ray()  # without the extra: one line, exit 2, before vLLM is imported
    if parallel and api is None:
        declared = compat.installed_vllm_version()  # fail here, once, rather than in every worker
        if declared is None:
            raise compat.VllmUnavailableError(
                f"vLLM is not installed in this Python environment (kvdoctor needs vllm{compat.SUPPORTED_RANGE_TEXT})")
        compat.check_supported(declared)
    lines = None
    if not parallel:
        from kvdoctor.explore.search import warm_up

        if config.coverage:  # before vLLM's import (its lines count, as under `coverage run`); the pool's own
            from kvdoctor.observe.line_coverage import LineCoverage

            lines = LineCoverage()
            lines.start()
        try:
            if api is None:
                api = compat.load()  # here, not in the search: each finding is triaged as it comes
            warm_up(api)  # vLLM's first scheduler build and hypothesis' strategies: before the clock starts
        except BaseException:
            if lines is not None:
                lines.stop()
            raise
    pool: WorkerPool | None = ProcessPool() if parallel and config.ray is None else None
    if config.ray is not None:  # joined (or started) here; the search stops it, whatever happens
        from kvdoctor.explore.ray_pool import RayPool

        ray_pool = RayPool(config.ray)
        config = dataclasses.replace(config, workers=ray_pool.size(config.workers))
        pool = ray_pool
    # The budget starts once vLLM is imported (and warmed up): here for one worker; for several (local
    # processes or Ray tasks), in each worker once it has imported vLLM (its search's own clock, with no
    # shared end), the parent's triage after them.
    reserve = min(0.2 * config.time_budget, 60.0) if parallel and config.triage else 0.0
    relative = config.stop_at is None and parallel
    if config.stop_at is None and not relative:
        config = dataclasses.replace(config, stop_at=time.time() + config.time_budget)
    start = time.monotonic()
    facts: list[Any] = []

    written: set[str] = set()

    def found(finding: Any) -> None:
        write_findings([finding], out_dir)
        written.add(finding.key)  # one per signature and path
        if config.triage and api is not None and time.time() < config.stop_at:
            if not facts:
                facts.append(api.engine_core_facts())
            finding.triage = triage(api, finding, facts[0], write_attachment)
        if on_finding is not None:
            on_finding(finding)

    searched = config
    if reserve:
        # Several workers triage nothing themselves: the parent triages after them, once it has
        # imported vLLM, in the last part of the budget.
        searched = (dataclasses.replace(config, time_budget=config.time_budget - reserve) if relative
                    else dataclasses.replace(config, stop_at=config.stop_at - reserve))
    try:
        with hypothesis_storage():
            result = search(searched, on_progress=on_progress, on_finding=found, api=api, pool=pool, lines=lines)
    except KeyboardInterrupt:
        raise ExploreInterrupted(f"interrupted: {len(written)} finding(s) kept in {out_dir}") from None
    finally:
        if lines is not None:
            lines.stop()
    if relative:
        config = dataclasses.replace(config, stop_at=time.time() + reserve)
    result.config = config
    if result.errors and len(result.errors) >= config.workers:
        code = next((c for c in result.error_codes if c is not None), None)
        error = (KvdoctorError if code is not None else InternalError)(
            "every explore worker failed: " + "; ".join(result.errors))
        if code is not None:
            error.exit_code = ExitStatus(code)
        raise error
    write_findings(result.findings, out_dir)  # merged across workers: each signature's smallest
    notes: list[str] = []
    if config.triage and result.findings:
        skipped = triage_findings(result, config.stop_at, write_attachment)
        if skipped:
            notes.append(f"{skipped} finding(s) not triaged: the time budget was spent "
                         f"(triage one with a longer --time-budget, or replay it with kvdoctor repro FILE)")
    if "sleep-wake" in config.force:
        stats = result.stats
        notes.append(f"sleep/wake: {stats.sleep_examples} of {stats.examples} examples drew a sleep and played at "
                     f"--engine core (vLLM's EngineCore.sleep / wake_up); the others at the scheduler level "
                     f"({stats.scheduler_steps:,} engine steps in all)")
    covered = None
    if config.coverage and result.coverage is not None:
        from kvdoctor.observe.line_coverage import report as coverage_report

        covered = coverage_report(result.coverage)
    return ExploreReport(result=result, out_dir=out_dir, wall_s=time.monotonic() - start, command=command,
                         notes=notes, coverage=covered)


def triage_findings(result: Any, stop_at: float | None = None,
                    write_attachment: Callable[[Any, Any], str | None] | None = None) -> int:
    """Triage every finding not yet triaged (see `kvdoctor.explore.triage`) while time is left before
    `stop_at`; returns how many were left untriaged."""
    pending = [f for f in result.findings if f.triage is None]
    if not pending:
        return 0
    if stop_at is not None and time.time() >= stop_at:
        return len(pending)
    api = result.api or compat.load()  # several workers: the parent imports vLLM for this only
    facts = api.engine_core_facts()
    for index, finding in enumerate(pending):
        if stop_at is not None and time.time() >= stop_at:
            return len(pending) - index
        finding.triage = triage(api, finding, facts, write_attachment)
    return 0


def exit_status(report: ExploreReport) -> int:
    """1 when a failure was found; else a failed worker makes the search incomplete, never "nothing found";
    else 6 (inconclusive) when no example ran at all: nothing tested is not nothing found."""
    if report.findings:
        return ExitStatus.REPRODUCED
    if report.result.lost:  # part of the search did not run: not "nothing found"
        return ExitStatus.SETUP_OR_OTHER_FAILURE
    if report.result.errors:
        codes = [c for c in report.result.error_codes if c is not None]
        return codes[0] if codes else ExitStatus.INTERNAL_ERROR  # a worker crashed outside kvdoctor's errors
    if nothing_tested(report):
        return ExitStatus.INCONCLUSIVE
    return ExitStatus.NOT_REPRODUCED


def nothing_tested(report: ExploreReport) -> str | None:
    """The one line saying no example ran (the budget was spent before the first), else None."""
    stats, config = report.result.stats, report.result.config
    if stats.examples > 0 or report.findings:
        return None
    return (f"explore: 0 examples ran in --time-budget {config.time_budget:g} s (after vLLM's import): "
            f"nothing was tested; give it a longer --time-budget")
