"""explore --coverage (the connector's line coverage, per file, steering the search), the ARC eviction draw,
and the metrics invariants (vLLM's own reduce() and Prometheus observe each step), on the real scheduler.

Each metrics invariant is shown to fire on a mutated vLLM method (patched with monkeypatch: restored after
the test, even when it fails) and to hold on the real one. Bounded runs: a few examples each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvdoctor import app as application
from kvdoctor.engine.harness import Harness
from kvdoctor.engine.overrides import Overrides
from kvdoctor.engine.setup import Setup
from kvdoctor.explore.generate import ARC, PRIORITY, Geometry, decode_second_extension
from kvdoctor.explore.search import ExploreConfig, available_features, worker_search
from kvdoctor.observe.line_coverage import LineCoverage, connector_files, merge_executed, report
from kvdoctor.observe.verdict import Outcome

from .cli_runner import invoke

PLAIN = Geometry(4, 1, 16, 16, 256, False)


def _arc_file() -> str:
    return next(str(p) for p in connector_files() if p.name == "arc.py" and p.parent.name == "policies")


# -- the line coverage ----------------------------------------------------------------------------------

def test_a_run_is_measured_per_connector_file(api):
    """A recipe's run executes lines of the offloading scheduler; the report lists every connector file (one
    nothing imported at 0), and its total is the sum of its files."""
    lines = LineCoverage()
    lines.start()
    try:
        application.repro("queued-abort", Overrides(), "installed")
    finally:
        lines.stop()
    executed = lines.executed()
    covered = report(executed)
    by_name = {f.file: f for f in covered.files}
    scheduler = next(f for name, f in by_name.items() if name.endswith("offloading/scheduler.py"))
    assert 0 < scheduler.executed < scheduler.statements
    assert len(covered.files) >= 10 and any(f.executed == 0 for f in covered.files)
    assert covered.statements == sum(f.statements for f in covered.files)
    assert covered.executed == sum(f.executed for f in covered.files) > 0
    # workers' parts merge as a union
    half = {path: lines[: len(lines) // 2] for path, lines in executed.items()}
    rest = {path: lines[len(lines) // 2:] for path, lines in executed.items()}
    assert merge_executed([half, rest]) == {path: sorted(lines) for path, lines in sorted(executed.items())}


def test_explore_reports_coverage_in_json_only_when_asked(api, tmp_path):
    args = ("explore", "--seed", "3", "--max-examples", "4", "--no-triage", "--json")
    plain = invoke(*args, "--out", str(tmp_path / "a"))
    assert plain.returncode in (0, 1), plain.stderr
    assert json.loads(plain.stdout)["coverage"] is None
    measured = invoke(*args, "--coverage", "--out", str(tmp_path / "b"))
    assert measured.returncode in (0, 1), measured.stderr
    covered = json.loads(measured.stdout)["coverage"]
    total = covered["total"]
    assert total["statements"] == sum(f["statements"] for f in covered["files"])
    assert 0 < total["executed"] <= total["statements"]
    assert total["percent"] == round(100 * total["executed"] / total["statements"], 1)
    assert {"file", "statements", "executed", "percent"} <= set(covered["files"][0])


def test_explore_coverage_text_table(api, tmp_path):
    result = invoke("explore", "--seed", "3", "--max-examples", "2", "--no-triage", "--coverage",
                    "--out", str(tmp_path))
    assert result.returncode in (0, 1), result.stderr
    assert "connector line coverage:" in result.stdout and "offloading/scheduler.py" in result.stdout


def test_coverage_steers_without_changing_the_first_draws(api):
    """--coverage adds hypothesis' target phase, nothing else: the examples before its first optimisation
    pass are the ones the same seed draws without it, and each example's new lines are counted."""
    def recipes(coverage: bool) -> tuple[list, int]:
        trace: list = []
        lines = LineCoverage() if coverage else None
        if lines is not None:
            lines.start()
        try:
            _, stats = worker_search(api, ExploreConfig(seed=5, max_examples=8, triage=False, coverage=coverage),
                                     trace=trace, lines=lines)
        finally:
            if lines is not None:
                lines.stop()
        return [(r.setup, r.steps) for r, _, shrinking in trace if not shrinking][:8], stats.connector_lines

    plain, none = recipes(False)
    steered, new_lines = recipes(True)
    assert none == 0 and new_lines > 0
    assert plain == steered


