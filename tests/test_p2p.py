"""vLLM's P2P tier between two in-process engines (issue 36): the PD exchange over kvdoctor's in-memory
transports, its faults, and the four P2P invariants. Each invariant is shown to fire on a mutated vLLM method
(patched with monkeypatch: restored after the test, even when it fails) and to hold on the real one. Skips
with the probe's reason where the installed vLLM has no P2P tier (0.26.0 to 0.33.0)."""

from __future__ import annotations

import importlib
import threading

import pytest

from kvdoctor.engine.compat.p2p_transport import FABRICS, p2p_probe
from kvdoctor.observe import p2p_invariants as inv

_missing = p2p_probe()
pytestmark = pytest.mark.skipif(_missing is not None, reason=_missing or "")


def _p2p(module: str):
    return importlib.import_module(f"vllm.v1.kv_offload.tiering.p2p.{module}")


def _run(api, **plan):
    from kvdoctor.engine.p2p import P2PPlan, run_pair

    return run_pair(api, P2PPlan(**plan))


def _fired(run, name: str) -> list[str]:
    return [v for v in run.violations if v.startswith(name + ":")]


# -- the exchange on the real vLLM ----------------------------------------------------------------------------
def test_pd_exchange_moves_the_producers_bytes(api):
    """The consumer's prefix comes from the producer: one load, reported successful, its bytes compared; the
    handshake, fetch and transfer_done crossed the fabric; nothing is left behind."""
    run = _run(api)
    assert run.violations == []
    assert run.at_rest and run.consumer_finished
    assert (run.loads, run.loads_ok, run.loads_checked, run.writes) == (1, 1, 1, 1)
    assert run.messages >= 5 and run.dropped == 0
    assert not FABRICS  # the pair gave its fabric back


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


# -- each invariant fires on a mutated vLLM method -----------------------------------------------------------
def test_round_ends_fires_when_sessions_lose_load_results(api, monkeypatch):
    """P2PSession.poll mutated to drop every finished load: the consumer's round never ends."""
    session_cls = _p2p("session.session").P2PSession
    real = session_cls.poll
    monkeypatch.setattr(session_cls, "poll", lambda self: real(self)._replace(loads=[]))
    run = _run(api, max_steps=15)
    assert _fired(run, inv.ROUND_ENDS) and not run.at_rest


def test_nothing_pinned_fires_when_store_results_are_lost(api, monkeypatch):
    """P2PSession.poll mutated to drop finished stores: the producer's cascade job (pinning its primary
    chunks) never ends, though the consumer's round did."""
    session_cls = _p2p("session.session").P2PSession
    real = session_cls.poll
    monkeypatch.setattr(session_cls, "poll", lambda self: real(self)._replace(stores=[]))
    run = _run(api, max_steps=15)
    assert run.loads_ok == 1 and run.at_rest
    assert _fired(run, inv.NOTHING_PINNED) and not _fired(run, inv.ROUND_ENDS), run.violations


def test_bytes_equal_fires_when_the_producer_serves_other_chunks(api, monkeypatch):
    """P2PSecondaryTierManager.submit_store mutated to pair each key with another key's chunk: the consumer's
    load succeeds with the wrong bytes."""
    manager_cls = _p2p("manager").P2PSecondaryTierManager
    real = manager_cls.submit_store

    def crossed(self, job_metadata):
        job_metadata.chunk_ids = job_metadata.chunk_ids[::-1].copy()
        return real(self, job_metadata)

    monkeypatch.setattr(manager_cls, "submit_store", crossed)
    run = _run(api)
    assert _fired(run, inv.BYTES_EQUAL) and run.loads_ok == 1


def test_deferred_release_fires_when_close_forgets_it(api, monkeypatch):
    """ClientRole.close mutated to release nothing: the aborted load's deferred release stays unset after its
    session died."""
    client_cls = _p2p("session.client").ClientRole
    real = client_cls.close

    def close_without_release(self):  # vLLM's close, with every Event.set it makes a no-op
        with monkeypatch.context() as inner:
            inner.setattr(threading.Event, "set", lambda event: None)
            return real(self)

    monkeypatch.setattr(client_cls, "close", close_without_release)
    run = _run(api, delay_polls=1, abort_consumer_at=5, kill_producer_at=6)
    assert _fired(run, inv.DEFERRED_SET), run.violations
