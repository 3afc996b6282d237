"""What counting the crash site costs a `repro` run.

Side by side in one run, interleaved (traced then untraced, then the other way round, so a drift
in the machine's load hits both alike), median of N each:
- whole `kvdoctor repro <recipe> --logic all --json` processes (what a user runs: the target is on
  this ratio, <= 1.10), one with the crash-site tracing and one with it replaced by a no-op scope;
- the scenario runs alone, in this process after vLLM's import (stricter: no import to hide in).

Each is timed twice: wall-clock, and the CPU seconds the run itself used (the process's own, or the
child's for a process). On a machine shared with other work the wall-clock ratio mostly measures the
neighbours; the CPU ratio is what the tracing costs, and the verdict is on it.

    python benchmarks/bench_coverage.py [--repeat 5] [--runs-only] [recipe ...]

On a loaded machine the process timings are noise (each pays vLLM's import): --runs-only skips them.
"""

from __future__ import annotations

import argparse
import contextlib
import resource
import statistics
import subprocess
import sys
import time

from kvdoctor.engine.overrides import Overrides

DEFAULT_RECIPES = ("queued-abort", "mamba-align-midblock-hit-load", "readmitted-stale-store-cursor")
TARGET = 1.10
# A whole `python -m kvdoctor repro` in a fresh interpreter; with OFF the site tracer is a no-op scope.
CHILD = """import contextlib, runpy, sys
if sys.argv[1] == "off":
    import kvdoctor.observe.coverage as coverage
    coverage.site_tracer = lambda signature, harness: contextlib.nullcontext(None)
sys.argv = ["kvdoctor", "repro", sys.argv[2], "--logic", "all", "--json"]
runpy.run_module("kvdoctor", run_name="__main__")
"""


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def process_seconds(recipe: str, on: bool) -> tuple[float, float]:
    """(wall, CPU) seconds of one whole repro process."""
    start, cpu = time.perf_counter(), _children_cpu()
    proc = subprocess.run([sys.executable, "-c", CHILD, "on" if on else "off", recipe], capture_output=True,
                          text=True)
    elapsed, used = time.perf_counter() - start, _children_cpu() - cpu
    if proc.returncode not in (0, 1, 6):
        raise SystemExit(f"repro {recipe} exited {proc.returncode}: {proc.stderr.strip()[-300:]}")
    return elapsed, used


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--runs-only", action="store_true", help="time the scenario runs alone, no processes")
    parser.add_argument("recipes", nargs="*", default=list(DEFAULT_RECIPES))
    args = parser.parse_args()

    from kvdoctor import app
    from kvdoctor.observe import coverage

    traced = coverage.site_tracer

    def untraced(signature: object, harness: object) -> contextlib.nullcontext:
        return contextlib.nullcontext(None)

    def scenario_seconds(recipe: str, on: bool) -> tuple[float, float]:
        """(wall, CPU) seconds of the recipe's runs under every logic, in this process (and any child)."""
        coverage.site_tracer = traced if on else untraced
        try:
            start, cpu = time.perf_counter(), time.process_time() + _children_cpu()
            app.repro(recipe, Overrides(), "all")
            return time.perf_counter() - start, time.process_time() + _children_cpu() - cpu
        finally:
            coverage.site_tracer = traced

    worst = 0.0
    measures = [(scenario_seconds, "runs only")] if args.runs_only else [(process_seconds, "repro"),
                                                                         (scenario_seconds, "runs only")]
    print(f"{'recipe':<32} {'':>9} {'wall on':>8} {'off':>8} {'ratio':>6}   {'cpu on':>8} {'off':>8} {'ratio':>6}")
    for recipe in args.recipes:
        for measure, kind in measures:
            measure(recipe, True)  # warm: page cache, vLLM's import, the site lookup
            on, off = [], []
            for i in range(args.repeat):
                for traced_run in ((True, False) if i % 2 == 0 else (False, True)):
                    (on if traced_run else off).append(measure(recipe, traced_run))
            wall_on, wall_off = (statistics.median(t[0] for t in runs) for runs in (on, off))
            cpu_on, cpu_off = (statistics.median(t[1] for t in runs) for runs in (on, off))
            cpu_ratio = cpu_on / cpu_off
            if kind == "repro" or args.runs_only:
                worst = max(worst, cpu_ratio)
            print(f"{recipe:<32} {kind:>9} {wall_on:7.3f}s {wall_off:7.3f}s {wall_on / wall_off:6.3f}   "
                  f"{cpu_on:7.3f}s {cpu_off:7.3f}s {cpu_ratio:6.3f}")
    verdict = "OK" if worst <= TARGET else "OVER TARGET"
    print(f"worst {'runs-only' if args.runs_only else 'repro'} CPU ratio: {worst:.3f} (target <= {TARGET}) {verdict}")
    return 0 if worst <= TARGET else 1


if __name__ == "__main__":
    raise SystemExit(main())
