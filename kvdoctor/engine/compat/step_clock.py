"""The clock vLLM's tiering backpressure detector reads, counted in scheduler steps (issue 36).

vLLM's EMA detector (`tiering/backpressure.py`, 0.31+) times everything with `time.monotonic()`: a store's latency
(`update`: now - the job's `submit_time`), the idle decay of its EMA, the cooldown after pressure clears. On the wall
clock a run would not replay. kvdoctor's scripted tier (compat/scripted_tier.py) owns a `StepClock` when the setup
names vLLM's detector: it ticks once per scheduler step (`on_schedule_end`) by a declared number of seconds, the tier
stamps each store job's `submit_time` with it, and for the tier's lifetime (`attach` .. `detach`, from its
construction to its `shutdown`, which vLLM's manager calls when the scheduler shuts down, also after a scenario
raised) the backpressure module's `time.monotonic()` answers the clock (compat/module_clock.py). So the latencies the
detector sees are the tier script's completion schedule in steps, and pressure builds and clears on the same step of
every run. Several tiers alive at once share one swap; the last attached clock answers; the real `time` is put back
when the last detaches.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

from kvdoctor.engine.compat.module_clock import module_clock
from kvdoctor.engine.compat.names import TIER_BACKPRESSURE_MODULE

START_S = 1000.0  # what the clock reads before the first step (vLLM's detector takes 0.0 for "never")


class StepClock:
    """`START_S` plus `step_s` seconds per scheduler step ended."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.steps = 0

    def tick(self) -> None:
        self.steps += 1

    def now(self) -> float:
        return START_S + self.steps * self.step_s


_lock = threading.Lock()
_attached: list[StepClock] = []
_swap: contextlib.ExitStack | None = None


def _now() -> float:
    return _attached[-1].now() if _attached else time.monotonic()


def attach(clock: StepClock) -> None:
    """vLLM's backpressure module reads `clock` from now on (until `detach`)."""
    global _swap
    with _lock:
        if not _attached:
            swap = contextlib.ExitStack()
            swap.enter_context(module_clock([TIER_BACKPRESSURE_MODULE], _now))
            _swap = swap
        _attached.append(clock)


def detach(clock: StepClock) -> None:
    """Stop answering `clock` (again: nothing); the real `time` is back once no clock is attached."""
    global _swap
    with _lock:
        if not any(c is clock for c in _attached):
            return
        _attached[:] = [c for c in _attached if c is not clock]
        if not _attached and _swap is not None:
            swap, _swap = _swap, None
            swap.close()


@contextlib.contextmanager
def step_clock(clock: StepClock) -> Iterator[None]:
    """`attach` for the scope only, detached even when the scope raises."""
    attach(clock)
    try:
        yield
    finally:
        detach(clock)


@contextlib.contextmanager
def released_on_exit() -> Iterator[None]:
    """Every clock attached inside the scope is detached when it ends, even when it raises: a tier whose build
    failed midway, or whose scheduler's shutdown raised before reaching it, never leaves vLLM's backpressure
    module on a step clock for the process' next run (kvdoctor's scenario runs inside this scope)."""
    before = [id(c) for c in _attached]
    try:
        yield
    finally:
        for clock in [c for c in list(_attached) if id(c) not in before]:
            detach(clock)