# -- ARC --------------------------------------------------------------------------------------------------

def test_arc_is_drawn_where_probed(api):
    """Every supported release has vLLM's ARC policy (measured: lru and arc on 0.26.0, 0.27.0, 0.34.0)."""
    assert ARC in api.eviction_policies() and "lru" in api.eviction_policies()
    assert ARC in available_features(api)
    arc = decode_second_extension(PLAIN, 0b1000, frozenset({ARC}))
    assert arc.eviction_policy == "arc"
    assert arc.setup_dict()["extra_connector_config"] == {"eviction_policy": "arc"}
    assert decode_second_extension(PLAIN, 0b1000, frozenset({PRIORITY})) == PLAIN  # a release without it
    assert "extra_connector_config" not in PLAIN.setup_dict()


def test_an_arc_recipe_runs_vllms_arc_policy(api, tmp_path):
    """The drawn setup reaches vLLM's ARC policy (its lines run) through the connector's own config path."""
    recipe = tmp_path / "arc.toml"
    recipe.write_text("\n".join([
        '[recipe]', 'name = "arc-evicts"', 'summary = "two prompts through a one-chunk tier under ARC"',
        '[setup]', 'block_size = 4', 'gpu_blocks = 16', 'cpu_bytes_to_use = 4096',
        '[setup.kv_connector_extra_config]', 'eviction_policy = "arc"',
        '[signature]', 'invariant = "no-orphan-transfer-jobs"',
        *[line for rid in "AB" for line in ('[[step]]', 'action = "add"', f'request = "{rid}"',
                                            'prompt_tokens = 8', 'max_tokens = 1',
                                            '[[step]]', 'action = "schedule"', 'count = 3')],
    ]) + "\n", encoding="utf-8")
    lines = LineCoverage()
    lines.start()
    try:
        result = application.repro(str(recipe), Overrides(), "installed")
    finally:
        lines.stop()
    assert result.results[0].outcome is Outcome.NOT_REPRODUCED, result.results[0].detail
    assert lines.executed().get(_arc_file()), "vLLM's ARC policy ran no line"


# -- the metrics invariants -------------------------------------------------------------------------------

def _cpu_manager_class():
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    return CPUOffloadingManager


LOAD_RECIPE = "\n".join([
    '[recipe]', 'name = "metrics-{name}"', 'summary = "A stored, the GPU cache reset, B loads A\'s prefix"',
    '[setup]', 'block_size = 4', 'gpu_blocks = 16',
    '[signature]', 'invariant = "{name}"',
    '[[step]]', 'action = "add"', 'request = "A"', 'prompt_tokens = 8', 'max_tokens = 1',
    '[[step]]', 'action = "schedule"', 'count = 3',
    '[[step]]', 'action = "reset_prefix_cache"',
    '[[step]]', 'action = "add"', 'request = "B"', 'prompt_tokens = 12', 'max_tokens = 1',
    'shared_prefix_with = "A"', 'shared_prefix_tokens = 8',
    '[[step]]', 'action = "schedule"', 'count = 6',
]) + "\n"


# A's stores held in flight for two steps (the CPU tier's usage gauges read above zero then), then released.
HELD_RECIPE = "\n".join([
    '[recipe]', 'name = "metrics-{name}"', 'summary = "A\'s stores held in flight, then completed"',
    '[setup]', 'block_size = 4', 'gpu_blocks = 16', 'cpu_bytes_to_use = 8192',
    '[signature]', 'invariant = "{name}"',
    '[[step]]', 'action = "hold_transfers"', 'kind = "store"',
    '[[step]]', 'action = "add"', 'request = "A"', 'prompt_tokens = 8', 'max_tokens = 2',
    '[[step]]', 'action = "schedule"', 'count = 2',
    '[[step]]', 'action = "complete_transfers"',
    '[[step]]', 'action = "schedule"', 'count = 2',
]) + "\n"


def _play(tmp_path: Path, name: str, text: str = LOAD_RECIPE) -> Outcome:
    path = tmp_path / f"{name}.toml"
    path.write_text(text.replace("{name}", name), encoding="utf-8")
    (result,) = application.repro(str(path), Overrides(), "installed").results
    return result.outcome


