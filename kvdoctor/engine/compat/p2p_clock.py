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
import importlib
import time
import types
from collections.abc import Iterator
from typing import Any

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


class _AdvancedTime(types.ModuleType):
    """The `time` module with `monotonic()` moved ahead by its clock's offset."""

    def __init__(self, clock: P2PClock) -> None:
        super().__init__("time")
        self._clock = clock

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    def monotonic(self) -> float:
        return self._clock.now()


@contextlib.contextmanager
def p2p_clock(clock: P2PClock) -> Iterator[None]:
    """vLLM's P2P modules read `clock` for the scope (see the module's docstring)."""
    modules = [importlib.import_module(f"{P2P_PACKAGE}.{name}") for name in TIMED_MODULES]
    saved = [(module, module.time) for module in modules if isinstance(getattr(module, "time", None),
                                                                          types.ModuleType)]
    shim = _AdvancedTime(clock)
    for module, _real in saved:
        module.time = shim  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for module, real in saved:
            module.time = real  # type: ignore[attr-defined]
