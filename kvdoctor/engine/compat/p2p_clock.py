"""The clock vLLM's P2P tier reads, advanced by a recipe's `p2p_clock` step (issue 36).

vLLM's P2P manager and sessions (0.33-0.34: `tiering/p2p/manager.py`, `session/{client,session,server}.py`) time
their rounds with `time.monotonic()`: the consumer's load timeout (30 s), the producer's store timeout (30 s),
the unbound-store timeout (60 s), the AbortAck timeout (10 s). A pair stepped in-process runs for well under a
second, so those paths are never reached unless the clock they read moves. `p2p_clock(clock)` gives each of
those modules a `time` whose `monotonic()` is the real one plus `clock.offset` (everything else is the real
`time` module), for the scope only: the modules' own `time` is restored on exit, even when the scope raises.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from kvdoctor.engine.compat.module_clock import module_clock

P2P_PACKAGE = "vllm.v1.kv_offload.tiering.p2p"
TIMED_MODULES = ("manager", "session.client", "session.session", "session.server")


class P2PClock:
    """How far vLLM's P2P clock is ahead of the real one, in seconds."""

    def __init__(self) -> None:
        self.offset = 0.0

    def advance(self, seconds: float) -> None:
        self.offset += seconds

    def now(self) -> float:
        """What vLLM's P2P modules read as `time.monotonic()` inside the scope."""
        return time.monotonic() + self.offset


@contextlib.contextmanager
def p2p_clock(clock: P2PClock) -> Iterator[None]:
    """vLLM's P2P modules read `clock` for the scope (see the module's docstring; compat/module_clock.py)."""
    with module_clock([f"{P2P_PACKAGE}.{name}" for name in TIMED_MODULES], clock.now):
        yield