def test_metrics_in_range_holds_and_fires_on_a_mutated_get_stats(api, tmp_path, monkeypatch):
    name = "connector-metrics-in-range"
    assert _play(tmp_path, name, HELD_RECIPE) is Outcome.NOT_REPRODUCED
    assert _play(tmp_path, name) is Outcome.NOT_REPRODUCED
    manager = _cpu_manager_class()
    real = manager.get_stats

    def mutated(self):  # the usage fractions reported as percents: out of [0, 1] while a held store pins chunks
        stats = real(self)
        types, values = api.offloading_stats_sections(stats)
        for metric, series in values.items():
            if types.get(metric) == "gauge" and metric.endswith("_perc"):
                for labels, value in series.items():
                    series[labels] = value * 100
        return stats

    monkeypatch.setattr(manager, "get_stats", mutated)
    assert _play(tmp_path, name, HELD_RECIPE) is Outcome.REPRODUCED


def test_idle_gauges_hold_and_fire_on_a_load_that_never_unpins(api, tmp_path, monkeypatch):
    assert _play(tmp_path, "idle-connector-gauges-zero") is Outcome.NOT_REPRODUCED
    manager = _cpu_manager_class()
    monkeypatch.setattr(manager, "complete_load", lambda self, *args, **kwargs: None)  # B's chunks stay pinned
    assert _play(tmp_path, "idle-connector-gauges-zero") is Outcome.REPRODUCED


def test_the_prometheus_side_is_vllms_own(api):
    """The stand-in metrics are what vLLM's OffloadPromMetrics made: one per metric it defines, fed each step."""
    from kvdoctor.observe import connector_metrics

    harness = Harness(api, Setup(block_size=4, gpu_blocks=16))
    try:
        harness.add("A", list(range(10, 18)), max_tokens=1)
        for _ in range(3):
            harness.step()
        assert connector_metrics.check_step(harness) == []
        reader = connector_metrics._reader(harness)
        assert reader.prom is not None and reader.metrics
        gauges = [m for m in reader.metrics if m.kind == "gauge" and m.values]
        assert any(m.name.endswith("usage_perc") for m in gauges)
    finally:
        harness.shutdown()


@pytest.mark.parametrize("value, idle, bad", [(0.5, False, False), (1.5, False, True), (-1, False, True),
                                              (0.25, True, True), (0.0, True, False)])
def test_gauge_rules(value, idle, bad):
    from kvdoctor.observe.connector_metrics import _gauge_messages

    assert bool(_gauge_messages("vllm:kv_offload_cpu_cache_usage_perc", value, idle)) is bad


def test_the_parent_merges_each_workers_lines():
    """With several workers each measures its own process and sends its lines before its last word; the
    driver reports their union (a pool that only replays those messages: no process, no vLLM)."""
    from kvdoctor import __version__
    from kvdoctor.engine.compat import installed_vllm_version
    from kvdoctor.explore.search import Stats, WorkerIdentity, _explore_in_pool

    class Replay:
        name = "replayed messages"

        def __init__(self, messages):
            self.messages = list(messages)

        def start(self, config):
            pass

        def get(self, timeout):
            return self.messages.pop(0) if self.messages else None

        def gone(self, workers):
            return {}

        def cancel(self, worker):
            pass

        def close(self):
            pass

    def identity(worker):
        return WorkerIdentity(vllm=installed_vllm_version() or "?", kvdoctor=__version__, node="here",
                              pid=worker).as_dict()

    done = Stats(examples=1, done=True, connector_lines=5).as_dict()
    pool = Replay([("ready", 0, identity(0)), ("ready", 1, identity(1)),
                   ("coverage", 0, {"/v/a.py": [1, 2], "/v/b.py": [7]}), ("done", 0, done),
                   ("coverage", 1, {"/v/a.py": [2, 3]}), ("done", 1, done)])
    result = _explore_in_pool(ExploreConfig(workers=2, coverage=True), pool, None, None)
    assert result.coverage == {"/v/a.py": [1, 2, 3], "/v/b.py": [7]}
    assert result.stats.connector_lines == 10
    assert _explore_in_pool(ExploreConfig(workers=1), Replay([("ready", 0, identity(0)), ("done", 0, done)]),
                            None, None).coverage is None
