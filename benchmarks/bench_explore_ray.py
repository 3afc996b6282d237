"""Explore's examples/s on Ray: 1 task against 2 tasks, and 2 Ray tasks against 2 local processes.

Every run is `kvdoctor.explore.app.explore` with the same seed, no triage and no example limit, for
a `--seconds` budget; its rate is the examples all its workers ran over the search's elapsed time
(after each worker's vLLM import: Ray's start and the imports are not the search). The three
configurations run in turn, `--repeat` rounds (the order rotating each round), so a drift in the
machine's speed hits every side; the medians' ratios count. Targets (issue 37): 2 Ray tasks
>= 1.6x one Ray task on a 2-core machine; local `--workers 2` <= 1.15x 2 Ray tasks (the driver's
overhead).

    .venv/bin/python benchmarks/bench_explore_ray.py [--seconds 60] [--repeat 3] [--seed 0]

Run it on an otherwise idle machine: two workers need both cores.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    sides = {"ray x1": (1, "local"), "ray x2": (2, "local"), "local x2": (2, None)}
    rates: dict[str, list[float]] = {name: [] for name in sides}
    names = list(sides)
    for round_ in range(args.repeat):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            workers, ray = sides[name]
            rates[name].append(rate(workers, ray, args.seconds, args.seed))
            print(f"round {round_ + 1} {name}: {rates[name][-1]:.1f} examples/s", flush=True)
    median = {name: statistics.median(values) for name, values in rates.items()}
    scaling = median["ray x2"] / median["ray x1"] if median["ray x1"] else 0.0
    overhead = median["local x2"] / median["ray x2"] if median["ray x2"] else float("inf")
    for name, value in median.items():
        print(f"{name:9} median {value:.1f} examples/s ({', '.join(f'{v:.1f}' for v in rates[name])})")
    print(f"2 Ray tasks / 1 Ray task: {scaling:.2f}x (target >= {SCALING_TARGET})")
    print(f"local --workers 2 / 2 Ray tasks: {overhead:.2f}x (target <= {OVERHEAD_TARGET})")


if __name__ == "__main__":
    main()
