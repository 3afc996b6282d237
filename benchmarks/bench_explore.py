"""Scheduler steps per second: `kvdoctor explore` against a bare loop on the same traffic.

Explore runs (in-process, one worker) for a fixed number of examples with a
fixed seed; one search records every recipe it ran (each example runs twice:
sync and async scheduling), and the seed makes every later search run the
same ones. The bare loop replays exactly those recipes on
`kvdoctor.engine.harness.Harness` with no logic patch, no observer, no
invariants and no hypothesis: a fresh Harness per recipe (VllmConfig, KV cache
plan, scheduler, connector, as `kvdoctor repro` builds one), then the recipe's
events as direct scheduler calls (add_request, schedule() +
update_from_output(), finish_requests, ...), stopping where explore's run
stopped (at its failure). Both rates count the same engine steps; explore's
time is its whole wall time (generation, shrinking, observation).

Each measurement is a fresh search (its build cache starts empty) between two
bare replays, whose mean is its baseline, so a drift in the machine's speed
hits both sides; the median of the measurements' ratios counts.
Target: explore >= 0.8 of the bare rate (issue 13).

Also printed, for what the ratio does not say: the bare loop reusing each
setup's VllmConfig and KV cache plan as explore does (`BuildCache`). Part of
explore's lead over the fresh-build loop is that reuse, not less overhead.

    .venv/bin/python benchmarks/bench_explore.py [--examples 400] [--seed 0] [--logic installed] [--repeat 5]

`--vocabulary SECONDS` measures something else: one in-process search (one worker) for that long on the
installed vLLM, with the vocabulary this release draws (the extension bytes where it has sync loads and
per-request caps), then
prints examples, steps/s, and per feature how many runs drew it, their engine steps and the findings
whose shrunk recipe has it (each finding also triaged, through vLLM's EngineCore too):

    .venv-vllm-0.34/bin/python benchmarks/bench_explore.py --vocabulary 540 --seed 1

Speculative decoding is drawn where the release has 0.34's lookahead block hashes / EAGLE block drop;
`--speculative` draws it on any release (`--no-speculative` never), e.g. on 0.26.0:

    .venv/bin/python benchmarks/bench_explore.py --vocabulary 180 --seed 1 --speculative
"""

from __future__ import annotations

import argparse
import statistics
import time

TARGET = 0.8  # issue 13 (it was 0.5; measured 0.51-0.55 before)


def bare_replay(api, traffic, cached_builds: bool = False) -> tuple[int, float]:
    """Replay (recipe, observation) pairs on a bare Harness: (engine steps, seconds). With
    `cached_builds` the replay keeps one BuildCache across its runs, as explore's search does."""
    from kvdoctor.engine.harness import BuildCache, Harness
    from kvdoctor.explore.runner import setup_of
    from kvdoctor.recipes.compile import compile_recipe
    from kvdoctor.recipes.geometry import NotApplicable
    from kvdoctor.scenario import apply_to_harness
    from kvdoctor.steps import StepTarget

    prepared = []
    for recipe, obs, _ in traffic:
        setup = setup_of(recipe)
        try:
            plays = compile_recipe(recipe.steps, setup).steps
        except NotApplicable:  # the scenario ran none of it either
            plays = ()
        stop = obs.failure_index if obs.failure_index is not None else len(plays)
        prepared.append((setup, plays[:stop]))
    cache = BuildCache() if cached_builds else None
    steps = 0
    start = time.perf_counter()
    for setup, plays in prepared:
        harness = None
        try:  # vLLM may fail while building (a start-up failure explore found): that run ends there too
            harness = Harness(api, setup, cache)
            target = StepTarget(harness)
            for play in plays:
                if play.action == "schedule":
                    steps += 1
                apply_to_harness(play, target)
        except Exception:  # the failure explore found: the run ends here too
            pass
        finally:
            if harness is not None:
                harness.shutdown()  # as explore's runs do (the tiering spec maps a file per scheduler)
    return steps, time.perf_counter() - start


def _adds(recipe, key):
    return any(key in step.args for step in recipe.steps if step.action == "add")


