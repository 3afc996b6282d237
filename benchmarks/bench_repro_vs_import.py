"""How much kvdoctor adds on top of the unavoidable cost of importing vLLM.

Times, in one run, `kvdoctor repro queued-abort --logic all` against a bare
`python -c` import of vLLM's scheduler, connector and config modules (fresh
processes, interleaved, median of N). Target: ratio <= 1.3.

    uv run python benchmarks/bench_repro_vs_import.py [--repeat 3]
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
REPRO = [sys.executable, "-m", "kvdoctor", "repro", "queued-abort", "--logic", "all", "--json"]
TARGET = 1.3


def timed(cmd: list[str], ok_codes: tuple[int, ...]) -> float:
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if proc.returncode not in ok_codes:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()[-300:]}")
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    bare, repro = [], []
    timed([sys.executable, "-c", BARE_IMPORT], (0,))  # warm the page cache once
    for _ in range(args.repeat):
        bare.append(timed([sys.executable, "-c", BARE_IMPORT], (0,)))
        repro.append(timed(REPRO, (0, 1)))
    b, r = statistics.median(bare), statistics.median(repro)
    ratio = r / b
    print(f"bare vLLM import (median of {args.repeat}): {b:6.2f} s")
    print(f"kvdoctor repro queued-abort --logic all:  {r:6.2f} s")
    print(f"ratio: {ratio:.2f} (target <= {TARGET}) {'OK' if ratio <= TARGET else 'OVER TARGET'}")
    return 0 if ratio <= TARGET else 1


if __name__ == "__main__":
    raise SystemExit(main())
