"""How `kvdoctor repro queued-abort` grows with the GPU pool.

Times, in one run, fresh processes of `kvdoctor repro queued-abort --logic all`
at 1,000 / 10,000 / 100,000 GPU blocks of 16 tokens (production flags: a
131,072-token max_model_len, an 8,192-token step budget, 256 sequences,
chunked prefill), interleaved with a bare import of vLLM's scheduler, connector
and config modules; wall time and peak RSS (the child's ru_maxrss) are medians
of N. Printed as a table, as the ratio to the bare import, and as the ratio of
100,000 to 1,000 blocks (target: <= 2).

    uv run python benchmarks/bench_scale.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

BARE_IMPORT = (
    "import vllm.config, vllm.v1.core.sched.scheduler, "
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector, "
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler"
)
POOLS = (1_000, 10_000, 100_000)
FLAGS = ["--block-size", "16", "--max-model-len", "131072", "--max-num-batched-tokens", "8192",
         "--max-num-seqs", "256", "--enable-chunked-prefill"]
TARGET = 2.0


def measured(cmd: list[str], ok_codes: tuple[int, ...]) -> tuple[float, float]:
    """(wall seconds, peak RSS MiB) of one fresh child process."""
    # ru_maxrss of RUSAGE_CHILDREN is the largest child so far: run each command in its own
    # wrapper process so the figure is this command's.
    wrapper = [sys.executable, "-c",
               "import resource, subprocess, sys; rc = subprocess.call(sys.argv[1:]); "
               "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); sys.exit(rc)",
               *cmd]
    start = time.perf_counter()
    proc = subprocess.run(wrapper, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if proc.returncode not in ok_codes:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()[-300:]}")
    peak_kib = int(proc.stderr.strip().splitlines()[-1])
    return elapsed, peak_kib / 1024


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    bare_cmd = [sys.executable, "-c", BARE_IMPORT]
    measured(bare_cmd, (0,))  # warm the page cache once
    rows: dict[str, list[tuple[float, float]]] = {"bare import": []}
    for pool in POOLS:
        rows[f"{pool:,} blocks"] = []
    for _ in range(args.repeat):
        rows["bare import"].append(measured(bare_cmd, (0,)))
        for pool in POOLS:
            cmd = [sys.executable, "-m", "kvdoctor", "repro", "queued-abort", "--logic", "all", "--json",
                   "--num-gpu-blocks-override", str(pool), *FLAGS]
            rows[f"{pool:,} blocks"].append(measured(cmd, (0, 1)))  # 1 on 0.26.0 (reproduced), 0 on newer
    medians = {name: (statistics.median(t for t, _ in runs), statistics.median(m for _, m in runs))
               for name, runs in rows.items()}
    bare_t, bare_m = medians["bare import"]
    print(f"{'':16} {'wall s':>8} {'peak MiB':>9} {'x import':>9} {'x import mem':>12}   (medians of {args.repeat})")
    for name, (t, m) in medians.items():
        print(f"{name:16} {t:8.2f} {m:9.0f} {t / bare_t:9.2f} {m / bare_m:12.2f}")
    small = medians[f"{POOLS[0]:,} blocks"]
    large = medians[f"{POOLS[-1]:,} blocks"]
    ratio = large[0] / small[0]
    print(f"{POOLS[-1]:,} vs {POOLS[0]:,} blocks: time x{ratio:.2f}, memory x{large[1] / small[1]:.2f} "
          f"(target time <= {TARGET}) {'OK' if ratio <= TARGET else 'OVER TARGET'}")
    return 0 if ratio <= TARGET else 1


if __name__ == "__main__":
    raise SystemExit(main())
