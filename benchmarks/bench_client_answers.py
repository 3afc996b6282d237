"""Silent bugs as their clients see them, measured: one Markdown row per silent built-in recipe.

    PYTHONPATH=. python benchmarks/bench_client_answers.py [RECIPE ...]
    PYTHONPATH=. python benchmarks/bench_client_answers.py --serve-table AUDIT.json [AUDIT.json ...]
        the Markdown table of `kvdoctor audit --engine serve --json` runs (one per release) against the
        scheduler level's measurements (kvdoctor/data/release_outcomes.toml): each recipe agrees, or is
        not_applicable naming the step a server cannot express.

Every built-in recipe whose signature is an invariant (a silent bug), or those named, through vLLM's
EngineCore (`repro RECIPE --engine core --logic installed`, the CLI's default worker) in one process;
each row: the invariant verdict, what the clients received against the reference (offloading off), and
the run's wall time. docs/engine-levels.md shows the table per release.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

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


def serve_table(paths: list[str]) -> None:
    import json
    import re

    from kvdoctor.matrix import data

    docs = [json.loads(Path(path).read_text()) for path in paths]
    measured = {(row.release, row.recipe): row.outcome for row in data.load()}
    releases = [doc["vllm_version"] for doc in docs]
    print("| recipe | " + " | ".join(f"{r} scheduler / serve" for r in releases) + " |")
    print("|---|" + "---|" * len(releases))
    for name in sorted({row["recipe"] for doc in docs for row in doc["rows"]}):
        cells = []
        for doc in docs:
            row = next(r for r in doc["rows"] if r["recipe"] == name)
            scheduler = measured.get((doc["vllm_version"], name), "not measured")
            served = row["outcome"]
            if served == "not_applicable":
                hint = row["hint"] or ""
                steps = sorted(set(re.findall(r"`(\w+)` cannot be played", hint)))
                why = ("steps " + ", ".join(f"`{step}`" for step in steps)) if steps else hint.replace("|", "/")
                cells.append(f"{scheduler} / not_applicable ({why})")
            elif served != scheduler and _loses_hits_only(name) and served != "reproduced":
                # the bug's harm is lost prefix hits: no client's answer differs, whatever the release
                what = (row["answers"] or {}).get("line") or (row["hint"] or "").replace("|", "/")
                cells.append(f"{scheduler} / {served} (lost prefix hits: no client answer differs; {what})")
            else:
                agree = "agrees" if served == scheduler else "DISAGREES"
                cells.append(f"{scheduler} / {served} ({agree})")
        print(f"| {name} | " + " | ".join(cells) + " |")


def _loses_hits_only(name: str) -> bool:
    """A silent bug whose harm is lost prefix hits (`explore.impact`): its clients' answers are all equal."""
    from kvdoctor.explore.impact import LOST_HITS, impact_of

    invariant = builtins.resolve(name).signature.invariant
    return invariant is not None and impact_of("invariant", invariant, "").kind == LOST_HITS


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve-table"]:
        serve_table(sys.argv[2:])
    else:
        main(sys.argv[1:])
