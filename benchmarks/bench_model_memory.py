"""Peak memory of `kvdoctor repro` at a real model's geometry (issue 23), measured with /usr/bin/time -v.

Runs, each in a fresh process, on the CLI's default worker (vLLM's worker-role connector, whose KV tensors hold
16-byte fingerprints a token slot, one layer a KV cache group; the scheduler plans with the model's real pages):
  repro queued-abort --model <Llama-3.1-8B config> --block-size 16 --num-gpu-blocks-override N
        --kv-offloading-size 64 --kv-offloading-backend native
(the issue's command as given: every logic variant, each freeing its KV tensors before the next)
for N in 20,000 and 1,000,000, the same with Gemma-3-27B (sliding + full: 7 groups) at 1,000,000, then
Qwen3-0.6B at 1,000 blocks with --logic all, and prints the outcome, exit code, worker, wall time and peak RSS.
Target: peak RSS under 2 GB; an OOM kill (exit 137) is the defect this guards against.
Measured on 0.26.0 (2 loaded cores): 20,000 blocks 1.02 GB, 10^6 blocks 1.46 GB (1.30 GB with --logic installed),
Gemma-3-27B 10^6 blocks 1.46 GB, Qwen3-0.6B --logic all 1.02 GB (before: OOM-killed at 21.8 GB, and 4.7 GB).

    PYTHONPATH=. python benchmarks/bench_model_memory.py [--blocks 20000,1000000]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LLAMA = ROOT / "tests" / "data" / "configs" / "llama-3.1-8b"
TARGET_BYTES = 2 << 30


QWEN = ROOT / "tests" / "data" / "configs" / "qwen3-0.6b"
GEMMA = ROOT / "tests" / "data" / "configs" / "gemma-3-27b"


def measure(blocks: int, model: Path = LLAMA, extra: tuple[str, ...] = ("--kv-offloading-size", "64",
            "--kv-offloading-backend", "native")) -> dict:
    cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "kvdoctor", "repro", "queued-abort", "--model", str(model),
           "--block-size", "16", "--num-gpu-blocks-override", str(blocks), *extra]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - start
    rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr).group(1))
    outcome = re.search(r"^installed\s+(\w+)", proc.stdout, re.M)
    worker = re.search(r"worker=(\w+)", proc.stdout)
    return {"model": model.name, "blocks": blocks, "exit": proc.returncode,
            "outcome": outcome.group(1) if outcome else None,
            "worker": worker.group(1) if worker else None, "wall_s": round(wall, 1), "peak_rss_mb": rss_kb // 1024}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", default="20000,1000000")
    args = parser.parse_args()
    worst = 0
    for blocks in (int(b) for b in args.blocks.split(",")):
        row = measure(blocks)
        worst = max(worst, row["peak_rss_mb"] << 20)
        print(row, flush=True)
    row = measure(1_000_000, GEMMA)  # a hybrid: 7 KV cache groups, their fingerprints aliasing one allocation
    worst = max(worst, row["peak_rss_mb"] << 20)
    print(row, flush=True)
    row = measure(1000, QWEN, ("--logic", "all"))
    worst = max(worst, row["peak_rss_mb"] << 20)
    print(row, flush=True)
    print(f"peak RSS {worst / 2**30:.2f} GiB (target under {TARGET_BYTES / 2**30:.0f} GiB)")
    return 0 if worst < TARGET_BYTES else 1


if __name__ == "__main__":
    sys.exit(main())
