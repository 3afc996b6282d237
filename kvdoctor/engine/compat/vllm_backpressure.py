"""vLLM's own backpressure detector and policies (`tiering/backpressure.py`), recording what they decide (issue 36).

Setup.backpressure_pattern = "vllm[:...]" (engine/tier_script.py) gives kvdoctor's scripted tier vLLM's
`EMABackpressureDetector` with its `ThrottledDropPolicy` or `DropStorePolicy`, built by vLLM's tier factory from the
tier's `backpressure` dict. The classes here are those, unchanged: each override calls vLLM's method and only writes
down what it answered (and, for the invariants, the detector's state when it was asked), as the scripted tier records
what vLLM asks of it. Time is kvdoctor's step clock (compat/step_clock.py). Only vLLM's factory and kvdoctor's tests
import this module; on a vLLM without the classes it refuses in one line (exit 2).
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass
from typing import Any

from kvdoctor.engine.compat import names
from kvdoctor.errors import UsageError

try:
    from vllm.v1.kv_offload.tiering.backpressure import (
        DropStorePolicy,
        EMABackpressureDetector,
        ThrottledDropPolicy,
    )
except ImportError as error:  # the loader's probe (VllmApi.has_vllm_backpressure) says why before a build
    raise UsageError("backpressure_pattern = \"vllm\": this vLLM's tiering has no EMABackpressureDetector / "
                     "ThrottledDropPolicy / DropStorePolicy (tiering/backpressure.py)") from error


@dataclass(frozen=True)
class StoreDecision:
    """One `should_store` of vLLM's detector: what it answered and its state when asked (before the call)."""

    allowed: bool
    blocks: int
    now: float  # the detector's clock when asked
    under_pressure: bool  # its pressure flag before the call
    pressured_after: bool  # and after
    armed: bool  # warmup over (or failure-tripped): an EMA that can decay, pressure that can clear
    ema: float
    last_update: float
    cleared_at: float  # when pressure last cleared (0.0: never since)
    low: float
    half_life_s: float
    cooldown_s: float


def _clock() -> float:
    """What vLLM's backpressure module reads as `time.monotonic()` (the step clock while a tier holds it)."""
    return float(sys.modules[EMABackpressureDetector.__module__].time.monotonic())


class RecordedEMADetector(EMABackpressureDetector):
    """vLLM's EMA detector; `records` every store decision (`decisions`: (allowed, blocks), as kvdoctor's scripted
    detector keeps them)."""

    kvdoctor_recorded = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        accepted = inspect.signature(EMABackpressureDetector.__init__).parameters
        unknown = sorted(k for k in kwargs if k not in accepted)
        if unknown:
            raise UsageError(f"backpressure_pattern: this vLLM's EMABackpressureDetector takes no {unknown[0]!r}")
        super().__init__(*args, **kwargs)
        self.decisions: list[tuple[bool, int]] = []
        self.records: list[StoreDecision] = []

    def should_store(self, num_blocks: int) -> bool:
        before = (names.get(self, names.BP_UNDER_PRESSURE),
                  names.get(self, names.BP_COMPLETIONS) >= names.get(self, names.BP_WARMUP_COMPLETIONS)
                  or bool(names.get(self, names.BP_FAILURE_TRIPPED, False)),
                  names.get(self, names.BP_EMA), names.get(self, names.BP_LAST_UPDATE),
                  names.get(self, names.BP_PRESSURE_CLEARED_AT))
        now = _clock()
        allowed = super().should_store(num_blocks)
        self.decisions.append((allowed, num_blocks))
        after = names.get(self, names.BP_UNDER_PRESSURE)
        self.records.append(StoreDecision(allowed, num_blocks, now, before[0], after, before[1], before[2], before[3],
                                          before[4], names.get(self, names.BP_LOW), names.get(self, names.BP_HALF_LIFE),
                                          names.get(self, names.BP_COOLDOWN)))
        return allowed

    @property
    def ema(self) -> float:
        return float(names.get(self, names.BP_EMA))


class _Recording:
    """A drop-accounting policy's running totals: what it was told was skipped, and what vLLM popped from it."""

    def __init__(self) -> None:
        super().__init__()
        self.skipped_total = (0, 0)
        self.popped_total = (0, 0)

    def on_store_skipped(self, num_blocks: int) -> None:
        super().on_store_skipped(num_blocks)  # type: ignore[misc]
        self.skipped_total = (self.skipped_total[0] + 1, self.skipped_total[1] + num_blocks)

    def pop_stores_dropped(self) -> tuple[int, int]:
        popped: tuple[int, int] = super().pop_stores_dropped()  # type: ignore[misc]
        self.popped_total = (self.popped_total[0] + popped[0], self.popped_total[1] + popped[1])
        return popped

    def unpopped(self) -> tuple[int, int]:
        """The counters vLLM has not popped yet (its next `pop_stores_dropped` answer)."""
        stores, blocks = names.get(self, names.BP_STORES_DROPPED, 0), names.get(self, names.BP_BLOCKS_DROPPED, 0)
        return int(stores), int(blocks)


class RecordedThrottledPolicy(_Recording, ThrottledDropPolicy):
    """vLLM's ThrottledDropPolicy, its drop counters totalled."""


class RecordedDropPolicy(_Recording, DropStorePolicy):
    """vLLM's DropStorePolicy, its drop counters totalled."""
