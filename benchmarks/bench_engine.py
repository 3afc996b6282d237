"""The engine levels side by side, measured in one run.

    PYTHONPATH=. python benchmarks/bench_engine.py ratio [--repeat N]
        `kvdoctor repro queued-abort` with --engine scheduler and --engine core, alternated in fresh
        processes (the whole command: import, build, three logic variants); prints each wall time,
        the medians and the ratio core/scheduler (target <= 1.5).
    PYTHONPATH=. python benchmarks/bench_engine.py inproc [--repeat N]
        the same three runs in one process after one vLLM import (the import, ~half of the command's
        time and the noisiest part on a loaded machine, left out), alternated; medians and ratio.
    PYTHONPATH=. python benchmarks/bench_engine.py serve [--repeat N]
        `kvdoctor repro queued-abort --engine serve --json` (the whole command: server start-up, the
        paced traffic, the verdict from the server's log, the stop); prints each wall time and the
        verdict (target: a verdict within 90 s on the 2-core machine).
    PYTHONPATH=. python benchmarks/bench_engine.py export [RECIPE]
        `--export-script FILE --engine serve` for RECIPE (default queued-abort; a silent one, e.g.
        final-token-slot-stored, compares its clients' answers with an offloading-off server), then the
        script run with this Python
        (no kvdoctor on its path); prints its exit code, wall time and the exit kvdoctor's measured
        outcome for this release implies (reproduced: 1, not_reproduced: 0).
    PYTHONPATH=. python benchmarks/bench_engine.py compare [RECIPE ...]
        every built-in recipe (or those named) at both levels in one process, installed logic,
        the CLI's default worker; prints one Markdown row per recipe (docs/engine-levels.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ratio(repeat: int) -> int:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    times: dict[str, list[float]] = {"scheduler": [], "core": []}
    for _ in range(repeat):
        for level in ("scheduler", "core"):
            start = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "kvdoctor", "repro", "queued-abort", "--engine", level,
                                   "--json"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
            elapsed = time.perf_counter() - start
            times[level].append(elapsed)
            print(f"{level:9s} {elapsed:6.1f} s  exit {proc.returncode}", flush=True)
    med = {level: statistics.median(values) for level, values in times.items()}
    best = {level: min(values) for level, values in times.items()}
    print(f"median: scheduler {med['scheduler']:.1f} s, core {med['core']:.1f} s, "
          f"ratio core/scheduler {med['core'] / med['scheduler']:.2f} (target <= 1.5)")
    # On a shared machine the fastest run is the one least disturbed by other load.
    print(f"best:   scheduler {best['scheduler']:.1f} s, core {best['core']:.1f} s, "
          f"ratio core/scheduler {best['core'] / best['scheduler']:.2f} (target <= 1.5)")
    return 0


def inproc(repeat: int) -> int:
    """The run alone, after one vLLM import: queued-abort under the three logic variants, alternated."""
    from kvdoctor.app import load_vllm
    from kvdoctor.cli.options import worker_overrides
    from kvdoctor.levels.core import run_core_scenario
    from kvdoctor.levels.scheduler import run_scenario
    from kvdoctor.recipes.builtins import resolve
    from kvdoctor.resolution import resolve_setup

    api = load_vllm()
    recipe = resolve("queued-abort")
    setup = resolve_setup(recipe, worker_overrides(None, None, None))
    times: dict[str, list[float]] = {"scheduler": [], "core": []}
    for i in range(repeat + 1):  # the first round warms both paths (imports, ModelConfig) and is not counted
        for level, runner in (("scheduler", run_scenario), ("core", run_core_scenario)):
            start = time.perf_counter()
            outcomes = [runner(api, recipe, setup, logic).outcome.value
                        for logic in ("installed", "fixed", "unpatched")]
            elapsed = time.perf_counter() - start
            if i:
                times[level].append(elapsed)
            print(f"{'warm-up ' if not i else ''}{level:9s} {elapsed:6.2f} s  {outcomes}", flush=True)
    med = {level: statistics.median(values) for level, values in times.items()}
    print(f"in-process median: scheduler {med['scheduler']:.2f} s, core {med['core']:.2f} s, "
          f"ratio core/scheduler {med['core'] / med['scheduler']:.2f}")
    return 0


def serve(repeat: int) -> int:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "kvdoctor", "repro", "queued-abort", "--engine", "serve",
                               "--json"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        elapsed = time.perf_counter() - start
        times.append(elapsed)
        try:
            import json

            result = json.loads(proc.stdout)["results"][0]
            verdict = f"{result['outcome']} ({(result.get('failure') or {}).get('function') or result['detail'][:80]})"
        except (ValueError, KeyError, IndexError):
            verdict = f"no JSON: {proc.stderr.strip()[-200:]}"
        print(f"serve {elapsed:6.1f} s  exit {proc.returncode}  {verdict}", flush=True)
    print(f"median {statistics.median(times):.1f} s, best {min(times):.1f} s (target: a verdict within 90 s)")
    return 0


def export(recipe: str) -> int:
    import tempfile

    from kvdoctor.engine.compat import installed_vllm_version
    from kvdoctor.matrix import data

    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with tempfile.TemporaryDirectory(prefix="kvdoctor-bench-export-") as folder:
        script = os.path.join(folder, recipe.replace("-", "_") + "_serve.py")
        subprocess.run([sys.executable, "-m", "kvdoctor", "repro", recipe, "--engine", "serve",
                        "--export-script", script], cwd=ROOT, env=env, check=True, capture_output=True)
        plain = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the script runs without kvdoctor
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, script], cwd=folder, env=plain, capture_output=True, text=True,
                              timeout=900)
        elapsed = time.perf_counter() - start
    release = installed_vllm_version()
    rows = [r for r in data.load() if r.release == release and r.recipe == recipe]
    expected = {"reproduced": 1, "not_reproduced": 0}.get(rows[0].outcome) if rows else None
    print(proc.stdout.strip()[-1500:] if proc.stdout.strip() else proc.stderr[-300:])
    print(f"vLLM {release}: exported serve script exit {proc.returncode} in {elapsed:.1f} s; kvdoctor's "
          f"measurement implies {expected if expected is not None else '(no row)'}"
          f"{'' if expected is None else ' (agrees)' if expected == proc.returncode else ' (DISAGREES)'}")
    return 0


def compare(names: list[str]) -> int:
    from kvdoctor.app import load_vllm
    from kvdoctor.cli.options import worker_overrides
    from kvdoctor.errors import KvdoctorError
    from kvdoctor.levels.core import run_core_scenario
    from kvdoctor.levels.scheduler import run_scenario
    from kvdoctor.recipes.builtins import all_builtins
    from kvdoctor.resolution import resolve_setup

    api = load_vllm()
    print(f"vLLM {api.version_text}, {time.strftime('%Y-%m-%d')}")
    print("| recipe | scheduler | core | same outcome and site (or not_applicable at core) |\n|---|---|---|---|")
    for recipe in all_builtins():
        if names and recipe.name not in names:
            continue
        setup = resolve_setup(recipe, worker_overrides(None, None, None))
        cells = []
        for runner in (run_scenario, run_core_scenario):
            try:
                result = runner(api, recipe, setup, "installed")
                site = result.failure.function if result.failure else (
                    ", ".join(v.invariant for v in result.violations) if result.violations else "")
                text = result.outcome.value + (f" ({site})" if site else "")
                if result.outcome.value in ("not_applicable", "other_failure", "setup_error"):
                    text += f": {result.detail[:160]}"
                cells.append((result.outcome.value, site, text))
            except KvdoctorError as exc:
                cells.append(("error", "", f"error: {exc}"))
        agree = cells[1][0] == "not_applicable" or cells[0][:2] == cells[1][:2]
        print(f"| {recipe.name} | {cells[0][2]} | {cells[1][2]} | {'yes' if agree else 'NO'} |", flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="mode", required=True)
    r = sub.add_parser("ratio")
    r.add_argument("--repeat", type=int, default=2)
    i = sub.add_parser("inproc")
    i.add_argument("--repeat", type=int, default=3)
    sv = sub.add_parser("serve")
    sv.add_argument("--repeat", type=int, default=1)
    e = sub.add_parser("export")
    e.add_argument("recipe", nargs="?", default="queued-abort")
    c = sub.add_parser("compare")
    c.add_argument("recipes", nargs="*")
    args = parser.parse_args()
    if args.mode == "ratio":
        return ratio(args.repeat)
    if args.mode == "serve":
        return serve(args.repeat)
    if args.mode == "export":
        return export(args.recipe)
    return inproc(args.repeat) if args.mode == "inproc" else compare(args.recipes)


if __name__ == "__main__":
    sys.exit(main())
