"""vLLM's own example secondary tier (`tiering/example/manager.py`), loaded by vLLM through `module_path`.

`RecordedExampleTier` is vLLM's `ExampleSecondaryTierManager` (an in-memory tier that keeps which keys it holds
and completes every job at once), unchanged: every method it overrides calls vLLM's own and only records what vLLM
asked and what the tier answered (`ExampleJournal`), which kvdoctor's example-tier invariants read
(observe/example_tier_invariants.py). The tier moves no bytes, so its promise is about keys: a key it stored a later
load returns, and a lookup hits only a key it stored. This module imports vLLM: only vLLM's loader and kvdoctor's
tests import it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.kv_offload.tiering.example.manager import ExampleSecondaryTierManager

TIER_CLASS = "RecordedExampleTier"
TIER_MODULE = __name__


@dataclass
class ExampleJournal:
    """What vLLM asked of the example tier and what the tier answered."""

    stored: set[Any] = field(default_factory=set)  # keys of every store job submitted (the tier is synchronous)
    loads: dict[int, tuple[Any, ...]] = field(default_factory=dict)  # load job -> keys, until its result
    phantom_hits: list[Any] = field(default_factory=list)  # HIT for a key no store job carried
    # a load's result that contradicts what was stored: (job, ok, keys never stored)
    wrong_loads: list[tuple[int, bool, tuple[Any, ...]]] = field(default_factory=list)
    hits: int = 0
    loads_checked: int = 0


class RecordedExampleTier(ExampleSecondaryTierManager):
    """vLLM's example tier, recorded (see the module's docstring); its arguments are vLLM's own."""

    kvdoctor_example = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.journal = ExampleJournal()

    def lookup(self, key: Any, req_context: Any) -> Any:
        result = super().lookup(key, req_context)
        if result.name == "HIT":
            self.journal.hits += 1
            if key not in self.journal.stored:
                self.journal.phantom_hits.append(key)
        return result

    def submit_store(self, job_metadata: Any) -> None:
        self.journal.stored.update(job_metadata.keys)
        super().submit_store(job_metadata)

    def submit_load(self, job_metadata: Any) -> None:
        self.journal.loads[job_metadata.job_id] = tuple(job_metadata.keys)
        super().submit_load(job_metadata)

    def get_finished_jobs(self) -> Iterable[Any]:
        results = list(super().get_finished_jobs())
        for result in results:
            keys = self.journal.loads.pop(result.job_id, None)
            if keys is None:
                continue
            self.journal.loads_checked += 1
            missing = tuple(key for key in keys if key not in self.journal.stored)
            if bool(result.success) == bool(missing):  # success with a key never stored, or failure without
                self.journal.wrong_loads.append((result.job_id, bool(result.success), missing))
        return results