FEATURES = {  # feature -> does a recipe draw it? (its [setup], or an add's fields)
    "sync loads": lambda r: bool((r.setup.get("extra_connector_config") or {}).get("sync_load_budget_bytes")),
    "recompute policy": lambda r: (r.setup.get("kv_transfer_fields") or {}).get("kv_load_failure_policy")
    == "recompute",
    "prefix_match_unit": lambda r: bool(r.setup.get("prefix_match_unit")),
    "MultiConnector": lambda r: bool(r.setup.get("multi_connector")),
    "kv_consumer": lambda r: (r.setup.get("kv_transfer_fields") or {}).get("kv_role") == "kv_consumer",
    "kv_producer": lambda r: (r.setup.get("kv_transfer_fields") or {}).get("kv_role") == "kv_producer",
    "request caps": lambda r: _adds(r, "kv_transfer_params"),
    "retention": lambda r: bool(r.setup.get("prefix_cache_retention_interval")),
    "priority policy": lambda r: r.setup.get("scheduling_policy") == "priority",
    "priorities": lambda r: _adds(r, "priority"),
    "tiering spec": lambda r: r.setup.get("spec_name") == "TieringOffloadingSpec",
    "swa-full": lambda r: r.setup.get("layout") == "swa-full",
    "mamba-hybrid": lambda r: r.setup.get("layout") == "mamba-hybrid",
    "eagle-pair": lambda r: r.setup.get("layout") == "eagle-pair",
    "async": lambda r: bool(r.setup.get("async_scheduling")),
    "speculative": lambda r: bool(r.setup.get("speculative_method")),
    "spec eagle": lambda r: r.setup.get("speculative_method") == "eagle",
    "spec ngram": lambda r: r.setup.get("speculative_method") == "ngram",
    "spec rejections": lambda r: (bool(r.setup.get("speculative_method"))
                                  and r.setup.get("draft_acceptance") is not None),
    "num_workers>1": lambda r: r.setup.get("num_workers", 1) > 1,
    "late worker": lambda r: bool(r.setup.get("late_worker_steps")),
    "one worker fails": lambda r: any(s.action == "fail_transfers" and "worker" in s.args for s in r.steps),
    "secondary tier": lambda r: bool(r.setup.get("secondary_tier")),
    "spec no lookahead": lambda r: bool(r.setup.get("disable_lookahead_block_hashes")),
}


