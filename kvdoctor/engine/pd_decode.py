"""The transport side of kvdoctor's NIXL stand-in on a P/D decode node (Setup.pd_decode).

The stand-in's scheduler side (`engine/compat/pd_connector.py`, the first connector of vLLM's MultiConnector)
issues one load per `do_remote_prefill` request into the blocks vLLM allocated. This plays those loads as a
remote prefill's transfer would end: each finishes the step after it was issued (`finished_recving`), or,
where the recipe scheduled it (`pd_fail`), fails: its request in `failed_recving` where this release's NIXL
reports failures by request, else its blocks (all, or the first `blocks`) in `invalid_block_ids`. vLLM's
scheduler then recomputes them or fails the request (`kv_load_failure_policy`). Nothing is copied: kvdoctor
stands in for the transport, as it does for the model and the copy engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class PdLoads:
    """The stand-in's loads in flight and the recipe's failure schedule."""

    api: Any
    # request id -> how many of its load's blocks fail (None: all), for its next load
    fail_next: dict[str, int | None] = field(default_factory=dict)
    in_flight: dict[str, list[int]] = field(default_factory=dict)
    issued: int = 0  # loads issued so far
    finished: list[str] = field(default_factory=list)  # requests whose load finished, in order
    failed: list[str] = field(default_factory=list)  # requests whose load failed, in order

    def fail(self, req_id: str, blocks: int | None) -> None:
        """`pd_fail`: the next load of `req_id` (or the one in flight) fails, `blocks` of it (None: all)."""
        self.fail_next[req_id] = blocks

    def run_step(self, metadata: Any, finished_requests: set[str]) -> Any:
        """The stand-in's KVConnectorOutput for one step: the loads issued before it end now; this step's
        loads (`metadata`, the stand-in's connector metadata) are then in flight."""
        done: set[str] = set()
        failed: set[str] = set()
        invalid: set[int] = set()
        for req_id, block_ids in self.in_flight.items():
            done.add(req_id)
            if req_id in self.fail_next:
                blocks = self.fail_next.pop(req_id)
                failed.add(req_id)
                invalid.update(block_ids if blocks is None else block_ids[:blocks])
                self.failed.append(req_id)
            else:
                self.finished.append(req_id)
        self.in_flight = {}
        from kvdoctor.engine.compat.pd_connector import loads_of  # imports vLLM: only once a step runs

        for req_id, block_ids in loads_of(metadata).items():
            self.in_flight[req_id] = list(block_ids)
            self.issued += 1
        return self.api.pd_standin_output(done, failed, invalid)
