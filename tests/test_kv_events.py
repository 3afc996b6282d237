"""vLLM's KV events (issue 36): recorded where the Scheduler publishes them, judged by four invariants that are
vLLM's promises to a subscriber, K13's recipes as measured, and explore's probed draw.

Each invariant holds on a run vLLM gets right (tests/data/kv-events-clean.toml: stores, evictions, an idle
reset) and is violated when one vLLM method is mutated in the test (`OffloadingConnectorScheduler.take_events`,
patched by `monkeypatch`, which restores it even when the run raises). One vLLM import, a run per case.
"""

from __future__ import annotations

import dataclasses

import pytest

from kvdoctor import app
from kvdoctor.engine.compat.kv_events import KV_EVENTS, REQUEST_DESCRIBED_STORES, SELF_DESCRIBING, KvEvent
from kvdoctor.engine.overrides import Overrides
from kvdoctor.explore.generate import EVENTS_DRAW, SELF_DESCRIBING_DRAW, Example, decode_kv_events
from kvdoctor.observe.kv_events import Subscriber
from kvdoctor.observe.verdict import Outcome
from kvdoctor.recipes.builtins import load_builtin

from .conftest import ROOT
from .recipe_runs import measured

CLEAN = str(ROOT / "tests" / "data" / "kv-events-clean.toml")
K13 = ("kv-events-reset-unannounced", "kv-events-reset-duplicate-store")


# -- the subscriber, on synthetic events (no vLLM) -------------------------------------------------------------

def _stored(*hashes, medium="CPU"):
    return KvEvent("stored", medium=medium, group_idx=0, block_hashes=tuple(hashes))


def _removed(*hashes, medium="CPU"):
    return KvEvent("removed", medium=medium, group_idx=0, block_hashes=tuple(hashes))


def test_subscriber_flags_a_duplicate_store_and_an_unannounced_removal():
    sub = Subscriber()
    sub.apply([_stored(1, 2), _stored(3, 4), _removed(1, 2, 3, 4)])  # one removal may name two chunks
    assert sub.findings["kv-events-store-remove-alternate"] == [] and not sub.chunks
    sub.apply([_stored(5), _stored(5)])
    assert "already resident" in sub.findings["kv-events-store-remove-alternate"][0]
    sub.apply([_removed(9)])
    assert "no BlockStored announced" in sub.findings["kv-events-store-remove-alternate"][0]
    sub.apply([_stored(6, 7), _removed(7)])
    assert "1 of the 2 block hash(es)" in sub.findings["kv-events-removal-carries-store-hashes"][0]


def test_subscriber_forgets_on_all_blocks_cleared_and_ignores_gpu_events():
    sub = Subscriber()
    sub.apply([_stored(1), _stored(1, medium="GPU"), _stored(1, medium="GPU"), KvEvent("cleared"), _removed(1)])
    assert sub.findings["kv-events-store-remove-alternate"] == [] and not sub.chunks


# -- vLLM's real events ----------------------------------------------------------------------------------------

def _run(path: str):
    (result,) = app.repro(path, Overrides(), "installed", record_timeline=True).results
    return result


@pytest.fixture(scope="module")
def connector_class(api):
    if KV_EVENTS not in api.kv_events_features():
        pytest.skip("this vLLM's offloading connector publishes no KV events (probed)")
    return api.cls("offload_scheduler", "OffloadingConnectorScheduler")


def _mutate(monkeypatch, cls, change):
    """The connector's `take_events`, each event passed through `change` (a list of events back)."""
    real = cls.take_events

    def take_events(self):
        for event in real(self):
            yield from change(event)
    monkeypatch.setattr(cls, "take_events", take_events)


def _replace(event, **fields):
    import msgspec

    return msgspec.structs.replace(event, **fields)


def test_the_invariants_hold_on_vllms_own_events(connector_class):
    result = _run(CLEAN)
    assert result.outcome is Outcome.NOT_REPRODUCED, result.detail
    events = [e for entry in result.timeline if entry.events for e in entry.events.kv_events]
    cpu = [e for e in events if e.medium == "CPU"]
    # the run must really show what the invariants judge: self-describing stores, evictions, a clear
    assert any(e.kind == "stored" and e.token_ids for e in cpu), "no self-describing CPU store was published"
    assert any(e.kind == "removed" for e in cpu), "the CPU tier evicted nothing"
    assert any(e.kind == "cleared" for e in events), "the idle reset published no AllBlocksCleared"


def _dropped_removals(event):
    return [] if type(event).__name__ == "BlockRemoved" else [event]


def _duplicated_stores(event):
    return [event, event] if type(event).__name__ == "BlockStored" and event.medium == "CPU" else [event]


def _wrong_tokens(event):
    if type(event).__name__ == "BlockStored" and event.medium == "CPU" and event.token_ids:
        return [_replace(event, token_ids=[t + 1 for t in event.token_ids])]
    return [event]


def _truncated_removals(event):
    if type(event).__name__ == "BlockRemoved" and len(event.block_hashes) > 1:
        return [_replace(event, block_hashes=list(event.block_hashes)[1:])]
    return [event]


@pytest.mark.parametrize(("change", "invariant"), [
    (_dropped_removals, "kv-events-match-tier"),
    (_duplicated_stores, "kv-events-store-remove-alternate"),
    (_wrong_tokens, "kv-events-self-describing"),
    (_truncated_removals, "kv-events-removal-carries-store-hashes"),
])
def test_each_invariant_catches_a_mutated_take_events(connector_class, monkeypatch, change, invariant):
    _mutate(monkeypatch, connector_class, change)
    result = _run(CLEAN)
    assert result.outcome in (Outcome.REPRODUCED, Outcome.OTHER_FAILURE), result.detail
    assert invariant in {v.invariant for v in result.violations}, result.detail


@pytest.mark.parametrize("name", K13)
def test_k13_recipes_as_measured(api, name):
    recipe = load_builtin(name)
    assert recipe.bug == "K13" and recipe.setup["kv_events"] is True
    expected = measured(api, name)
    result = _run(name)
    assert result.outcome is expected, result.detail
    if expected is Outcome.REPRODUCED:
        assert result.violations[0].invariant == recipe.signature.invariant


# -- explore's draw ---------------------------------------------------------------------------------------------

def test_explore_draws_kv_events_only_where_probed(api):
    from kvdoctor.explore.search import available_features

    probed = api.kv_events_features()
    features = available_features(api)
    assert (EVENTS_DRAW in features) == ({KV_EVENTS, REQUEST_DESCRIBED_STORES} <= probed)
    assert (SELF_DESCRIBING_DRAW in features) == (SELF_DESCRIBING in probed)
    base = Example.from_fields((0,) * 11, []).geometry
    drawn = decode_kv_events(base, 0b11, features)
    assert drawn.kv_events == (EVENTS_DRAW in features)
    assert drawn.self_describing_kv_events == (EVENTS_DRAW in features and SELF_DESCRIBING_DRAW in features)
    assert decode_kv_events(base, 0b11, frozenset()) == base  # a release without the probe: as before
    assert decode_kv_events(dataclasses.replace(base, multi_connector=True), 0b11, features).kv_events is False
