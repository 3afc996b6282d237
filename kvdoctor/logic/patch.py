"""The scoped patch: install a `storable_chunks` variant, always restore vLLM's method.

The patch replaces `RequestOffloadState.storable_chunks` on the class (never a
file in site-packages) for the duration of a `with` block, and puts the very
same function object back in `finally`, even when the scenario raises. While
installed it also records every call vLLM makes (the arguments vLLM really
passed), which is how kvdoctor explains which guard held.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

from kvdoctor.logic.variants import allocated_chunks, evaluate


@dataclass
class StorableCall:
    """One call vLLM made to `storable_chunks`, evaluated under every variant."""

    req_id: str
    group_idx: int
    num_offloadable_tokens: int
    token_chunks: int
    allocated_chunks: int
    keyed_chunks: int
    installed: int
    fixed: int
    unpatched: int
    returned: int
    request_status: str
    tokens_per_chunk: int
    next_stored_chunk: int
    computed_tokens: int  # req.num_computed_tokens when vLLM made the call (before this batch)
    full_token_chunks: int  # chunks of all the request's offloadable tokens, ignoring any basis rule


@dataclass
class CallLog:
    calls: list[StorableCall] = field(default_factory=list)

    def take(self) -> list[StorableCall]:
        taken, self.calls = self.calls, []
        return taken


def _all_tokens(req_state: Any) -> int:
    req = req_state.req
    if getattr(req_state.config, "offload_prompt_only", True):
        return min(req.num_tokens, req.num_prompt_tokens)
    return req.num_tokens


@contextmanager
def storable_chunks_variant(api: Any, variant: str, log: CallLog | None = None) -> Iterator[CallLog]:
    """Run the block with `storable_chunks` behaving as `variant`."""
    cls = api.RequestOffloadState
    had_own = "storable_chunks" in cls.__dict__
    original_attr = cls.__dict__.get("storable_chunks")
    original = cls.storable_chunks
    takes_group_state = api.storable_chunks_takes_group_state
    log = log if log is not None else CallLog()

    def call_original(req_state: Any, group_config: Any, group_state: Any, n: int) -> int:
        if takes_group_state:
            return original(req_state, group_config, group_state, n)
        return original(req_state, group_config, n)

    def patched(self: Any, group_config: Any, *args: Any) -> int:
        if takes_group_state:
            group_state, n = args
        else:
            (n,) = args
            group_state = api.group_state_for(self, group_config)
        bpc = self.config.blocks_per_chunk
        results = {name: evaluate(name, call_original, self, group_config, group_state, n, bpc)
                   for name in ("installed", "fixed", "unpatched")}
        returned = results[variant]
        log.calls.append(StorableCall(
            req_id=self.req.request_id,
            group_idx=int(group_config.group_idx),
            num_offloadable_tokens=int(n),
            token_chunks=int(n) // int(group_config.tokens_per_chunk),
            allocated_chunks=allocated_chunks(group_state, bpc),
            keyed_chunks=len(group_state.offload_keys),
            installed=results["installed"],
            fixed=results["fixed"],
            unpatched=results["unpatched"],
            returned=returned,
            request_status=getattr(self.req.status, "name", str(self.req.status)),
            tokens_per_chunk=int(group_config.tokens_per_chunk),
            next_stored_chunk=int(group_state.next_stored_chunk_idx),
            computed_tokens=int(self.req.num_computed_tokens),
            full_token_chunks=_all_tokens(self) // int(group_config.tokens_per_chunk),
        ))
        return returned

    patched.__wrapped__ = original  # type: ignore[attr-defined]
    patched.__qualname__ = "RequestOffloadState.storable_chunks[kvdoctor:%s]" % variant
    cls.storable_chunks = patched
    try:
        yield log
    finally:
        if had_own:
            cls.storable_chunks = original_attr
        else:  # pragma: no cover - vLLM defines it on the class itself
            del cls.storable_chunks
