"""vLLM's own P2P secondary tier, loaded by vLLM through `module_path`, on kvdoctor's in-memory transports.

`RecordedP2PTier` is vLLM's `P2PSecondaryTierManager` (0.34's `vllm/v1/kv_offload/tiering/p2p/manager.py`)
built inside `p2p_transports(fabric)`, so its NIXL and ZMQ transports are kvdoctor's in-memory stand-ins
(compat/p2p_transport.py). Every method it overrides calls vLLM's own first or after and only records: the
jobs vLLM submitted to it and the results it reported (`P2PJournal`), which kvdoctor's P2P invariants read
(observe/p2p_invariants.py). One thing it adds, standing in for the copy engine the simulated worker stands
in for: when the producer's tier receives a store job (the CPU tier has the chunks; vLLM cascades them here),
each chunk's bytes in the primary region are set to a stamp of its offload key, so the consumer's bytes can
be compared with what the producer served. This module imports vLLM: only vLLM's loader and kvdoctor's P2P
pair (engine/p2p.py) import it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from vllm.v1.kv_offload.tiering.p2p.manager import P2PSecondaryTierManager

from kvdoctor.engine.compat.chunk_stamps import job_chunk_ids, stamp_chunks, unstamped_chunks
from kvdoctor.engine.compat.p2p_transport import FABRICS, Fabric, p2p_transports

TIER_CLASS = "RecordedP2PTier"
TIER_MODULE = __name__




@dataclass
class P2PJournal:
    """What vLLM asked of one P2P tier and what the tier reported, in order."""

    local_id: str
    loads: dict[int, tuple[tuple[Any, ...], tuple[int, ...]]] = field(default_factory=dict)  # job -> keys, chunks
    stores: dict[int, tuple[tuple[Any, ...], tuple[int, ...]]] = field(default_factory=dict)
    # every reported result: (job id, success, deferred release event or None)
    results: list[tuple[int, bool, threading.Event | None]] = field(default_factory=list)
    # load jobs reported successful whose chunks did not hold the producer's bytes: (job, key, chunk)
    byte_mismatches: list[tuple[int, Any, int]] = field(default_factory=list)
    loads_checked: int = 0


class RecordedP2PTier(P2PSecondaryTierManager):
    """vLLM's P2P tier on kvdoctor's in-memory transports, recording its jobs (see the module's docstring).
    `fabric` names a `Fabric` in `FABRICS`; the other keyword arguments are vLLM's own."""

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str = "p2p",
                 fabric: str = "default", **kwargs: Any) -> None:
        self.kvdoctor_fabric: Fabric = FABRICS[fabric]
        with p2p_transports(self.kvdoctor_fabric):
            super().__init__(offloading_spec, primary_kv_view, tier_type=tier_type, **kwargs)
        self.kvdoctor_region = np.asarray(primary_kv_view)
        local_id = next(reversed(self.kvdoctor_fabric.control))  # the control transport just built
        self.journal = P2PJournal(local_id)
        self.kvdoctor_fabric.journals[local_id] = self.journal

    def submit_store(self, job_metadata: Any) -> None:
        keys = tuple(job_metadata.keys)
        chunks = job_chunk_ids(job_metadata)
        stamp_chunks(self.kvdoctor_region, keys, chunks)  # the copy engine's bytes (see the docstring)
        self.journal.stores[job_metadata.job_id] = (keys, chunks)
        super().submit_store(job_metadata)

    def submit_load(self, job_metadata: Any) -> None:
        keys = tuple(job_metadata.keys)
        chunks = job_chunk_ids(job_metadata)
        self.journal.loads[job_metadata.job_id] = (keys, chunks)
        super().submit_load(job_metadata)

    def get_finished_jobs(self) -> Iterable[Any]:
        results = list(super().get_finished_jobs())
        for result in results:
            # deferred releases: 0.34 (absent before: a failed load's chunks are released at once)
            self.journal.results.append((result.job_id, bool(result.success),
                                         getattr(result, "deferred_release", None)))
            load = self.journal.loads.get(result.job_id)
            if load is None or not result.success:
                continue
            self.journal.loads_checked += 1
            self.journal.byte_mismatches += [(result.job_id, key, chunk)
                                             for key, chunk in unstamped_chunks(self.kvdoctor_region, *load)]
        return results
