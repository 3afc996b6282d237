"""The `time` a few of vLLM's modules read, replaced for a scope (issue 36): what kvdoctor's replayable clocks share.

vLLM's timed code calls `time.monotonic()` through its module's global `time`. `module_clock(modules, now)` gives
each module a stand-in `time` whose `monotonic()` is `now()` (every other name is the real `time` module's), for the
scope only: each module's own `time` is put back on exit, even when the scope raises. Two users: the P2P tier's
timeouts (compat/p2p_clock.py: the real clock moved ahead) and the tiering backpressure detector (compat/step_clock.py:
a clock counted in scheduler steps). vLLM's code is not changed, only what its `time.monotonic` answers.
"""

from __future__ import annotations

import contextlib
import importlib
import time
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any


class _ClockedTime(types.ModuleType):
    """The `time` module with `monotonic()` answered by a clock."""

    def __init__(self, now: Callable[[], float]) -> None:
        super().__init__("time")
        self._now = now

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    def monotonic(self) -> float:
        return self._now()


@contextlib.contextmanager
def module_clock(module_names: Iterable[str], now: Callable[[], float]) -> Iterator[None]:
    """The named modules read `now()` as `time.monotonic()` for the scope (see the module's docstring)."""
    modules = [importlib.import_module(name) for name in module_names]
    saved = [(module, module.time) for module in modules
             if isinstance(getattr(module, "time", None), types.ModuleType)]
    shim = _ClockedTime(now)
    for module, _real in saved:
        module.time = shim  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for module, real in reversed(saved):
            module.time = real
