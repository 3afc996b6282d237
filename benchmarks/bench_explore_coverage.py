"""How much of vLLM's offloading connector code explore and audit run: line coverage per file, side by side.

Each measurement runs in a fresh process under the same measurement (`kvdoctor.observe.line_coverage`:
coverage.py over the installed vLLM's `distributed/kv_transfer/kv_connector/v1/offloading/` and
`v1/kv_offload/`, started before vLLM is imported, so the lines an import runs count for every column):

- explore: `explore --coverage --seed S --time-budget T`, one worker (the search steered by coverage);
- audit: `kvdoctor audit` (every built-in recipe);
- explore + audit: the union of the two;
- p2p: the P2P pair (kvdoctor/engine/p2p.py: two engines over in-memory transports) over --p2p-plans fault
  plans (explore does not draw the pair yet), and all: explore + audit + p2p;
- unit tests (only with --unit-tests DIR, a folder of vLLM's own connector tests you already have, e.g.
  from the release's sdist: nothing is downloaded): `pytest DIR` in this interpreter.

    python benchmarks/bench_explore_coverage.py [--time-budget 120] [--seed 1] [--unit-tests DIR] [--json FILE]

Run it with the Python of the vLLM environment to measure (e.g. .venv-vllm-0.34/bin/python).
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
from typing import Any

# One measured run: the line coverage starts before anything imports vLLM; the lines executed go to a file.
CHILD = """import json, sys
from kvdoctor.observe.line_coverage import LineCoverage
what, out = sys.argv[1], sys.argv[2]
args = sys.argv[3:]
if what == "explore":
    from pathlib import Path
    from kvdoctor.explore import app
    from kvdoctor.explore.search import ExploreConfig
    seed, budget, folder = int(args[0]), float(args[1]), Path(args[2])
    config = ExploreConfig(seed=seed, time_budget=budget, max_examples=None, workers=1, coverage=True)
    report = app.explore(config, folder)
    executed = report.result.coverage or {}
    extra = {"examples": report.result.stats.examples, "findings": [f.signature for f in report.findings]}
else:
    lines = LineCoverage()
    lines.start()
    try:
        if what == "audit":  # the CLI's command in this process (its console script ends with os._exit)
            from kvdoctor.cli.app import app as cli
            try:
                cli(args=["audit", "--json"], prog_name="kvdoctor", standalone_mode=False)
            except SystemExit:
                pass
        elif what == "p2p":  # the P2P pair (engine/p2p.py) over every plan tier_draw.p2p_plan_fields decodes
            from kvdoctor.engine.compat import load
            from kvdoctor.engine.p2p import P2PPlan, run_pair
            from kvdoctor.explore.tier_draw import p2p_plan_fields
            api = load()
            runs = [run_pair(api, P2PPlan(**p2p_plan_fields(byte))) for byte in range(int(args[0]))]
            extra_p2p = {"examples": len(runs), "findings": sorted({v for r in runs for v in r.violations})}
        else:  # vLLM's unit tests
            import pytest
            pytest.main(["-q", "-p", "no:cacheprovider", *args])
    finally:
        lines.stop()
    executed, extra = lines.executed(), (extra_p2p if what == "p2p" else {})
with open(out, "w", encoding="utf-8") as handle:
    json.dump({"executed": executed, **extra}, handle)
"""


def measure(what: str, *args: str, timeout: float = 1800) -> tuple[dict[str, Any], float]:
    """(what the child measured, wall seconds) of one fresh process."""
    with tempfile.TemporaryDirectory(prefix="kvdoctor-bench-cov-") as folder:
        out = Path(folder) / "executed.json"
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", CHILD, what, str(out), *args], capture_output=True, text=True,
                              timeout=timeout, env=env, cwd=folder)
        elapsed = time.perf_counter() - start
        if not out.exists():
            raise SystemExit(f"{what} exited {proc.returncode} without measuring: {proc.stderr.strip()[-600:]}")
        return json.loads(out.read_text(encoding="utf-8")), elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-budget", type=float, default=120.0, help="explore's --time-budget (seconds)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--unit-tests", type=Path, default=None,
                        help="a folder of vLLM's own connector unit tests to run under the same measurement")
    parser.add_argument("--p2p-plans", type=int, default=128,
                        help="P2P pair runs (engine/p2p.py) over the first N plans tier_draw.p2p_plan_fields decodes, "
                             "measured in a process of their own (0: none; skipped where vLLM has no P2P tier)")
    parser.add_argument("--json", type=Path, default=None, help="also write the table as JSON to FILE")
    args = parser.parse_args()

    from kvdoctor.observe.line_coverage import merge_executed, report

    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="kvdoctor-bench-explore-") as folder:
        runs["explore"], explore_s = measure("explore", str(args.seed), str(args.time_budget), folder)
    runs["audit"], audit_s = measure("audit")
    columns = {"explore": runs["explore"]["executed"], "audit": runs["audit"]["executed"]}
    columns["explore+audit"] = merge_executed([columns["explore"], columns["audit"]])
    timings = {"explore": explore_s, "audit": audit_s}
    if args.unit_tests is not None:
        if not args.unit_tests.is_dir():
            raise SystemExit(f"--unit-tests {args.unit_tests}: not a folder")
        runs["unit tests"], timings["unit tests"] = measure("pytest", str(args.unit_tests.resolve()))
        columns["unit tests"] = runs["unit tests"]["executed"]
    from kvdoctor.engine.compat.p2p_transport import p2p_probe

    if args.p2p_plans > 0 and p2p_probe() is None:
        runs["p2p"], timings["p2p"] = measure("p2p", str(args.p2p_plans))
        columns["p2p"] = runs["p2p"]["executed"]
        columns["all"] = merge_executed([columns["explore+audit"], columns["p2p"]])
    reports = {name: report(executed) for name, executed in columns.items()}

    import vllm  # the release measured (imported after the children: this process measures nothing)

    print(f"vLLM {vllm.__version__}: line coverage of the connector's code, per file "
          f"(explore --seed {args.seed} --time-budget {args.time_budget:g}, one worker, --coverage: "
          f"{runs['explore']['examples']} examples in {explore_s:.0f} s wall with vLLM's import; "
          f"audit in {audit_s:.0f} s)")
    names = list(reports)
    first = reports[names[0]]
    width = max(len(f.file) for f in first.files)
    print(f"{'file':<{width}}  {'stmts':>5}  " + "  ".join(f"{n:>13}" for n in names))
    for index, entry in enumerate(first.files):
        cells = [f"{reports[n].files[index].percent:>12.0f}%" for n in names]
        print(f"{entry.file:<{width}}  {entry.statements:>5}  " + "  ".join(cells))
    print(f"{'total':<{width}}  {first.statements:>5}  "
          + "  ".join(f"{reports[n].percent:>12.1f}%" for n in names))
    if "p2p" in runs:
        print(f"p2p: {runs['p2p']['examples']} pair runs in {timings['p2p']:.0f} s wall; violations: "
              + ("; ".join(runs["p2p"]["findings"]) or "none"))
    if runs["explore"].get("findings"):
        print("explore's findings: " + "; ".join(runs["explore"]["findings"]))
    if args.json is not None:
        args.json.write_text(json.dumps({"vllm": vllm.__version__, "seed": args.seed,
                                         "time_budget_s": args.time_budget, "timings_s": timings,
                                         "coverage": {n: r.as_dict() for n, r in reports.items()}}, indent=1),
                             encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
