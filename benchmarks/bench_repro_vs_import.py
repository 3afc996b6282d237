"""How much kvdoctor adds on top of the unavoidable cost of importing vLLM.

Times, in one run, `kvdoctor repro queued-abort --logic all` against a bare `python -c` import of
vLLM's scheduler, connector and config modules: each a fresh process (a cold start of the
interpreter, vLLM and kvdoctor), alternated, median of N. Target: wall-clock ratio <= 1.1 (issue 33:
a run pays one vLLM import, never a second one for vLLM's model inspection). The CPU time (user +
system, children included) is printed too: on a loaded machine it moves less than the wall clock.
A third process imports the scheduler stack plus the worker side the default `--worker vllm` drives
(vLLM's worker-role connector and runner glue: ~1-2 s of vLLM's model loader and tracing imports);
repro against it is what kvdoctor itself adds, printed beside the target's ratio.

kvdoctor's cache (vLLM's model-info cache, `kvdoctor cache`) is a folder of this benchmark's,
filled by one warm-up run and removed at the end, as a user's is after their first run; the
warm-up's time is printed too (what the first run ever pays).

    uv run python benchmarks/bench_repro_vs_import.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

BARE_IMPORT = (
    "import vllm.config, vllm.v1.core.sched.scheduler, "
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector, "
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler"
)
BARE = [sys.executable, "-c", BARE_IMPORT]
# What the default `--worker vllm` drives on top (compat/worker.py's worker modules): vLLM's own
# worker-role connector and the V1 runner glue, whose import (the model loader, tracing) every vLLM
# worker process pays. Printed beside the target's ratio, not instead of it.
WORKER_IMPORT = (
    "import vllm.distributed.kv_transfer.kv_connector.factory, vllm.forward_context, "
    "vllm.v1.kv_offload.cpu.gpu_worker\n"
    "try:\n import vllm.v1.worker.kv_connector_model_runner_mixin\nexcept ImportError:\n pass\n"
    "try:\n import vllm.v1.worker.gpu.kv_connector\nexcept ImportError:\n pass"
)
BARE_WITH_WORKER = [sys.executable, "-c", BARE_IMPORT + "\n" + WORKER_IMPORT]
REPRO = [sys.executable, "-m", "kvdoctor", "repro", "queued-abort", "--logic", "all", "--json"]
TARGET = 1.1


def timed(cmd: list[str], ok_codes: tuple[int, ...], env: dict[str, str]) -> tuple[float, float]:
    """Wall-clock seconds and CPU seconds (user + system, with the children it waited for: a second vLLM
    import in a subprocess counts) of one fresh process."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    assert proc.stderr is not None
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    elapsed = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode not in ok_codes:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}: {err.decode(errors='replace').strip()[-300:]}")
    return elapsed, usage.ru_utime + usage.ru_stime


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs of each (at least 3)")
    args = parser.parse_args()
    repeat = max(3, args.repeat)
    cache = tempfile.mkdtemp(prefix="kvdoctor-bench-cache-")
    env = {**os.environ, "KVDOCTOR_CACHE_DIR": cache}
    env.pop("VLLM_CACHE_ROOT", None)  # kvdoctor's own cache, as a user without one set has it
    try:
        timed(BARE, (0,), env)  # the page cache warm for both
        first = timed(REPRO, (0, 1), env)  # fills kvdoctor's cache, as a user's first run does
        bare: list[tuple[float, float]] = []
        repro: list[tuple[float, float]] = []
        with_worker: list[tuple[float, float]] = []
        for _ in range(repeat):  # alternated: a load change on the machine hits all alike
            bare.append(timed(BARE, (0,), env))
            repro.append(timed(REPRO, (0, 1), env))
            with_worker.append(timed(BARE_WITH_WORKER, (0,), env))
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    b, r = (statistics.median(t for t, _ in bare), statistics.median(t for t, _ in repro))
    b_cpu, r_cpu = (statistics.median(c for _, c in bare), statistics.median(c for _, c in repro))
    ratio = r / b
    print(f"bare vLLM import (median of {repeat}):      {b:6.2f} s wall, {b_cpu:6.2f} s CPU  "
          f"(wall {', '.join(f'{t:.2f}' for t, _ in bare)})")
    print(f"kvdoctor repro queued-abort --logic all: {r:6.2f} s wall, {r_cpu:6.2f} s CPU  "
          f"(wall {', '.join(f'{t:.2f}' for t, _ in repro)})")
    print(f"  its first run (fills kvdoctor's cache): {first[0]:6.2f} s wall, {first[1]:6.2f} s CPU")
    print(f"CPU ratio: {r_cpu / b_cpu:.2f} (the load of a shared machine moves it less than the wall clock's)")
    w, w_cpu = statistics.median(t for t, _ in with_worker), statistics.median(c for _, c in with_worker)
    print(f"bare import + the worker side it drives:  {w:6.2f} s wall, {w_cpu:6.2f} s CPU  "
          f"(wall {', '.join(f'{t:.2f}' for t, _ in with_worker)})")
    print(f"repro against that: {r / w:.2f} wall, {r_cpu / w_cpu:.2f} CPU (what kvdoctor adds to vLLM's imports)")
    print(f"ratio: {ratio:.2f} (target <= {TARGET}) {'OK' if ratio <= TARGET else 'OVER TARGET'}")
    return 0 if ratio <= TARGET else 1


if __name__ == "__main__":
    raise SystemExit(main())
