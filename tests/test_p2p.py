"""vLLM's P2P tier between two in-process engines (issue 36): the PD exchange over kvdoctor's in-memory
transports, its faults, and the four P2P invariants, as plans (engine/p2p.py `P2PPlan`) and as recipe files
(tests/data/p2p-*.toml, `[setup] p2p = true`), at the scheduler level and at `--engine core` (two EngineCores).
Each invariant is shown to fire on a mutated vLLM method (patched with monkeypatch: restored after the test, even
when it fails) and to hold on the real one. Where the
installed vLLM has no P2P tier kvdoctor can stand in for (0.26.0 to 0.33.0), the runs skip with the probe's
reason, and the recipe files are shown unplayable there (exit 6, the probe's reason)."""

from __future__ import annotations

import importlib
import threading
from pathlib import Path

import pytest

from kvdoctor.engine.compat.p2p_transport import FABRICS, p2p_probe
from kvdoctor.observe import p2p_invariants as inv

from .cli_runner import invoke

_missing = p2p_probe()
needs_p2p = pytest.mark.skipif(_missing is not None, reason=_missing or "")
DATA = Path(__file__).resolve().parent / "data"
EXCHANGE, ABORT_THEN_DEATH = DATA / "p2p-pd-exchange.toml", DATA / "p2p-abort-then-producer-dies.toml"


def _p2p(module: str):
    return importlib.import_module(f"vllm.v1.kv_offload.tiering.p2p.{module}")


def _run(api, **plan):
    from kvdoctor.engine.p2p import P2PPlan, run_pair

    return run_pair(api, P2PPlan(**plan))


def _fired(run, name: str) -> list[str]:
    return [v for v in run.violations if v.startswith(name + ":")]


# -- the exchange on the real vLLM ----------------------------------------------------------------------------
@needs_p2p
def test_pd_exchange_moves_the_producers_bytes(api):
    """The consumer's prefix comes from the producer: one load, reported successful, its bytes compared; the
    handshake, fetch and transfer_done crossed the fabric; nothing is left behind."""
    run = _run(api)
    assert run.violations == []
    assert run.at_rest and run.consumer_finished
    assert (run.loads, run.loads_ok, run.loads_checked, run.writes) == (1, 1, 1, 1)
    assert run.messages >= 5 and run.dropped == 0
    assert not FABRICS  # the pair gave its fabric back


@needs_p2p
def test_symmetric_p2p_probes_then_fetches(api):
    """remote_kv_source: after a warm-up request opened the session, the consumer's lookup is a LookupMsg the
    producer answers from its own CPU tier (ParentManager), then the hit is fetched with the producer's bytes."""
    from kvdoctor.engine.p2p import P2PPair, P2PPlan

    pair = P2PPair(api, P2PPlan(symmetric=True))
    try:
        run = pair.run()
        kinds = {kind for _sender, _receiver, kind in pair.fabric.sent}
    finally:
        pair.shutdown()
    assert run.violations == [] and run.at_rest and run.consumer_finished
    assert {"lookup", "lookup_resp", "fetch", "transfer_done"} <= kinds
    assert (run.loads, run.loads_ok, run.loads_checked) == (1, 1, 1)


@needs_p2p
@pytest.mark.parametrize("plan", [
    dict(delay_polls=2),
    dict(fail_transfers=True),
    dict(kill_producer_at=1),
    dict(delay_polls=3, kill_producer_at=5),
    dict(delay_polls=3, abort_consumer_at=4),
    dict(delay_polls=1, abort_consumer_at=5, kill_producer_at=6),
    dict(symmetric=True, delay_polls=2, kill_producer_at=8),
], ids=["delayed", "failed-transfer", "producer-dead-before", "producer-dies-mid-round", "consumer-aborts",
        "abort-then-producer-dies", "symmetric-producer-dies"])
def test_faults_end_every_round_with_nothing_left(api, plan):
    """Whatever the fabric does, the real tier ends the round (the consumer falls back to computing) and
    comes to rest holding nothing."""
    run = _run(api, **plan)
    assert run.violations == [], run.violations
    assert run.at_rest and run.consumer_finished
    assert run.loads == (0 if plan.get("symmetric") else 1)  # measured: the producer dies before the fetch
    if plan.get("fail_transfers") or "kill_producer_at" in plan or "abort_consumer_at" in plan:
        assert run.loads_ok == 0


@needs_p2p
def test_a_dead_session_sets_the_deferred_release(api):
    """The consumer aborts mid-round (AbortFetch sent, the load failed with a deferred release); the producer
    dies before its AbortAck: the session's close is the release point, and it sets the event."""
    from kvdoctor.engine.p2p import P2PPair, P2PPlan

    pair = P2PPair(api, P2PPlan(delay_polls=1, abort_consumer_at=5, kill_producer_at=6))
    try:
        run = pair.run()
        results = pair.fabric.journals[pair.consumer_id].results
    finally:
        pair.shutdown()
    assert run.violations == []
    events = [event for _job, ok, event in results if event is not None]
    assert len(events) == 1 and events[0].is_set()
    assert ("kvdoctor-p2p:2", "kvdoctor-p2p:1", "abort_fetch") in pair.fabric.sent


