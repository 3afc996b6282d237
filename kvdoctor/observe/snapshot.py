"""Per-request chunk/block state, read from vLLM's scheduler and connector.

Storable chunks are shown under the installed and the fixed logic. Outside a
failure they are what the *next* store pass would compute (so `inspect` can
mark a request one step before the assertion fires); at a failure they are the
values of the call vLLM was making when it broke.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from kvdoctor.logic.patch import StorableCall
from kvdoctor.logic.variants import evaluate


@dataclass
class GroupSnapshot:
    group: int
    offload_keys: int
    allocated_blocks: int
    allocated_chunks: int
    next_stored_chunk: int
    offloadable_tokens: int
    storable_installed: int
    storable_fixed: int
    storable_active: int
    would_trip: bool  # the store assertion's two slices would differ under the active logic


@dataclass
class RequestSnapshot:
    request: str
    status: str
    prompt_tokens: int
    computed_tokens: int
    num_tokens: int
    connector_state: bool
    awaiting_final_store: bool
    store_jobs_built: int
    in_flight_jobs: list[str] = field(default_factory=list)
    groups: list[GroupSnapshot] = field(default_factory=list)

    @property
    def would_trip(self) -> bool:
        return any(g.would_trip for g in self.groups)

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["would_trip"] = self.would_trip
        return data


def store_slices_differ(storable: int, next_stored: int, keys: int, block_ids: int, bpc: int) -> bool:
    """Exactly the `len(offload_keys) == len(offload_block_ids)` test of `_build_store_jobs`."""
    if storable <= next_stored:
        return False
    num_keys = max(0, min(storable, keys) - next_stored)
    num_blocks = len(range(next_stored * bpc + bpc - 1, min(storable * bpc, block_ids), bpc))
    return num_keys != num_blocks


class Observer:
    """Reads state through the compatibility adapter; never changes it."""

    def __init__(self, harness: Any, variant: str) -> None:
        self.harness = harness
        self.api = harness.api
        self.cs = harness.connector_scheduler
        self.variant = variant
        self.finish_reported: set[str] = set()

    def note_step(self, finished_in_step: list[str]) -> None:
        self.finish_reported.update(finished_in_step)

    def _original(self) -> Any:
        method = self.api.RequestOffloadState.storable_chunks
        return getattr(method, "__wrapped__", method)

    def _basis_tokens(self, request: Any) -> int:
        """The token count the next store pass starts from (see `_build_store_jobs`)."""
        if request.is_finished():
            if (self.api.aborted_store_counts_computed_tokens
                    and request.status.name == "FINISHED_ABORTED"):
                return request.num_computed_tokens
            return request.num_tokens
        return request.num_computed_tokens

    def snapshot(self, failing_calls: list[StorableCall] | None = None) -> list[RequestSnapshot]:
        api = self.api
        if self.cs is None:  # no connector (offloading = false): scheduler state only
            states, jobs, bpc, configs = {}, {}, 1, ()
        else:
            states = api.request_states(self.cs)
            jobs = api.jobs(self.cs)
            bpc = api.blocks_per_chunk(self.cs)
            configs = api.group_configs(self.cs)
        original = self._original()
        recorded = {(c.req_id, c.group_idx): c for c in failing_calls or ()}
        snapshots = []
        for req_id, request in self.harness.requests.items():
            state = states.get(req_id)
            view = api.request_view(request)
            awaiting = request.is_finished() and req_id not in self.finish_reported and state is not None
            snap = RequestSnapshot(
                request=req_id,
                status=view.status,
                prompt_tokens=view.num_prompt_tokens,
                computed_tokens=view.num_computed_tokens,
                num_tokens=view.num_tokens,
                connector_state=state is not None,
                awaiting_final_store=awaiting,
                store_jobs_built=len(self.harness.store_jobs_by_request.get(req_id, ())),
            )
            if state is not None:
                snap.in_flight_jobs = [
                    f"{'store' if api.job_is_store(jobs[jid]) else 'load'}#{jid}"
                    for jid in sorted(api.transfer_job_ids(state)) if jid in jobs
                ]
                visited_next = awaiting or view.status == "RUNNING"
                n = api.offloadable_tokens(self.cs, state, self._basis_tokens(request))
                call_next = api.storable_caller(original, api.next_store_extra_args(self.cs))
                group_config: Any
                for group_config, group_state in zip(configs, api.group_states(state), strict=True):
                    group = api.group_view(group_config, group_state)
                    call = recorded.get((req_id, group.group_idx))
                    if call is not None:
                        tokens, installed, fixed = call.num_offloadable_tokens, call.installed, call.fixed
                        active = call.returned
                    else:
                        tokens = n
                        installed = evaluate("installed", call_next, state, group_config, group_state, n, bpc)
                        fixed = min(installed, group.block_ids // bpc)
                        active = (installed if self.variant == "installed" else fixed if self.variant == "fixed"
                                  else evaluate(self.variant, call_next, state, group_config, group_state, n, bpc))
                    snap.groups.append(GroupSnapshot(
                        group=group.group_idx,
                        offload_keys=group.offload_keys,
                        allocated_blocks=group.block_ids,
                        allocated_chunks=group.block_ids // bpc,
                        next_stored_chunk=group.next_stored_chunk,
                        offloadable_tokens=int(tokens),
                        storable_installed=int(installed),
                        storable_fixed=int(fixed),
                        storable_active=int(active),
                        would_trip=(visited_next or call is not None) and store_slices_differ(
                            active, group.next_stored_chunk, group.offload_keys, group.block_ids, bpc),
                    ))
            snapshots.append(snap)
        return snapshots
