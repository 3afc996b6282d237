"""`kvdoctor diagnose` on a 100 MB log: time and peak memory, against a bare line-by-line read.

Generates a log of vLLM request/metrics lines (several processes, some in colour)
with an engine crash in the middle and the API server's re-raise after it, then
runs, in fresh processes side by side: a bare Python loop that only reads the
file's lines, and `kvdoctor diagnose LOG --no-run --json`. Prints wall time and
peak RSS of each and their ratio. Targets: diagnose under 10 s; its peak RSS far
below the log's size (the log is streamed, not read whole).

    uv run python benchmarks/bench_diagnose.py [--size-mb 100] [--keep FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TARGET_S = 10.0
BARE_READ = ("import sys\nn = 0\nwith open(sys.argv[1], 'rb') as f:\n    for line in f:\n        n += 1\n"
             "print(n)\n")


def generate(path: Path, size_mb: int) -> None:
    from tests.test_diagnose import SYNTHETIC

    crash = SYNTHETIC.encode()
    requests = []
    for i in range(2000):
        requests.append((f'(APIServer pid=1) INFO:     10.0.{i % 250}.{i % 200}:{40000 + i} - "POST '
                         f'/v1/chat/completions HTTP/1.1" 200 OK\n').encode())
        if i % 7 == 0:
            requests.append((f"\x1b[1;36m(EngineCore_DP0 pid=7)\x1b[0;0m INFO 08-04 09:4{i % 10}:15 "
                             f"[loggers.py:271] Engine 000: Avg prompt throughput: {i}.0 tokens/s, Running: 3 reqs, "
                             f"Waiting: {i % 9} reqs, GPU KV cache usage: 41.2%, Prefix cache hit rate: 21.7%\n")
                            .encode())
    block = b"".join(requests)
    target = size_mb << 20
    with path.open("wb") as f:
        written = 0
        crashed = False
        while written < target:
            f.write(block)
            written += len(block)
            if not crashed and written >= target // 2:
                f.write(crash)
                written += len(crash)
                crashed = True


def measure(cmd: list[str]) -> tuple[float, float, subprocess.CompletedProcess]:
    """Wall seconds and peak RSS (MiB) of one fresh child process."""
    start = time.perf_counter()
    pid = os.fork()
    if pid == 0:  # child: exec the command with stdout to a pipe file
        out = os.open(os.devnull, os.O_WRONLY) if "--json" not in cmd else os.open(CAPTURE, os.O_WRONLY | os.O_CREAT
                                                                                  | os.O_TRUNC)
        os.dup2(out, 1)
        os.execv(cmd[0], cmd)
    _, status, usage = os.wait4(pid, 0)
    elapsed = time.perf_counter() - start
    return elapsed, usage.ru_maxrss / 1024, os.waitstatus_to_exitcode(status)


CAPTURE = os.path.join(tempfile.gettempdir(), f"bench_diagnose_{os.getpid()}.json")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-mb", type=int, default=100)
    parser.add_argument("--keep", type=Path, default=None, help="write the generated log here and keep it")
    args = parser.parse_args()
    tmp = tempfile.TemporaryDirectory()
    log = args.keep or Path(tmp.name) / "engine.log"
    generate(log, args.size_mb)
    size = log.stat().st_size
    bare_s, bare_rss, _ = measure([sys.executable, "-c", BARE_READ, str(log)])
    diag_s, diag_rss, code = measure([sys.executable, "-m", "kvdoctor", "diagnose", str(log), "--no-run", "--json"])
    doc = json.loads(Path(CAPTURE).read_text())
    os.unlink(CAPTURE)
    print(f"log: {size / 2**20:.0f} MiB, {doc['log']['lines']:,} lines; crash found: "
          f"{doc['crash']['exception']} in {doc['crash']['function']}; best match: "
          f"{doc['matches'][0]['recipe'] if doc['matches'] else 'none'} (exit {code})")
    print(f"bare line read     {bare_s:6.2f} s   peak RSS {bare_rss:7.1f} MiB")
    print(f"kvdoctor diagnose  {diag_s:6.2f} s   peak RSS {diag_rss:7.1f} MiB")
    print(f"ratio diagnose/bare: time {diag_s / bare_s:.2f}, peak RSS {diag_rss / bare_rss:.2f}; "
          f"peak RSS / log size {diag_rss / (size / 2**20):.2f}")
    ok = diag_s < TARGET_S and diag_rss < size / 2**20
    print(("OK" if ok else "MISSED") + f": target under {TARGET_S:.0f} s and peak RSS below the log's size")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
