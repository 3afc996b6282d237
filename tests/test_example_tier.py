"""vLLM's own in-memory example secondary tier (issue 36): `ExampleSecondaryTierManager`, loaded by vLLM's tiering
spec through `module_path` as kvdoctor's recording subclass (engine/compat/example_tier.py, which only records).
Each example-tier invariant (observe/example_tier_invariants.py) holds on the real manager and is violated on a
mutated copy of one of its methods (patched on its class inside a MonkeyPatch scope).

One scenario throughout (as tests/test_objstore.py): A (8 tokens, 2 chunks) stored; C's 2 chunks evict A's from the
two-chunk CPU tier; the GPU prefix cache is reset; B = A's prompt + 1 token promotes A's chunks back."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvdoctor.engine.setup import Setup

from .cli_runner import invoke
from .tier_promotion import drive_recorded_tier, violated

TIERING = "TieringOffloadingSpec"
GEOMETRY = dict(block_size=4, gpu_blocks=16, max_model_len=64, spec_name=TIERING, cpu_bytes_to_use=8192)
RECIPE = Path(__file__).parent / "data" / "example-tier-promotion.toml"


# -- no vLLM needed ---------------------------------------------------------------------------------

def test_setup_names_vllms_example_tier_through_module_path():
    cfg = Setup(secondary_tier="fs+example", **GEOMETRY).validate().kv_connector_extra_config()
    fs, example = cfg["secondary_tiers"]
    assert fs["type"] == "fs"
    assert example == {"type": "RecordedExampleTier", "module_path": "kvdoctor.engine.compat.example_tier"}


def test_the_tier_draw_adds_the_example_tier_only_where_probed():
    from kvdoctor.explore.tier_draw import EXAMPLE_TIER_DRAW, example_tier_kind

    drawn = frozenset({EXAMPLE_TIER_DRAW})
    assert example_tier_kind(0b0100_0001, frozenset(), "fs") == "fs"  # the feature absent: the byte reads as before
    assert example_tier_kind(0b0000_0001, drawn, "fs") == "fs"  # zero upper bits: fs alone, as before
    assert example_tier_kind(0b0100_0001, drawn, "fs") == "example"
    assert example_tier_kind(0b1000_0001, drawn, "fs") == "fs+example"
    assert example_tier_kind(0b0110_0001, drawn, "fs") == "fs"  # the object store's bit: untouched
    assert example_tier_kind(0b0100_1001, drawn, "scripted") == "scripted"  # the scripted tier's kinds: untouched


# -- on the installed vLLM ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def example(api):
    if not api.has_offloading_spec(TIERING):
        pytest.skip("this vLLM has no TieringOffloadingSpec")
    if not api.has_example_tier():
        pytest.skip("this vLLM's tiering spec loads no tier through module_path (or ships no example tier)")
    return api


Mutant = Callable[[type, Any], None]  # (vLLM's example manager class, a MonkeyPatch) -> patches it


def _drive(api, mutant: Mutant | None = None, secondary_tier: str = "example") -> dict:
    """The scenario, every example-tier invariant checked after each step."""
    from vllm.v1.kv_offload.tiering.example.manager import ExampleSecondaryTierManager

    from kvdoctor.observe.example_tier_invariants import EXAMPLE_TIER_INVARIANTS

    return drive_recorded_tier(api, Setup(**{**GEOMETRY, "secondary_tier": secondary_tier}).validate(),
                               EXAMPLE_TIER_INVARIANTS, "kvdoctor_example",
                               None if mutant is None else lambda patch: mutant(ExampleSecondaryTierManager, patch))


@pytest.mark.parametrize("secondary_tier", ["example", "fs+example"])
def test_vllm_loads_its_example_tier_and_promotes_from_it(example, secondary_tier):
    run = _drive(example, secondary_tier=secondary_tier)
    tier = run["tier"]
    assert type(tier).__mro__[1].__name__ == "ExampleSecondaryTierManager"  # vLLM's own manager runs
    assert tier.get_num_chunks() == 4  # A's and C's chunks cascaded to it
    assert ("WAITING_FOR_REMOTE_KVS", 8) in run["rows"], run["rows"]  # B loads A's 2 promoted chunks
    if secondary_tier == "example":
        assert tier.journal.hits >= 2 and tier.journal.loads_checked >= 1
    assert run["rows"][-1][0] == "FINISHED_LENGTH_CAPPED" and not run["violations"], run


# -- each invariant: violated on a mutated manager, held on the real one (above) ------------------------

def test_a_lookup_that_hits_unstored_keys_breaks_no_hit_without_store(example):
    def mutant(cls, patch):
        from vllm.v1.kv_offload.base import LookupResult

        patch.setattr(cls, "lookup", lambda self, key, req_context: LookupResult.HIT)
    run = _drive(example, mutant)
    assert "example-tier-no-hit-without-store" in violated(run), run["violations"]


def test_a_load_that_fails_stored_keys_breaks_load_returns_stored(example):
    def mutant(cls, patch):
        from vllm.v1.kv_offload.tiering.base import JobResult

        def submit_load(self, job):  # forgets what it stored: every promotion fails
            self.completed_jobs.append(JobResult(job_id=job.job_id, success=False))
        patch.setattr(cls, "submit_load", submit_load)
    run = _drive(example, mutant)
    assert "example-tier-load-returns-stored" in violated(run), run["violations"]


def test_the_recipe_replays_with_kvdoctor_repro(example):
    """The scenario from a recipe file through the CLI, both example-tier invariants checked: nothing reproduced."""
    done = invoke("repro", str(RECIPE))
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert "not_reproduced" in out, out
