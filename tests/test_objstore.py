"""vLLM's object-store secondary tier (issue 36) on kvdoctor's fake NIXL agent: vLLM's own
`ObjectStoreSecondaryTierManager`, loaded by vLLM's tiering spec through `module_path` as kvdoctor's recording tier
(engine/compat/objstore_tier.py), kvdoctor standing in only for the agent and the bucket (bytes in memory, faults
scripted per transfer). Each object-store invariant (observe/objstore_invariants.py) holds on the real manager and
is violated on a mutated copy of one of its methods (patched on its class inside a MonkeyPatch scope).

One scenario throughout (as tests/test_scripted_tier.py): A (8 tokens, 2 chunks) stored; C's 2 chunks evict A's
from the two-chunk CPU tier; the GPU prefix cache is reset; B = A's prompt + 1 token promotes A's chunks back."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvdoctor.engine.setup import Setup
from kvdoctor.errors import UsageError

from .cli_runner import invoke
from .tier_promotion import drive_recorded_tier, violated

TIERING = "TieringOffloadingSpec"
GEOMETRY = dict(block_size=4, gpu_blocks=16, max_model_len=64, spec_name=TIERING, cpu_bytes_to_use=8192)
RECIPE = Path(__file__).parent / "data" / "objstore-promotion.toml"


# -- no vLLM needed ---------------------------------------------------------------------------------

def test_setup_takes_the_object_store_first_and_checks_its_script():
    cfg = Setup(secondary_tier="fs", object_store="late,fail/ok", **GEOMETRY).validate().kv_connector_extra_config()
    obj, fs = cfg["secondary_tiers"]
    assert (obj["type"], obj["module_path"], obj["script"]) == ("RecordedObjTier",
                                                                "kvdoctor.engine.compat.objstore_tier", "late,fail/ok")
    assert fs["type"] == "fs"
    assert [t["type"] for t in Setup(object_store="", **GEOMETRY).kv_connector_extra_config()["secondary_tiers"]] \
        == ["RecordedObjTier"]
    with pytest.raises(UsageError, match="unknown outcome 'boom'"):
        Setup(object_store="ok/boom", **GEOMETRY).validate()
    with pytest.raises(UsageError, match="object_store needs spec_name"):
        Setup(object_store="ok", **{**GEOMETRY, "spec_name": None}).validate()


def test_the_tier_draw_adds_the_object_store_only_where_probed():
    from kvdoctor.explore.tier_draw import OBJSTORE_DRAW, objstore_fields

    assert objstore_fields(0b1110_0001, frozenset()) is None  # the feature absent: the byte reads as before
    assert objstore_fields(0b0000_0001, frozenset({OBJSTORE_DRAW})) is None  # zero upper bits: fs alone, as before
    assert objstore_fields(0b0010_0001, frozenset({OBJSTORE_DRAW})) == ""
    assert objstore_fields(0b0110_0001, frozenset({OBJSTORE_DRAW})) == "late,fail,ok,notel/ok,late"
    assert objstore_fields(0b0010_1001, frozenset({OBJSTORE_DRAW})) is None  # the scripted tier's kinds: untouched


# -- on the installed vLLM ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def objstore(api):
    from kvdoctor.engine.compat.objstore_agent import objstore_probe

    reason = objstore_probe() if api.has_offloading_spec(TIERING) else "this vLLM has no TieringOffloadingSpec"
    if reason is None and not api.has_scripted_tier():
        reason = "this vLLM's tiering spec loads no out-of-tree tier through module_path"
    if reason:
        pytest.skip(reason)
    return api


Mutant = Callable[[type, Any], None]  # (vLLM's object-store manager class, a MonkeyPatch) -> patches it


def _drive(api, mutant: Mutant | None = None, **setup: Any) -> dict:
    """The scenario, every object-store invariant checked after each step."""
    from vllm.v1.kv_offload.tiering.obj import manager as obj_manager

    from kvdoctor.observe.objstore_invariants import OBJSTORE_INVARIANTS

    return drive_recorded_tier(api, Setup(**{**GEOMETRY, "object_store": "", **setup}).validate(),
                               OBJSTORE_INVARIANTS, "kvdoctor_objstore",
                               None if mutant is None else lambda patch: mutant(obj_manager, patch))


def test_vllm_loads_its_object_store_tier_and_promotes_from_it(objstore):
    run = _drive(objstore)
    assert run["tiers"] == ["RecordedObjTier"]
    tier = run["tier"]
    assert type(tier).__mro__[1].__name__ == "ObjectStoreSecondaryTierManager"  # vLLM's own manager runs
    assert len(tier.kvdoctor_agent.store.objects) == 4 and tier.journal.hits >= 2  # A's and C's chunks stored
    assert ("WAITING_FOR_REMOTE_KVS", 8) in run["rows"], run["rows"]  # B loads A's 2 promoted chunks
    assert tier.journal.loads_checked >= 1
    assert run["rows"][-1][0] == "FINISHED_LENGTH_CAPPED" and not run["violations"], run


@pytest.mark.parametrize("script, promoted", [
    ("late,notel/late", True),        # in flight over polls; a build without telemetry
    ("norel,leak/leak", True),        # a release NIXL refuses once; leaked metadata: jobs still complete
    ("fail/", False),                 # every put fails: nothing to hit, nothing promoted
    ("err,noreg/", False),            # submission failures
    ("noprep,noxfer/", False),
    ("/fail", False),                 # the promotion fails: B recomputes
    ("/raise", False),
])
def test_faults_are_survived_and_every_invariant_holds(objstore, script, promoted):
    run = _drive(objstore, object_store=script)
    assert not run["violations"], run["violations"]
    assert run["rows"][-1][0] == "FINISHED_LENGTH_CAPPED", run["rows"]
    assert (run["tier"].journal.loads_checked > 0) == promoted, run["rows"]
    assert not run["tier"].kvdoctor_untracked_jobs()


# -- each invariant: violated on a mutated manager, held on the real one (above) ------------------------

def test_a_manager_that_misaligns_keys_and_chunks_loads_the_wrong_bytes(objstore):
    def mutant(module, patch):
        original = module.ObjectStoreSecondaryTierManager.submit_load

        def submit_load(self, job):  # the objects named in reverse order of the chunks they land in
            job.keys = list(reversed(list(job.keys)))
            return original(self, job)
        patch.setattr(module.ObjectStoreSecondaryTierManager, "submit_load", submit_load)
    run = _drive(objstore, mutant)
    assert "objstore-load-returns-stored-bytes" in violated(run), run["violations"]


def test_a_lookup_that_reads_a_missing_object_as_present_hits_after_a_failed_put(objstore):
    def mutant(module, patch):
        def batch_lookup(self, keys, req_context):
            descriptors = [(0, 1, 0, self._tier._file_mapper.get_file_name(k)) for k in keys]
            self._tier._agent.query_memory(descriptors, "OBJ", "OBJ")
            return (True for _ in keys)  # `r is not None` dropped
        patch.setattr(module.ObjAsyncLookupManager, "batch_lookup", batch_lookup)
    run = _drive(objstore, mutant, object_store="fail/")
    assert "objstore-no-hit-without-object" in violated(run), run["violations"]


def test_a_manager_that_drops_a_failed_submission_leaves_its_job_pending(objstore):
    def mutant(module, patch):
        original = module.ObjectStoreSecondaryTierManager._submit_transfer

        def submit(self, job_id, block_ids, obj_keys, op):
            before = len(self._pending_results)
            original(self, job_id, block_ids, obj_keys, op)
            del self._pending_results[before:]  # the submission failure is never reported
        patch.setattr(module.ObjectStoreSecondaryTierManager, "_submit_transfer", submit)
    run = _drive(objstore, mutant, object_store="err/")
    assert "objstore-jobs-reported" in violated(run), run["violations"]


def test_the_recipe_replays_with_kvdoctor_repro(objstore):
    """The scenario from a recipe file through the CLI (in this process: the import is paid once), every
    object-store invariant checked (the recipe's `invariants`): it runs through, nothing reproduced."""
    done = invoke("repro", str(RECIPE))
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert "checks held: B ran to its max_tokens" in out and "yes  B ran to its max_tokens" in out, out
    assert "reproduced " not in out.replace("not_reproduced", ""), out
