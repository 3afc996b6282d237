"""What vLLM's real worker side costs against the simulated worker.

Times, in one run, `kvdoctor repro queued-abort --logic all` with `--worker vllm`
(`--device cpu`) against the same with `--worker simulated`, two ways:
- command: fresh processes, interleaved, median of N (what a user waits for; the
  vLLM import is in both);
- in-process: the same `app.repro` call after vLLM is imported and both paths are
  warm, interleaved, median of N (the worker's own cost, import excluded).
Target: command ratio <= 1.3.

    uv run python benchmarks/bench_worker.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from kvdoctor.engine.overrides import Overrides

BASE = [sys.executable, "-m", "kvdoctor", "repro", "queued-abort", "--logic", "all", "--json"]
VLLM = ["--worker", "vllm", "--device", "cpu"]
SIMULATED = ["--worker", "simulated"]
TARGET = 1.3


def timed_command(cmd: list[str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if proc.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()[-300:]}")
    return elapsed


def in_process(repeat: int) -> tuple[float, float]:
    from kvdoctor import app

    overrides = {"simulated": {"worker": "simulated"}, "vllm": {"worker": "vllm", "device": "cpu"}}
    times: dict[str, list[float]] = {"simulated": [], "vllm": []}
    for name in times:  # warm: imports, model config, first connector
        app.repro("queued-abort", Overrides(**overrides[name]), "all")
    for _ in range(repeat):
        for name in times:
            start = time.perf_counter()
            app.repro("queued-abort", Overrides(**overrides[name]), "all")
            times[name].append(time.perf_counter() - start)
    return statistics.median(times["simulated"]), statistics.median(times["vllm"])


def memory(num_blocks: int, block_size: int) -> None:
    """Bytes of the KV tensors and the copy engine's CPU tier for a geometry (exact, from the tensors)."""
    from kvdoctor import app
    from kvdoctor.engine.harness import Harness
    from kvdoctor.recipes.builtins import resolve

    recipe = resolve("queued-abort")
    setup = app.resolve_setup(recipe, Overrides(worker="vllm", device="cpu", gpu_blocks=num_blocks,
                                       block_size=block_size))
    harness = Harness(app.load_vllm(), setup)
    try:
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in harness.worker.kv_caches.values()}
        gpu_side = sum(storages.values())
        cpu_tier = sum(t.nbytes for t in harness.worker.engine.cpu_tensors)
    finally:
        harness.shutdown()
    print(f"{num_blocks} blocks of {block_size} tokens: KV tensors {gpu_side / 1e6:.1f} MB, "
          f"CPU tier {cpu_tier / 1e6:.1f} MB (cpu_bytes_to_use {setup.cpu_bytes_to_use / 2**20:.0f} MiB)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--memory", action="store_true", help="only print what a 100,000-block geometry costs")
    args = parser.parse_args()
    if args.memory:
        for block_size in (4, 16):
            memory(100_000, block_size)
        return 0
    sim, real = [], []
    timed_command(BASE + SIMULATED)  # warm the page cache once
    for _ in range(args.repeat):
        sim.append(timed_command(BASE + SIMULATED))
        real.append(timed_command(BASE + VLLM))
    s, r = statistics.median(sim), statistics.median(real)
    ratio = r / s
    print(f"command, --worker simulated (median of {args.repeat}): {s:6.2f} s")
    print(f"command, --worker vllm --device cpu:        {r:6.2f} s")
    print(f"command ratio: {ratio:.2f} (target <= {TARGET}) {'OK' if ratio <= TARGET else 'OVER TARGET'}")
    si, ri = in_process(args.repeat)
    print(f"in-process (import excluded), simulated: {si * 1000:7.1f} ms; vllm: {ri * 1000:7.1f} ms; "
          f"ratio {ri / si:.2f}")
    return 0 if ratio <= TARGET else 1


if __name__ == "__main__":
    raise SystemExit(main())
