"""vLLM's own object-store secondary tier, loaded by vLLM through `module_path`, on kvdoctor's fake NIXL agent.

`RecordedObjTier` is vLLM's `ObjectStoreSecondaryTierManager` built inside `objstore_agent_scope(script)`, so the
NIXL agent it makes is kvdoctor's `FakeObjAgent` (compat/objstore_agent.py: an in-memory bucket, faults scripted).
Every method it overrides calls vLLM's own and only records (`ObjJournal`), which kvdoctor's object-store
invariants read (observe/objstore_invariants.py). One thing it adds, standing in for the copy engine the simulated
worker stands in for: when vLLM hands it a store job, each chunk's bytes in the CPU tier's region are set to a
stamp of its offload key, so a later load's bytes can be compared with what was stored. This module imports vLLM:
only vLLM's loader and kvdoctor's tests import it.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from vllm.v1.kv_offload.tiering.obj.manager import ObjectStoreSecondaryTierManager

from kvdoctor.engine.compat import names
from kvdoctor.engine.compat.chunk_stamps import job_chunk_ids, stamp_chunks, unstamped_chunks
from kvdoctor.engine.compat.names import OBJ_MANAGER_MODULE
from kvdoctor.engine.compat.objstore_agent import FakeObjAgent, object_store

TIER_CLASS = "RecordedObjTier"
TIER_MODULE = __name__


@contextlib.contextmanager
def objstore_agent_scope(script: str, bucket: str) -> Iterator[None]:
    """vLLM's object-store manager builds kvdoctor's fake agent inside this scope; its `nixl_agent` and
    `nixl_agent_config` names are restored on exit, even when the build raises."""
    manager = importlib.import_module(OBJ_MANAGER_MODULE)
    saved = {name: vars(manager)[name] for name in ("nixl_agent", "nixl_agent_config")}

    def agent(name: str, config: Any = None) -> FakeObjAgent:
        return FakeObjAgent(name, config, script=script, bucket=bucket)

    manager.nixl_agent = agent  # type: ignore[attr-defined]
    manager.nixl_agent_config = lambda **kwargs: kwargs  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(manager, name, value)



@dataclass
class ObjJournal:
    """What vLLM asked of the object-store tier and what the tier reported."""

    stores: dict[int, tuple[tuple[Any, ...], tuple[int, ...]]] = field(default_factory=dict)  # job -> keys, chunks
    loads: dict[int, tuple[tuple[Any, ...], tuple[int, ...]]] = field(default_factory=dict)
    results: list[tuple[int, bool]] = field(default_factory=list)
    # a load reported successful whose chunk does not hold its key's bytes: (job, key, chunk)
    byte_mismatches: list[tuple[int, Any, int]] = field(default_factory=list)
    # a HIT answered for a key whose object the store does not hold: (key, object name)
    phantom_hits: list[tuple[Any, str]] = field(default_factory=list)
    loads_checked: int = 0
    hits: int = 0
    reported_lost: set[int] = field(default_factory=set)  # untracked jobs already reported
    orphan_handles: int = 0  # the most orphaned transfer handles already reported


class RecordedObjTier(ObjectStoreSecondaryTierManager):
    """vLLM's object-store tier on kvdoctor's fake NIXL agent (see the module's docstring). `script` is the fake
    agent's fault script ("<stores>/<loads>"); the other keyword arguments are vLLM's own."""

    kvdoctor_objstore = True

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str = "obj",
                 script: str = "", bucket: str = "kvdoctor", store_config: dict[str, Any] | None = None,
                 **kwargs: Any) -> None:
        config = store_config or {"bucket": bucket, "endpoint_override": "kvdoctor-memory"}
        object_store(config["bucket"]).objects.clear()  # a new engine: an earlier build's objects are no hits
        with objstore_agent_scope(script, config["bucket"]):
            super().__init__(offloading_spec, primary_kv_view, tier_type=tier_type, store_config=config, **kwargs)
        self.kvdoctor_agent: FakeObjAgent = names.get(self, names.OBJ_AGENT)
        self.kvdoctor_region = np.asarray(primary_kv_view)
        self.journal = ObjJournal()

    def lookup(self, key: Any, req_context: Any) -> Any:
        result = super().lookup(key, req_context)
        if result.name == "HIT":
            self.journal.hits += 1
            name = names.get(self, names.OBJ_FILE_MAPPER).get_file_name(key)
            if name not in self.kvdoctor_agent.store.objects:
                self.journal.phantom_hits.append((key, name))
        return result

    def submit_store(self, job_metadata: Any) -> None:
        keys, chunks = tuple(job_metadata.keys), job_chunk_ids(job_metadata)
        stamp_chunks(self.kvdoctor_region, keys, chunks)  # the copy engine's bytes (see the docstring)
        self.journal.stores[job_metadata.job_id] = (keys, chunks)
        self.kvdoctor_agent.begin("WRITE")
        super().submit_store(job_metadata)

    def submit_load(self, job_metadata: Any) -> None:
        self.journal.loads[job_metadata.job_id] = (tuple(job_metadata.keys), job_chunk_ids(job_metadata))
        self.kvdoctor_agent.begin("READ")
        super().submit_load(job_metadata)

    def get_finished_jobs(self) -> Iterable[Any]:
        results = list(super().get_finished_jobs())
        for result in results:
            self.journal.results.append((result.job_id, bool(result.success)))
            load = self.journal.loads.pop(result.job_id, None)
            self.journal.stores.pop(result.job_id, None)
            if load is None or not result.success:
                continue
            self.journal.loads_checked += 1
            self.journal.byte_mismatches += [(result.job_id, key, chunk)
                                             for key, chunk in unstamped_chunks(self.kvdoctor_region, *load)]
        return results

    def kvdoctor_untracked_jobs(self) -> list[int]:
        """Jobs vLLM's manager still tracks (`_store_jobs`, `_load_job_keys`) that will never be reported: neither
        in flight (`_transfers`) nor with a result waiting (`_pending_results`)."""
        reportable = set(names.get(self, names.OBJ_TRANSFERS)) | {
            r.job_id for r in names.get(self, names.OBJ_PENDING_RESULTS)}
        tracked = set(names.get(self, names.OBJ_STORE_JOBS)) | set(names.get(self, names.OBJ_LOAD_JOB_KEYS))
        return sorted(tracked - reportable)

    def kvdoctor_orphan_handles(self) -> int:
        """Transfer handles the agent holds that belong to no transfer vLLM still tracks (released nowhere)."""
        active = {id(entry.xfer_handle) for entry in names.get(self, names.OBJ_TRANSFERS).values()}
        return sum(id(x) not in active for x in self.kvdoctor_agent.live_xfers)
