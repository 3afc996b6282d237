"""The scoped patch: install a `storable_chunks` variant, always restore vLLM's method.

The patch replaces `RequestOffloadState.storable_chunks` on the class (never a
file in site-packages) for the duration of a `with` block, and puts the very
same function object back in `finally`, even when the scenario raises.

Under the `installed` variant vLLM's method runs untouched: the wrapper calls
it with exactly the arguments vLLM passed and returns its result as is. Only
after it returned does kvdoctor record the call (the numbers vLLM passed, and
what the other variants would have returned), inside a guard that keeps any
error of kvdoctor's out of vLLM's call: such errors are kept in
`CallLog.errors` and the scenario reports them as kvdoctor's own failure. Under
`fixed` and `unpatched` the variant is kvdoctor's code, and an error raised in
it is attributed to kvdoctor (see `observe.failure`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from kvdoctor.engine import compat
from kvdoctor.errors import InternalError
from kvdoctor.logic.variants import UncappedGroupState, evaluate


@dataclass
class StorableCall:
    """One call vLLM made to `storable_chunks`, with what every variant returns for it."""

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
    keys_uncapped: int | None = None  # the installed method with unbounded offload keys (None: not evaluable)
    num_tokens: int | None = None  # req.num_tokens when vLLM made the call (known tokens: no draft counted)
    num_prompt_tokens: int | None = None


@dataclass
class CallLog:
    calls: list[StorableCall] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)  # kvdoctor's recording failures

    def take(self) -> list[StorableCall]:
        taken, self.calls = self.calls, []
        return taken

    def raise_recording_errors(self) -> None:
        """Report a failure of kvdoctor's recording as kvdoctor's, after vLLM's call is done."""
        if self.errors:
            exc = self.errors[0]
            self.errors = []
            raise InternalError(f"recording a storable_chunks call failed: {type(exc).__name__}: {exc}") from exc


def _all_tokens(api: Any, req_state: Any, request: Any) -> int:
    if api.offload_prompt_only(req_state):
        return min(request.num_tokens, request.num_prompt_tokens)
    return request.num_tokens


def record_call(api: Any, original: Any, req_state: Any, group_config: Any, args: tuple, kwargs: dict,
                returned: int, installed: int | None) -> StorableCall:
    """What one call looked like, every variant evaluated (`installed` given when already known)."""
    group_state, n, extra = api.split_storable_args(req_state, group_config, args, kwargs)
    call = api.storable_caller(original, extra)
    group = api.group_view(group_config, group_state)
    request = api.request_view(api.request_of(req_state))
    bpc = api.blocks_per_chunk_of(req_state)
    if installed is None:
        installed = evaluate("installed", call, req_state, group_config, group_state, n, bpc)
    allocated = group.block_ids // bpc
    try:
        keys_uncapped: int | None = int(call(req_state, group_config,
                                             UncappedGroupState(group_state, (compat.GROUP_STATE_OFFLOAD_KEYS,)), n))
    except Exception:  # a release whose method needs the real key list: unknown
        keys_uncapped = None
    return StorableCall(
        req_id=request.req_id,
        group_idx=group.group_idx,
        num_offloadable_tokens=n,
        token_chunks=n // group.tokens_per_chunk,
        allocated_chunks=allocated,
        keyed_chunks=group.offload_keys,
        installed=int(installed),
        fixed=min(int(installed), allocated),
        unpatched=int(evaluate("unpatched", call, req_state, group_config, group_state, n, bpc)),
        returned=int(returned),
        request_status=request.status,
        tokens_per_chunk=group.tokens_per_chunk,
        next_stored_chunk=group.next_stored_chunk,
        computed_tokens=request.num_computed_tokens,
        full_token_chunks=_all_tokens(api, req_state, request) // group.tokens_per_chunk,
        keys_uncapped=keys_uncapped,
        num_tokens=request.num_tokens,
        num_prompt_tokens=request.num_prompt_tokens,
    )


@contextmanager
def storable_chunks_variant(api: Any, variant: str, log: CallLog | None = None) -> Iterator[CallLog]:
    """Run the block with `storable_chunks` behaving as `variant`."""
    cls = api.RequestOffloadState
    had_own = "storable_chunks" in cls.__dict__
    original_attr = cls.__dict__.get("storable_chunks")
    original = cls.storable_chunks
    log = log if log is not None else CallLog()

    def installed(self: Any, group_config: Any, *args: Any, **kwargs: Any) -> int:
        returned = original(self, group_config, *args, **kwargs)  # vLLM's method, untouched
        try:
            log.calls.append(record_call(api, original, self, group_config, args, kwargs, returned, returned))
        except Exception as exc:  # never raised into vLLM's call; reported after the step
            log.errors.append(exc)
        return returned

    def variant_of_kvdoctor(self: Any, group_config: Any, *args: Any, **kwargs: Any) -> int:
        group_state, n, extra = api.split_storable_args(self, group_config, args, kwargs)
        call = api.storable_caller(original, extra)
        bpc = api.blocks_per_chunk_of(self)
        if variant == "unpatched":
            try:
                returned = evaluate(variant, call, self, group_config, group_state, n, bpc)
            except Exception as exc:  # vLLM's code on kvdoctor's stand-in object
                raise InternalError(f"the unpatched variant cannot evaluate this release's storable_chunks: "
                                    f"{type(exc).__name__}: {exc}") from exc
        else:
            returned = evaluate(variant, call, self, group_config, group_state, n, bpc)
        log.calls.append(record_call(api, original, self, group_config, args, kwargs, returned, None))
        return returned

    patched = installed if variant == "installed" else variant_of_kvdoctor
    patched.__wrapped__ = original  # type: ignore[attr-defined]  # functools.wraps's attribute, set by hand
    patched.__qualname__ = f"RequestOffloadState.storable_chunks[kvdoctor:{variant}]"
    cls.storable_chunks = patched
    try:
        yield log
    finally:
        if had_own:
            cls.storable_chunks = original_attr
        else:  # pragma: no cover - vLLM defines it on the class itself
            del cls.storable_chunks
