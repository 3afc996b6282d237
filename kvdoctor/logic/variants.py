"""The `storable_chunks` logic variants kvdoctor can run a scenario under.

- `installed`: vLLM's own method, untouched.
- `fixed`: the PR #49146 patch on top of the installed method:
  `min(installed result, len(group_state.block_ids) // blocks_per_chunk)`.
- `unpatched`: the installed method with that cap removed: it is evaluated as
  if every chunk of the group were allocated, so any other guard of the
  release (e.g. the 0.30 offload-key cap) still applies. On releases without
  the cap it equals `installed`.

Every variant is a pure function of vLLM's state; the scope that installs one
lives in `kvdoctor.logic.patch`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvdoctor.engine import compat
from kvdoctor.errors import UsageError

LOGIC_VARIANTS = ("installed", "fixed", "unpatched")
LOGIC_CHOICES = (*LOGIC_VARIANTS, "all")

# A bound call of vLLM's original method: (req_state, group_config, group_state, n) -> int
OriginalCall = Callable[[Any, Any, Any, int], int]


def expand_logic(choice: str) -> list[str]:
    if choice == "all":
        return list(LOGIC_VARIANTS)
    if choice not in LOGIC_VARIANTS:
        raise UsageError(f"--logic must be one of {', '.join(LOGIC_CHOICES)}, got {choice!r}")
    return [choice]


def allocated_chunks(group_state: Any, blocks_per_chunk: int) -> int:
    """The PR #49146 cap, as upstream wrote it: `len(group_state.block_ids) // blocks_per_chunk`."""
    return compat.load().allocated_block_count(group_state) // blocks_per_chunk


class _Unbounded:
    """Stands in for a list so a `len()`-based cap never binds."""

    def __len__(self) -> int:
        return 1 << 62


class UncappedGroupState:
    """A read-only view of a group state whose named lists look unbounded."""

    __slots__ = ("_fields", "_inner")

    def __init__(self, inner: Any, fields: tuple[str, ...] = (compat.GROUP_STATE_BLOCK_IDS,)) -> None:
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_fields", fields)

    def __getattr__(self, name: str) -> Any:
        if name in object.__getattribute__(self, "_fields"):
            return _Unbounded()
        return getattr(object.__getattribute__(self, "_inner"), name)


def evaluate(variant: str, original: OriginalCall, req_state: Any, group_config: Any,
             group_state: Any, num_offloadable_tokens: int, blocks_per_chunk: int) -> int:
    """`storable_chunks` under `variant`."""
    if variant == "installed":
        return original(req_state, group_config, group_state, num_offloadable_tokens)
    if variant == "fixed":
        installed = original(req_state, group_config, group_state, num_offloadable_tokens)
        return min(installed, allocated_chunks(group_state, blocks_per_chunk))
    if variant == "unpatched":
        return original(req_state, group_config, UncappedGroupState(group_state), num_offloadable_tokens)
    raise ValueError(f"unknown logic variant {variant!r}")
