"""What a full garbage collection at harness shutdown costs a simulated-worker run, side by side.

The harness collects at shutdown only where a worker held KV tensors (vLLM's worker); this measures
`kvdoctor repro RECIPE --logic all --worker simulated` in one process, alternating runs with the
collection forced at every shutdown and without it, after enough live objects to stand for a test
session's heap (vLLM imported, earlier reports kept).

    PYTHONPATH=. python benchmarks/bench_shutdown_gc.py [--recipe queued-abort] [--rounds 5]

Prints the median seconds per repro each way and their ratio.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", default="queued-abort")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    from kvdoctor import app
    from kvdoctor.engine.harness import Harness
    from kvdoctor.engine.overrides import Overrides

    overrides = Overrides(worker="simulated")
    kept = [app.repro(args.recipe, overrides, "all", record_timeline=True) for _ in range(3)]  # warm, and a heap
    plain = Harness.shutdown

    def collecting(self) -> None:
        plain(self)
        gc.collect()

    times: dict[str, list[float]] = {"without": [], "with gc.collect": []}
    for _ in range(args.rounds):
        for name, shutdown in (("without", plain), ("with gc.collect", collecting)):
            Harness.shutdown = shutdown
            try:
                started = time.perf_counter()
                kept.append(app.repro(args.recipe, overrides, "all", record_timeline=True))
                times[name].append(time.perf_counter() - started)
            finally:
                Harness.shutdown = plain
    without, with_gc = (statistics.median(times[name]) for name in ("without", "with gc.collect"))
    print(f"{args.recipe} --logic all, simulated worker, {args.rounds} rounds: {without:.3f} s without, "
          f"{with_gc:.3f} s with gc.collect at shutdown ({with_gc / without:.1f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
