"""Speculative decoding (issue 27, item 1): vLLM's own SpeculativeConfig (ngram, or eagle with a tiny
local drafter config.json: no download, no weights), with kvdoctor standing in for the drafter and the
rejection sampler at the scheduler level; explore draws it where the release has 0.34's speculative
machinery in the offloading path. Every assertion is on what vLLM's real scheduler and connector did.
Cheap: one harness run per method and one explored draw, shared per module."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvdoctor import app as application
from kvdoctor.engine.overrides import Overrides
from kvdoctor.engine.setup import Setup
from kvdoctor.errors import UsageError
from kvdoctor.explore.generate import (
    GEOMETRY_RANGES,
    SPECULATIVE_DRAW,
    Example,
    Geometry,
    decode_speculative,
    examples,
    to_recipe,
)
from kvdoctor.observe.verdict import Outcome
from kvdoctor.recipes.writer import recipe_to_toml

DATA = Path(__file__).resolve().parent / "data"
PLAIN = Geometry(4, 1, 24, 16, 256, False)
# add A (10 tokens, 12 to generate), run, add B sharing A's whole prompt (a CPU-tier hit), abort A mid-decode
EVENTS = (("add", ("tokens", 10), 12, None), ("schedule", 4), ("add", ("tokens", 10), 6, (0, None)),
          ("schedule", 3), ("abort", 1), ("schedule", 2))


# -- no vLLM needed ---------------------------------------------------------------------------------

def test_setup_refuses_what_kvdoctor_cannot_stand_in_for():
    with pytest.raises(UsageError, match="speculative_method must be one of"):
        Setup(speculative_method="medusa").validate()
    with pytest.raises(UsageError, match="draft_acceptance"):
        Setup(speculative_method="eagle", draft_acceptance="two").validate()
    with pytest.raises(UsageError, match="scheduler level only"):
        Setup(speculative_method="ngram", engine="core").validate()
    assert Setup(speculative_method="eagle", draft_acceptance="2,0,1").draft_acceptance_pattern() == (2, 0, 1)
    assert "stand-in drafter" in Setup(speculative_method="eagle").vllm_worker_unsupported()


def test_the_byte_is_drawn_only_where_gated_and_zero_is_no_speculation():
    assert decode_speculative(PLAIN, 0) == PLAIN
    assert decode_speculative(PLAIN, 1, worker="vllm") == PLAIN  # the stand-in drafter is the simulated worker's
    drawn = decode_speculative(PLAIN, 1 | 2 << 2 | 3 << 4)
    assert (drawn.speculative_method, drawn.num_speculative_tokens, drawn.draft_acceptance) == ("eagle", 3, "0,2,1")
    eagle_pair = Geometry(4, 1, 24, 16, 256, False, layout="eagle-pair")
    assert decode_speculative(eagle_pair, 2).speculative_method == "eagle"  # its drafter has KV layers
    from hypothesis import find

    assert len(find(examples(4, speculative=True), lambda raw: True)[0]) == len(GEOMETRY_RANGES) + 1
    assert len(find(examples(4), lambda raw: True)[0]) == len(GEOMETRY_RANGES)  # ungated: draws stay as they were
    plain = Example.decode((bytes([0] * len(GEOMETRY_RANGES)) + b"\x01", [b"\x00" * 4]),
                           features=frozenset({SPECULATIVE_DRAW}))
    assert plain.geometry.speculative_method == "eagle"


# -- on the installed vLLM ----------------------------------------------------------------------------

def _drive(api, method: str, no_lookahead: bool = False) -> dict:
    """A, 10 prompt tokens, decoding under speculative decoding with a draft acceptance of 3, 0, 1, 2."""
    from kvdoctor.engine.harness import Harness

    harness = Harness(api, Setup(gpu_blocks=24, max_model_len=64, speculative_method=method,
                                 num_speculative_tokens=3, draft_acceptance="3,0,1,2",
                                 disable_lookahead_block_hashes=no_lookahead).validate())
    vllm_config = api.vllm_config_of(harness.scheduler)
    lookahead = api.num_hash_lookahead_tokens(vllm_config)
    harness.add("A", list(range(100, 110)), 20)
    verified, rows = 0, []
    try:
        for _ in range(12):
            events = harness.step()
            verified += events.spec_tokens.get("A", 0)
            request = harness.requests["A"]
            rows.append((events.scheduled_tokens.get("A", 0), request.num_computed_tokens, request.num_tokens,
                         len(request.block_hashes), request.status.name))
    finally:
        harness.shutdown()
    return {"verified": verified, "rejected": harness.drafts_rejected, "rows": rows, "lookahead": lookahead,
            "connector_lookahead": getattr(harness.connector_scheduler, "use_lookahead_block_hashes", None),
            "lookahead_slots": harness.scheduler.num_lookahead_tokens,
            "block_drop": getattr(harness.scheduler, "use_eagle_block_drop", None)}


@pytest.fixture(scope="module", params=["eagle", "ngram", "eagle-no-lookahead"])
def driven(request, api):
    from kvdoctor.engine.compat.speculative import LOOKAHEAD_BLOCK_HASHES

    method = request.param.split("-")[0]
    no_lookahead = request.param.endswith("no-lookahead")
    if no_lookahead and LOOKAHEAD_BLOCK_HASHES not in api.speculative_features():
        with pytest.raises(UsageError, match="disable_lookahead_block_hashes"):
            _drive(api, method, no_lookahead)
        pytest.skip("this vLLM has no lookahead block hashes to disable (refused, exit 2)")
    return request.param, _drive(api, method, no_lookahead)


def test_vllm_schedules_the_drafts_and_rolls_back_the_rejected(driven, api):
    method, run = driven
    assert run["verified"] > 0 and run["rejected"] > 0, run
    decoding = [row for row in run["rows"][1:] if row[4] == "RUNNING"]  # after the prefill step
    assert decoding and all(scheduled == 1 + 3 for scheduled, *_ in decoding), run["rows"]
    # vLLM rolled each verification back to the accepted drafts: the bonus token's KV is the one left
    assert all(computed == tokens - 1 for _, computed, tokens, _, _ in decoding), run["rows"]
    assert run["rows"][-1][4] == "FINISHED_LENGTH_CAPPED" and run["rows"][-1][2] == 30
    assert run["lookahead_slots"] == (0 if method == "ngram" else 3)  # vLLM's own per-method lookahead


def test_block_hashes_follow_vllms_lookahead(driven, api):
    """0.34: with an EAGLE drafter and the OffloadingConnector a block's hash covers the token after it
    (num_hash_lookahead_tokens), as vLLM's engine core builds the hasher; earlier releases have none."""
    method, run = driven
    from kvdoctor.engine.compat.speculative import LOOKAHEAD_BLOCK_HASHES

    if LOOKAHEAD_BLOCK_HASHES not in api.speculative_features():
        assert run["lookahead"] == 0
        pytest.skip("this vLLM has no lookahead block hashes (VllmConfig.num_hash_lookahead_tokens)")
    assert (run["lookahead"] > 0) == (method == "eagle"), run
    assert run["connector_lookahead"] == (method == "eagle")
    # without lookahead hashes vLLM drops an EAGLE request's trailing block instead (its scheduler's flag)
    assert run["block_drop"] == (method == "eagle-no-lookahead"), run
    for _, _, tokens, hashes, _ in run["rows"]:
        assert hashes == (tokens - run["lookahead"]) // 4, run["rows"]


