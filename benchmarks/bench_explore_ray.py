"""Explore's examples/s on Ray: 1 task against 2 tasks, and 2 Ray tasks against 2 local processes.

Every run is `kvdoctor.explore.app.explore` with the same seed, no triage and no example limit, for
a `--seconds` budget; its rate is the examples all its workers ran over the search's elapsed time
(after each worker's vLLM import: Ray's start and the imports are not the search). The three
configurations run in turn, `--repeat` rounds (the order rotating each round), so a drift in the
machine's speed hits every side; the medians' ratios count. Targets (issue 37): 2 Ray tasks
>= 1.6x one Ray task on a 2-core machine; local `--workers 2` <= 1.15x 2 Ray tasks (the driver's
overhead).

Each round also measures the machine's own ceiling: two plain CPU-bound Python processes side by side
against one alone (`--ceiling-seconds` each). Two workers cannot scale past what two busy loops get, so
the scaling is printed beside it: a shared or throttled second vCPU shows here, not as a Ray defect.

    .venv/bin/python benchmarks/bench_explore_ray.py [--seconds 60] [--repeat 3] [--seed 0]

Run it on an otherwise idle machine: two workers need both cores.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path

SCALING_TARGET = 1.6
OVERHEAD_TARGET = 1.15


def rate(workers: int, ray: str | None, seconds: float, seed: int) -> float:
    from kvdoctor.explore.app import explore
    from kvdoctor.explore.search import ExploreConfig

    # the budget covers the workers' vLLM imports too; the rate divides by the search's own time
    config = ExploreConfig(seed=seed, max_examples=None, workers=workers, ray=ray, triage=False,
                           time_budget=seconds)
    with tempfile.TemporaryDirectory(prefix="kvdoctor-bench-") as out:
        report = explore(config, Path(out))
    stats = report.result.stats
    return stats.examples / stats.elapsed if stats.elapsed > 0 else 0.0


def _spin(seconds: float, counts: multiprocessing.Queue[int]) -> None:
    """A CPU-bound loop for `seconds`: how many iterations this process got."""
    deadline = time.perf_counter() + seconds
    n = 0
    while time.perf_counter() < deadline:
        for _ in range(10_000):
            n += 1
    counts.put(n)


def busy_loops(processes: int, seconds: float) -> float:
    """Iterations per second of `processes` busy loops run side by side."""
    counts: multiprocessing.Queue[int] = multiprocessing.Queue()
    started = [multiprocessing.Process(target=_spin, args=(seconds, counts)) for _ in range(processes)]
    for process in started:
        process.start()
    total = sum(counts.get() for _ in started)
    for process in started:
        process.join()
    return total / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ceiling-seconds", type=float, default=10.0)
    args = parser.parse_args()
    ceilings: list[float] = []
    sides = {"ray x1": (1, "local"), "ray x2": (2, "local"), "local x2": (2, None)}
    rates: dict[str, list[float]] = {name: [] for name in sides}
    names = list(sides)
    for round_ in range(args.repeat):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            workers, ray = sides[name]
            rates[name].append(rate(workers, ray, args.seconds, args.seed))
            print(f"round {round_ + 1} {name}: {rates[name][-1]:.1f} examples/s", flush=True)
        one, two = busy_loops(1, args.ceiling_seconds), busy_loops(2, args.ceiling_seconds)
        ceilings.append(two / one if one else 0.0)
        print(f"round {round_ + 1} two busy loops / one: {ceilings[-1]:.2f}x", flush=True)
    median = {name: statistics.median(values) for name, values in rates.items()}
    scaling = median["ray x2"] / median["ray x1"] if median["ray x1"] else 0.0
    overhead = median["local x2"] / median["ray x2"] if median["ray x2"] else float("inf")
    for name, value in median.items():
        print(f"{name:9} median {value:.1f} examples/s ({', '.join(f'{v:.1f}' for v in rates[name])})")
    ceiling = statistics.median(ceilings)
    print(f"2 Ray tasks / 1 Ray task: {scaling:.2f}x (target >= {SCALING_TARGET}; this machine's ceiling, two busy "
          f"loops / one: {ceiling:.2f}x; {scaling / ceiling:.0%} of it)" if ceiling else
          f"2 Ray tasks / 1 Ray task: {scaling:.2f}x (target >= {SCALING_TARGET})")
    print(f"local --workers 2 / 2 Ray tasks: {overhead:.2f}x (target <= {OVERHEAD_TARGET})")


if __name__ == "__main__":
    main()
