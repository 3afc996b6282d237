"""What counting the crash site costs a `repro` run.

Side by side in one run, interleaved, median of N each:
- whole `kvdoctor repro <recipe> --logic all --json` processes (what a user runs: the target is on
  this ratio, <= 1.10), one with the crash-site tracing and one with it replaced by a no-op scope;
- the scenario runs alone, in this process after vLLM's import (stricter: no import to hide in).

    python benchmarks/bench_coverage.py [--repeat 5] [--runs-only] [recipe ...]

On a loaded machine the process timings are noise (each pays vLLM's import): --runs-only skips them.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
import time

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


def process_seconds(recipe: str, on: bool) -> float:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CHILD, "on" if on else "off", recipe], capture_output=True,
                          text=True)
    elapsed = time.perf_counter() - start
    if proc.returncode not in (0, 1, 6):
        raise SystemExit(f"repro {recipe} exited {proc.returncode}: {proc.stderr.strip()[-300:]}")
    return elapsed


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

    def scenario_seconds(recipe: str, on: bool) -> float:
        coverage.site_tracer = traced if on else untraced
        try:
            start = time.perf_counter()
            app.repro(recipe, {}, "all")
            return time.perf_counter() - start
        finally:
            coverage.site_tracer = traced

    worst = 0.0
    measures = [(scenario_seconds, "runs only")] if args.runs_only else [(process_seconds, "repro"),
                                                                         (scenario_seconds, "runs only")]
    print(f"{'recipe':<32} {'':>9} {'traced':>9} {'untraced':>9} {'ratio':>6}")
    for recipe in args.recipes:
        for measure, kind in measures:
            measure(recipe, True)  # warm: page cache, vLLM's import, the site lookup
            on, off = [], []
            for _ in range(args.repeat):
                on.append(measure(recipe, True))
                off.append(measure(recipe, False))
            t_on, t_off = statistics.median(on), statistics.median(off)
            ratio = t_on / t_off
            if kind == "repro" or args.runs_only:
                worst = max(worst, ratio)
            print(f"{recipe:<32} {kind:>9} {t_on:8.3f}s {t_off:8.3f}s {ratio:6.3f}")
    verdict = "OK" if worst <= TARGET else "OVER TARGET"
    print(f"worst {'runs-only' if args.runs_only else 'repro'} ratio: {worst:.3f} (target <= {TARGET}) {verdict}")
    return 0 if worst <= TARGET else 1


if __name__ == "__main__":
    raise SystemExit(main())