@pytest.fixture(scope="module")
def explored(api, tmp_path_factory):
    from kvdoctor.explore.runner import observe

    geometry = decode_speculative(PLAIN, 1 | 2 << 2 | 3 << 4)  # eagle, 3 drafts, accept 0, 2, 1
    recipe = to_recipe(Example(geometry, EVENTS))
    path = tmp_path_factory.mktemp("spec") / "draw.toml"
    path.write_text(recipe_to_toml(recipe))
    return geometry, observe(api, recipe, "installed"), path


def test_a_draw_runs_on_the_real_scheduler_with_no_finding(explored):
    """vLLM handles this sequence correctly (drafts rejected, a CPU-tier hit, an abort mid-decode): an
    invariant firing here would be kvdoctor's false positive."""
    _, obs, _ = explored
    assert obs.failure_index is None and obs.signature is None, obs.detail
    assert obs.scheduler_steps > 0


def test_the_draw_replays_from_its_file(explored):
    geometry, _, path = explored
    replay = application.repro(str(path), Overrides(), "installed")
    assert replay.setup.speculative_method == geometry.speculative_method == "eagle"
    assert (replay.setup.num_speculative_tokens, replay.setup.draft_acceptance) == (3, "0,2,1")
    assert replay.results[0].outcome in (Outcome.NOT_REPRODUCED, Outcome.NOT_REACHED), replay.results[0].detail


def test_a_finished_requests_in_flight_drafts_are_not_committed(api):
    """Regression from explore's shrunk false positive on 0.26.0 (tests/data): vLLM's final store of a
    request that finished with its in-flight draft slots counted in num_computed_tokens is right."""
    result = application.repro(str(DATA / "spec-async-finished-overshoot.toml"), Overrides(), "installed").results[0]
    assert result.failure is None and result.outcome is Outcome.NOT_REPRODUCED, result.detail


def test_a_speculative_final_store_finding_is_labelled_k5():
    """Explore's shrunk finding on 0.26.0 with an EAGLE speculative config and the default layout (a
    finished request's final store drops the trailing chunk: 0.26.0's connector treats every group as a
    drafter group when none is annotated) takes K5's path; the same setup without speculative decoding
    and with no drafter layout does not."""
    from kvdoctor.explore.findings import known_bug
    from kvdoctor.recipes.model import Signature

    signature = Signature(invariant="final-store-covers-computed-chunks")
    detail = "A (group 0, FINISHED_LENGTH_CAPPED): its final store counts 0 storable chunk(s)"
    speculative = {"block_size": 1, "blocks_per_chunk": 3, "speculative_method": "eagle"}
    assert known_bug(signature, setup=speculative, detail=detail)[0] == "K5"
    assert known_bug(signature, setup={**speculative, "speculative_method": "ngram"}, detail=detail) is None
