"""The scoped patch always puts vLLM's own method back, even when the scenario raises."""

from __future__ import annotations

from typing import ClassVar

import pytest

from kvdoctor.engine.overrides import Overrides
from kvdoctor.engine.setup import Setup
from kvdoctor.errors import UsageError
from kvdoctor.logic.patch import storable_chunks_variant
from kvdoctor.logic.variants import UncappedGroupState, evaluate, expand_logic


class Boom(Exception):
    pass


@pytest.mark.parametrize("variant", ["installed", "fixed", "unpatched"])
def test_original_restored_after_raise(api, variant):
    cls = api.RequestOffloadState
    before = cls.__dict__["storable_chunks"]
    with pytest.raises(Boom), storable_chunks_variant(api, variant):
        assert cls.__dict__["storable_chunks"] is not before
        raise Boom
    assert cls.__dict__["storable_chunks"] is before


def test_original_restored_after_a_real_vllm_crash(api):
    """A crashing scenario (0.26: the K1 assertion) leaves vLLM's method untouched."""
    from kvdoctor import app

    before = api.RequestOffloadState.__dict__["storable_chunks"]
    app.repro("queued-abort", Overrides(), "all")
    assert api.RequestOffloadState.__dict__["storable_chunks"] is before


def test_variants_on_a_real_request_state(api):
    """Drive a real scheduler until B is queued with keys but no blocks, then evaluate."""
    from kvdoctor.engine.harness import Harness

    harness = Harness(api, Setup())
    harness.add("A", list(range(10, 34)), 4)
    harness.step()
    harness.add("B", list(range(100, 116)), 4)
    harness.step()
    state = api.request_states(harness.connector_scheduler)["B"]
    (group_config,) = api.group_configs(harness.connector_scheduler)
    (group_state,) = state.group_states
    assert len(group_state.offload_keys) == 4 and len(group_state.block_ids) == 0

    # The call in this release's form, with the extra arguments its store pass gives (0.34:
    # apply_eagle_drop), exactly as the scenario's recording patch makes it.
    call = api.storable_caller(api.RequestOffloadState.storable_chunks,
                               api.next_store_extra_args(harness.connector_scheduler))

    assert evaluate("fixed", call, state, group_config, group_state, 16, 1) == 0
    unpatched = evaluate("unpatched", call, state, group_config, group_state, 16, 1)
    assert unpatched == 4  # token-derived: 16 tokens / 4 per chunk, no allocated-chunk cap
    installed = evaluate("installed", call, state, group_config, group_state, 16, 1)
    assert installed == (4 if not api.storable_chunks_takes_group_state else 0)


def test_uncapped_view_only_hides_block_count():
    class GS:
        offload_keys: ClassVar[list[int]] = [1, 2]
        block_ids: ClassVar[list[int]] = [5]
        next_stored_chunk_idx = 1

    view = UncappedGroupState(GS())
    assert len(view.block_ids) > 10**12
    assert view.offload_keys == [1, 2] and view.next_stored_chunk_idx == 1


def test_expand_logic():
    assert expand_logic("all") == ["installed", "fixed", "unpatched"]
    assert expand_logic("fixed") == ["fixed"]
    with pytest.raises(UsageError):
        expand_logic("nope")
