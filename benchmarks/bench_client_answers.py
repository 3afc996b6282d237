"""Silent bugs as their clients see them, measured: one Markdown row per silent built-in recipe.

    PYTHONPATH=. python benchmarks/bench_client_answers.py [RECIPE ...]

Every built-in recipe whose signature is an invariant (a silent bug), or those named, through vLLM's
EngineCore (`repro RECIPE --engine core --logic installed`, the CLI's default worker) in one process;
each row: the invariant verdict, what the clients received against the reference (offloading off), and
the run's wall time. docs/engine-levels.md shows the table per release.
"""

from __future__ import annotations

import sys
import time

from kvdoctor import app
from kvdoctor.engine.overrides import Overrides
from kvdoctor.recipes import builtins


def main(names: list[str]) -> None:
    recipes = [builtins.resolve(name) for name in names] if names else [
        recipe for recipe in builtins.all_builtins() if recipe.signature.invariant]
    print("| recipe | bug | core verdict | what the clients received | wall |")
    print("|---|---|---|---|---|")
    for recipe in recipes:
        started = time.monotonic()
        report = app.repro(recipe.name, Overrides(engine="core"), "installed", default_worker="vllm")
        result = report.decisive
        answers = result.answers.line if result.answers is not None else "not compared: " + (result.detail or "")
        print(f"| {recipe.name} | {recipe.bug} | {result.outcome.value} | {answers.replace('|', '/')} "
              f"| {time.monotonic() - started:.1f} s |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