# -- the pair from a recipe file ---------------------------------------------------------------------------
def _recipe_run(api, path: Path, level: str = "scheduler"):
    """The recipe at `level`: two scheduler harnesses, or two of vLLM's EngineCores (`--engine core`)."""
    from kvdoctor.app import resolve_setup
    from kvdoctor.engine.overrides import Overrides
    from kvdoctor.levels.core import run_core_scenario
    from kvdoctor.levels.scheduler import run_scenario
    from kvdoctor.recipes.loader import load_recipe_file

    recipe = load_recipe_file(path)
    play = run_core_scenario if level == "core" else run_scenario
    return play(api, recipe, resolve_setup(recipe, Overrides()), "installed")


def _fired_in(result) -> list[str]:
    return [v.invariant for v in result.violations]


@needs_p2p
@pytest.mark.parametrize("level", ["scheduler", "core"])
@pytest.mark.parametrize("path", [EXCHANGE, ABORT_THEN_DEATH], ids=lambda p: p.stem)
def test_the_recipes_hold_on_the_real_vllm(api, path, level):
    """Both recipes play to the end on the real tier, on two scheduler harnesses and on two of vLLM's EngineCores:
    no P2P invariant fires, the checks hold. At core the clients' answers are not compared (the pair runs the
    simulated worker, which moves no KV bytes: vLLM's P2P tier writes into a /dev/shm region kvdoctor's CPU copy
    engine does not read); the consumer's bytes are compared on the fabric instead."""
    result = _recipe_run(api, path, level)
    assert result.outcome.value == "not_reproduced", (result.outcome, result.detail)
    assert result.violations == [] and all(check.passed for check in result.checks)
    if level == "core":
        assert "EngineCore" in result.worker
        assert result.answers is not None and "moves no KV bytes" in (result.answers.not_compared or "")


def _drop_loads(monkeypatch):
    session_cls = _p2p("session.session").P2PSession
    real = session_cls.poll
    monkeypatch.setattr(session_cls, "poll", lambda self: real(self)._replace(loads=[]))


def _drop_stores(monkeypatch):
    session_cls = _p2p("session.session").P2PSession
    real = session_cls.poll
    monkeypatch.setattr(session_cls, "poll", lambda self: real(self)._replace(stores=[]))


def _cross_chunks(monkeypatch):
    manager_cls = _p2p("manager").P2PSecondaryTierManager
    real = manager_cls.submit_store

    def crossed(self, job_metadata):
        job_metadata.chunk_ids = job_metadata.chunk_ids[::-1].copy()
        return real(self, job_metadata)

    monkeypatch.setattr(manager_cls, "submit_store", crossed)


def _close_without_release(monkeypatch):
    client_cls = _p2p("session.client").ClientRole
    real = client_cls.close

    def close(self):
        with monkeypatch.context() as inner:
            inner.setattr(threading.Event, "set", lambda event: None)
            return real(self)

    monkeypatch.setattr(client_cls, "close", close)


@needs_p2p
@pytest.mark.parametrize(("mutate", "path", "name"), [
    (_drop_loads, EXCHANGE, inv.ROUND_ENDS),  # judged once vLLM's clock is past its timeouts (the p2p_clock step)
    (_drop_stores, EXCHANGE, inv.NOTHING_PINNED),
    (_cross_chunks, EXCHANGE, inv.BYTES_EQUAL),
    (_close_without_release, ABORT_THEN_DEATH, inv.DEFERRED_SET),
], ids=["round-ends", "nothing-pinned", "bytes-equal", "deferred-release-set"])
def test_each_invariant_fires_from_a_recipe_on_a_mutated_vllm(api, monkeypatch, mutate, path, name):
    """The same recipe files, one vLLM method mutated: the invariant that method breaks is the first to fire."""
    mutate(monkeypatch)
    result = _recipe_run(api, path)
    assert _fired_in(result)[:1] == [name], (result.outcome, result.detail)


@needs_p2p
@pytest.mark.parametrize(("mutate", "path", "name"), [
    (_drop_stores, EXCHANGE, inv.NOTHING_PINNED),
    (_close_without_release, ABORT_THEN_DEATH, inv.DEFERRED_SET),
], ids=["nothing-pinned", "deferred-release-set"])
def test_the_pair_at_core_judges_the_same_invariants(api, monkeypatch, mutate, path, name):
    """`--engine core`: the same pair code on two EngineCores; a mutated vLLM method fires the same invariant as at
    the scheduler level (the pair's invariants are live there, not only quiet)."""
    mutate(monkeypatch)
    result = _recipe_run(api, path, "core")
    assert result.outcome.value == "reproduced" and _fired_in(result)[:1] == [name], (result.outcome, result.detail)


