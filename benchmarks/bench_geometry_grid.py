"""The K1/K2/K4/K8 recipes over a grid of user geometries: no cell may end as an all-clear.

Block sizes 4, 16, 32, 64 x blocks per chunk 1, 2, 4 x async scheduling on/off x no pool given / a
user-fixed pool (`--num-gpu-blocks-override` 8, the recipes' own, and 512, a deployment's). On a vLLM with
the bugs every cell must be `reproduced`, or `untested` naming a flag the user fixed; never
`not_applicable` or any other outcome that exits 0. One process, one vLLM import: cells are in-process
calls of `kvdoctor.resolution.resolve_setup` and the scheduler level's `judged_run`, as `kvdoctor repro`
makes them.

    PYTHONPATH=. python benchmarks/bench_geometry_grid.py [--worker simulated|vllm] [--json FILE]

Prints one line per cell that broke the rule, a tally of outcomes, and the wall time.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

from kvdoctor.engine.overrides import Overrides

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

RECIPES = ("queued-abort", "preemption", "prefetch", "finished-after-finalize", "final-token-slot-stored",
           "preempt-reload-same-step")
BLOCK_SIZES = (4, 16, 32, 64)
BLOCKS_PER_CHUNK = (1, 2, 4)
ASYNC = (False, True)
POOLS = (None, 8, 512)  # None: the user gives no pool (kvdoctor derives it)


def cells(recipes=RECIPES, block_sizes=BLOCK_SIZES, blocks_per_chunk=BLOCKS_PER_CHUNK, modes=ASYNC, pools=POOLS):
    return list(itertools.product(recipes, block_sizes, blocks_per_chunk, modes, pools))


def overrides_of(cell, worker: str) -> dict:
    _, block_size, bpc, mode, pool = cell
    return dict(block_size=block_size, blocks_per_chunk=bpc, async_scheduling=mode, gpu_blocks=pool,
                worker=worker)


def run_cell(api, cell, worker: str = "simulated") -> dict:
    """One cell as `kvdoctor repro <recipe> --logic installed <flags>` runs it, in this process."""
    from kvdoctor.levels.runners import runner
    from kvdoctor.outcome_codes import exit_code_for
    from kvdoctor.recipes.builtins import resolve
    from kvdoctor.resolution import resolve_setup

    run_scenario = runner("scheduler").judged_run  # as repro runs it: a broken measured reason judged
    recipe = resolve(cell[0])
    setup = resolve_setup(recipe, Overrides(**overrides_of(cell, worker)))
    result = run_scenario(api, recipe, setup, "installed")
    return {"cell": list(cell), "outcome": result.outcome.value, "exit": int(exit_code_for(result.outcome.value)),
            "detail": result.detail, "derived": list(setup.derived), "fixed": list(setup.fixed)}


# The flag each user-fixed Setup field is named by in an untested cell's reason.
FLAG_OF = {"gpu_blocks": "--num-gpu-blocks-override", "async_scheduling": "async-scheduling",
           "block_size": "--block-size", "blocks_per_chunk": "--blocks-per-chunk"}


def violation(row: dict, bug_present: bool = True) -> str | None:
    """Why a cell breaks the rule (None: it keeps it)."""
    outcome = row["outcome"]
    if outcome == "untested":
        named = [FLAG_OF[f] for f in row["fixed"] if f in FLAG_OF and FLAG_OF[f] in row["detail"]]
        return None if named and "prevents it" in row["detail"] else "untested without naming a flag the user fixed"
    if bug_present:
        return None if outcome == "reproduced" else f"{outcome} (exit {row['exit']})"
    # a release without the bug: held, or honestly not tested (not_reached, exit 6); never a false alarm
    return None if outcome in ("not_reproduced", "not_reached") else f"{outcome} (exit {row['exit']})"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", default="simulated", choices=("simulated", "vllm"))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--fixed", action="store_true", help="the installed vLLM has the fixes: expect "
                        "not_reproduced (or untested, named) instead of reproduced")
    args = parser.parse_args()
    from kvdoctor.engine import compat

    api = compat.load()
    start = time.perf_counter()
    rows, tally = [], {}
    for cell in cells():
        row = run_cell(api, cell, args.worker)
        rows.append(row)
        tally[row["outcome"]] = tally.get(row["outcome"], 0) + 1
        broken = violation(row, bug_present=not args.fixed)
        if broken:
            print(f"BROKEN {cell}: {broken}: {row['detail'][:200]}", flush=True)
    elapsed = time.perf_counter() - start
    bad = sum(1 for row in rows if violation(row, bug_present=not args.fixed))
    print(f"vLLM {api.version_text}, worker {args.worker}: {len(rows)} cells in {elapsed:.0f} s; "
          f"{json.dumps(tally)}; {bad} broke the rule")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