def vocabulary(seconds: float, seed: int, logic: str, speculative: bool | None = None) -> int:
    """One bounded search: examples, steps/s and, per feature, runs, steps and findings."""
    import tempfile
    from pathlib import Path

    from kvdoctor.engine import compat
    from kvdoctor.explore.search import ExploreConfig, available_features, warm_up, worker_search

    api = compat.load()
    warm_up(api)
    features = sorted(available_features(api))
    traffic: list = []
    start = time.perf_counter()
    findings, stats = worker_search(api, ExploreConfig(seed=seed, logic=logic, time_budget=seconds,
                                                       speculative=speculative), trace=traffic)
    wall = time.perf_counter() - start
    print(f"vLLM {api.version_text}, seed {seed}, logic {logic}, one worker, {seconds:g} s budget "
          f"({wall:.0f} s wall); probed features: {', '.join(features) or 'none'}"
          + ("" if speculative is None else f"; speculative draws forced {'on' if speculative else 'off'}"))
    print(f"{stats.examples} examples (+{stats.shrink_examples} while shrinking), {stats.runs} runs, "
          f"{stats.scheduler_steps:,} engine steps = {stats.scheduler_steps / wall:,.0f} steps/s, "
          f"{stats.invalid} refused by vLLM, {len(findings)} findings")
    print(f"{'feature':18} {'runs':>6} {'steps':>8} findings")
    for name, has in FEATURES.items():
        runs = [(r, o) for r, o, _ in traffic if has(r)]
        found = [f.signature for f in findings if has(f.recipe)]
        print(f"{name:18} {len(runs):6d} {sum(o.scheduler_steps for _, o in runs):8,d} {', '.join(found) or '-'}")
    if findings:
        from kvdoctor.explore.triage import triage

        facts = api.engine_core_facts()
        with tempfile.TemporaryDirectory() as out:
            from kvdoctor.explore.findings import write_findings

            write_findings(findings, Path(out))
            for finding in findings:
                result = triage(api, finding, facts)
                print(f"finding: {finding.label} ({finding.steps} steps, after {finding.elapsed_s:.0f} s)")
                print(f"    triage: {result.line}")
                print("    " + finding.recipe.summary.splitlines()[1] if finding.recipe.summary else "")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocabulary", type=float, default=None, metavar="SECONDS",
                        help="one bounded search: examples, steps/s and findings per feature")
    parser.add_argument("--speculative", action=argparse.BooleanOptionalAction, default=None,
                        help="with --vocabulary: draw speculative decoding (default: where the release has "
                             "0.34's lookahead block hashes / EAGLE block drop)")
    parser.add_argument("--examples", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--logic", default="installed")
    parser.add_argument("--repeat", type=int, default=5, help="measurements; the median ratio counts")
    parser.add_argument("--no-freeze", dest="freeze", action="store_false",
                        help="skip gc.freeze() after the warm-up")
    args = parser.parse_args()
    if args.vocabulary is not None:
        return vocabulary(args.vocabulary, args.seed, args.logic, args.speculative)

    from kvdoctor.engine import compat
    from kvdoctor.explore.search import ExploreConfig, worker_search

    api = compat.load()
    config = ExploreConfig(seed=args.seed, logic=args.logic, max_examples=args.examples, time_budget=600)
    # Warm-up (first scheduler build, hypothesis' strategy caches), not timed.
    worker_search(api, ExploreConfig(seed=args.seed + 1, logic=args.logic, max_examples=30, time_budget=60))
    if args.freeze:
        import gc

        gc.collect()
        gc.freeze()  # as `kvdoctor explore` does after its warm-up (both sides benefit)
    # The seed fixes the traffic: one search records it, each measurement replays it around a search.
    traffic: list = []
    findings, stats = worker_search(api, config, trace=traffic)
    searching = [entry for entry in traffic if not entry[2]]
    steps = sum(obs.scheduler_steps for _, obs, _ in traffic)
    search_steps = sum(obs.scheduler_steps for _, obs, _ in searching)
    rows = []
    for _ in range(args.repeat):
        before = bare_replay(api, traffic)
        before_search = bare_replay(api, searching)
        cached = bare_replay(api, traffic, cached_builds=True)
        start = time.perf_counter()
        _, stats = worker_search(api, config)  # a fresh search: its build cache starts empty
        explore_s = time.perf_counter() - start
        after = bare_replay(api, traffic)
        after_search = bare_replay(api, searching)
        assert stats.scheduler_steps == before[0] == after[0] == steps, "replay diverged"
        assert before_search[0] == after_search[0] == search_steps, "replay diverged"
        bare_s = (before[1] + after[1]) / 2
        bare_search_s = (before_search[1] + after_search[1]) / 2
        search_s = explore_s - stats.shrink_seconds
        rows.append({"explore": explore_s, "runs": stats.run_seconds, "bare": bare_s, "cached": cached[1],
                     "search": search_s, "bare_search": bare_search_s,
                     "ratio": bare_s / explore_s, "cached_ratio": cached[1] / explore_s,
                     "search_ratio": bare_search_s / search_s})
    median = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
    ratio = median["ratio"]
    each = ", ".join(f"{row['ratio']:.2f}" for row in rows)
    print(f"vLLM {api.version_text}, logic {args.logic}, seed {args.seed}: {len(traffic)} recipes "
          f"({stats.examples} generated + {stats.shrink_examples} while shrinking), {len(findings)} findings; "
          f"median of {args.repeat} measurements, each a search between two bare replays")
    print(f"whole run    explore: {steps:6d} engine steps in {median['explore']:6.2f} s = "
          f"{steps / median['explore']:7.0f} steps/s (scheduler runs {median['runs']:.2f} s, the rest "
          f"hypothesis and bookkeeping)")
    print(f"             bare:    {steps:6d} engine steps in {median['bare']:6.2f} s = "
          f"{steps / median['bare']:7.0f} steps/s (a fresh Harness per recipe)")
    verdict = "OK" if ratio >= TARGET else "UNDER TARGET"
    print(f"             ratio explore/bare: {ratio:.2f} (target >= {TARGET}) {verdict}"
          f"; each: {each}")
    print(f"             bare reusing builds as explore does: {median['cached']:6.2f} s = "
          f"{steps / median['cached']:7.0f} steps/s; ratio explore/that: {median['cached_ratio']:.2f}")
    print(f"search phase explore: {search_steps:6d} engine steps in {median['search']:6.2f} s = "
          f"{search_steps / median['search']:7.0f} steps/s (shrinking excluded)")
    print(f"             bare:    {search_steps:6d} engine steps in {median['bare_search']:6.2f} s = "
          f"{search_steps / median['bare_search']:7.0f} steps/s")
    print(f"             ratio explore/bare: {median['search_ratio']:.2f}")
    return 0 if ratio >= TARGET else 1


if __name__ == "__main__":
    raise SystemExit(main())