@pytest.mark.skipif(_missing is None, reason="this vLLM's probe finds the P2P tier: the recipes play (above)")
@pytest.mark.parametrize("level", ["scheduler", "core"])
def test_without_the_probe_the_recipe_is_untested_with_its_reason(level):
    """On a release whose probe finds no P2P tier kvdoctor can stand in for: exit 6 (not tested), the probe's
    reason in one line, at the scheduler level and at `--engine core` alike (nothing is built), and no advice to
    run it at another level (none plays the pair here)."""
    result = invoke("repro", str(EXCHANGE), "--logic", "installed", "--engine", level)
    assert result.returncode == 6, result.stdout + result.stderr
    assert "run it at --engine" not in result.stderr, result.stderr
    assert f"[setup] p2p: {_missing}" in result.stdout.replace("\n", " ") or str(_missing)[:40] in result.stdout


def test_the_core_level_plays_the_pair():
    """`--engine core` no longer refuses the pair: every `p2p_*` step kind is playable there, only the serve level
    refuses it, and docs/engine-levels.md shows that (its table is `markdown_table()`, test_engine_core)."""
    from kvdoctor.levels.table import markdown_table, why_not
    from kvdoctor.steps import Need, kinds_needing

    kinds = kinds_needing(Need.P2P_PAIR)
    assert kinds and all(why_not(kind, "core") is None and why_not(kind, "scheduler") is None for kind in kinds)
    assert all(why_not(kind, "serve") for kind in kinds)
    row = next(line for line in markdown_table().splitlines() if line.startswith(f"| `{Need.P2P_PAIR.value}` |"))
    assert row.split(" | ")[1:3] == ["yes", "yes"], row
    assert row in (Path(__file__).resolve().parents[1] / "docs" / "engine-levels.md").read_text()


def test_a_p2p_step_without_the_pair_is_a_usage_error(tmp_path):
    """A `p2p_*` step in a recipe without `[setup] p2p = true`: one line naming the step's line, exit 2."""
    text = EXCHANGE.read_text().replace("p2p = true\n", "")
    path = tmp_path / "no-pair.toml"
    path.write_text(text)
    result = invoke("repro", str(path), "--logic", "installed")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "`p2p_add` drives the P2P pair: it needs [setup] p2p = true" in result.stderr, result.stderr


# -- explore draws the pair (its own probe-gated branch) -------------------------------------------------------
@needs_p2p
def test_explore_finds_a_pinned_producer_and_writes_a_recipe_repro_replays(api, monkeypatch, tmp_path):
    """vLLM's session mutated to lose finished stores: explore's P2P branch finds p2p-nothing-pinned and writes
    the plan as a recipe file that reproduces it (the replay also on the mutated vLLM)."""
    import time

    from kvdoctor.explore.search import ExploreConfig, P2PBranch, Stats
    from kvdoctor.recipes.writer import recipe_to_toml

    _drop_stores(monkeypatch)
    stats = Stats(phase="searching")
    branch = P2PBranch(api, ExploreConfig(seed=1), 0, time.monotonic())
    findings = [branch.play_next(stats) for _ in range(3)]
    assert stats.runs == 3 and stats.examples == 0  # plans are not the search's examples
    pinned = [f for f in findings if f is not None and f.signature == f"invariant {inv.NOTHING_PINNED}"]
    assert pinned, [f.signature for f in findings if f is not None]
    path = tmp_path / "found.toml"
    path.write_text(recipe_to_toml(pinned[0].recipe))
    result = _recipe_run(api, path)
    assert result.outcome.value == "reproduced", (result.outcome, result.detail)


def test_lossy_plans_drop_a_message_type_and_kill_the_consumer():
    """Bit 7 of a plan byte: a dropped control message type (bits 0-1) instead of a delay, and the death of bits 3-4
    is the consumer's endpoint; plans below 128 read as before."""
    from kvdoctor.explore.tier_draw import P2P_PLANS, p2p_plan_fields, p2p_steps

    assert p2p_plan_fields(0b0000_1001)["kill_producer_at"] == 1 and p2p_plan_fields(9)["drop"] == ()
    lossy = p2p_plan_fields(0b1000_1001)
    assert (lossy["drop"], lossy["delay_polls"], lossy["kill_consumer_at"], lossy["kill_producer_at"]) == (
        ("fetch",), 0, 1, None)
    steps = p2p_steps(0b1000_1001)
    assert ("p2p_fabric", {"delay_polls": 0, "fail_transfers": False, "drop": ["fetch"]}) in steps
    assert ("p2p_kill", {"side": "consumer"}) in steps
    assert P2P_PLANS == 256
