"""The hunt table: can `kvdoctor hunt` find each crashing built-in recipe's site from the crash text alone?

For each built-in recipe whose signature is an exception (a crash, not an invariant), on the installed vLLM:
run the recipe once and turn its failure into a log fragment (a header naming the version and the features its
setup uses, then an EngineCore traceback of its vLLM frames and exception line); then hunt from that text with
the recipe hidden from the hunt (it only ever sees the text) and its trigger NOT excluded (`--include-known`:
a route through the recipe's own trigger counts), for `--budget` seconds. Prints, per recipe: found or not, the
seconds into the hunt of the first route at the site, the shrunk recipe's steps, the examples run, and how
many of them reached the crash's function.

In-process, one worker, one vLLM import for all recipes (the hunts run as `kvdoctor hunt` runs them: the same
`kvdoctor.hunt.app.hunt`). Bound it from outside too:

    timeout 2400 .venv/bin/python benchmarks/bench_hunt.py --budget 120 [--recipes queued-abort,prefetch]

Issue 35's target: at least 8 crashing recipes found within 10 minutes each on 0.26.0.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

PREFIX = "(EngineCore pid=1) ERROR 12-05 12:00:00 [core.py:1332] "
# The model architecture each shipped layout stands for (its config.json's, or the model it imitates)
LAYOUT_MODELS = {"swa-full": "GptOssForCausalLM", "swa-full-mixed": "Gemma4ForCausalLM",
                 "mamba-hybrid": "NemotronHForCausalLM", "mamba-swa-hybrid": "Phi4FlashForCausalLM",
                 "eagle-pair": "LlamaForCausalLM with an EAGLE drafter"}


def crash_text(api, recipe) -> str | None:
    """The recipe's failure on this vLLM as a log fragment (None: it did not fail with an exception here)."""
    from kvdoctor.levels.scheduler import run_scenario
    from kvdoctor.resolution import resolve_setup

    result = run_scenario(api, recipe, resolve_setup(recipe), "installed")
    failure = result.failure
    if failure is None or not failure.vllm_frames:
        return None
    setup = recipe.setup
    lines = [f"# vLLM issue report, version: {api.version_text}"]
    named = []
    if setup.get("async_scheduling"):
        named.append("--async-scheduling")
    if setup.get("spec_name"):
        named.append(f"kv_connector_extra_config spec_name {setup['spec_name']}")
    layout = str(setup.get("layout") or "")
    if layout:  # a real log names its model: the architecture the shipped layout stands for
        named.append(f"model {LAYOUT_MODELS.get(layout, layout)}")
    if "mamba" in layout:
        named.append("model MambaHybrid")
    if "swa" in layout:
        named.append("a SlidingWindowSpec group")
    if setup.get("multi_connector"):
        named.append("MultiConnector")
    if named:
        lines.append(f"# deployment: {', '.join(named)}")
    lines += [PREFIX + "EngineCore encountered a fatal error.", PREFIX + "Traceback (most recent call last):",
              PREFIX + '  File "/usr/local/lib/python3.12/dist-packages/vllm/v1/engine/core.py", line 1323, in '
                       'run_engine_core', PREFIX + "    engine_core.run_busy_loop()"]
    for frame in failure.vllm_frames:
        lines.append(PREFIX + f'  File "/usr/local/lib/python3.12/dist-packages/{frame.file}", line {frame.line}, '
                              f'in {frame.function}')
        for code in (frame.code or "").split("\n"):
            lines.append(PREFIX + f"    {code.strip()}")
    lines.append(PREFIX + (f"{failure.exception}: {failure.message}" if failure.message else failure.exception))
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget", type=float, default=120.0, help="seconds of hunting per recipe")
    parser.add_argument("--recipes", default="", help="comma-separated recipe names (default: every crashing one)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", type=Path, default=None, help="keep the crash texts and findings here")
    args = parser.parse_args()

    import logging

    from kvdoctor.diagnose.match import match_log
    from kvdoctor.diagnose.reader import read_log
    from kvdoctor.engine import compat
    from kvdoctor.hunt.aim import aim_from_log
    from kvdoctor.hunt.app import hunt
    from kvdoctor.recipes.builtins import all_builtins

    api = compat.load()
    logging.getLogger("vllm").setLevel(logging.CRITICAL)
    wanted = [n for n in args.recipes.split(",") if n]
    recipes = [r for r in all_builtins() if r.signature.exception and (not wanted or r.name in wanted)]
    recipes.sort(key=lambda r: wanted.index(r.name) if r.name in wanted else 0)  # in the order --recipes names
    work = args.keep or Path(tempfile.mkdtemp(prefix="kvdoctor-bench-hunt-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"hunt table on vLLM {api.version_text}, {args.budget:g} s per recipe, seed {args.seed}, one worker, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    print(f"{'recipe':34} {'bug':4} {'found':6} {'after s':>8} {'steps':>5} {'examples':>8} {'reached fn':>10}  site",
          flush=True)
    found = 0
    for recipe in recipes:
        text = crash_text(api, recipe)
        if text is None:
            print(f"{recipe.name:34} {recipe.bug or '-':4} {'n/a':6} (no exception on this vLLM)", flush=True)
            continue
        log = work / f"{recipe.name}.log"
        log.write_text(text, encoding="utf-8")
        summary = read_log(str(log))
        aim = aim_from_log(summary, match_log(summary, all_builtins()), include_known=True, text=text)
        report = hunt(aim, work / recipe.name, args.budget, seed=args.seed, triage=False, source=str(log))
        first = min(report.at_site, key=lambda f: f.elapsed_s) if report.at_site else None
        found += first is not None
        reach = report.reach
        print(f"{recipe.name:34} {recipe.bug or '-':4} {'yes' if first else 'no':6} "
              f"{(f'{first.elapsed_s:.1f}' if first else '-'):>8} {(first.steps if first else '-'):>5} "
              f"{report.examples:>8} {(reach.examples if reach and reach.measured else '?'):>10}  "
              f"{aim.exception} in {aim.function}" + (f" via {first.path}" if first and first.path else "")
              + (f" [forced: {', '.join(sorted(aim.force))}]" if aim.force else ""), flush=True)
    print(f"found {found} of {len(recipes)} crashing recipes within {args.budget:g} s each", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
