"""kvdoctor's stand-in for NIXL on a P/D decode node: the first connector of vLLM's real MultiConnector.

vLLM loads it by `kv_connector_module_path` (Setup.pd_decode), beside vLLM's real OffloadingConnector.
kvdoctor stands in for the remote prefill transport here, as it does for the model and the copy engine:
its scheduler side answers as NIXL's pull scheduler does for a request whose `kv_transfer_params` say
`do_remote_prefill` (every prompt token is external, loaded asynchronously, into the blocks vLLM
allocated), and hands the loads to kvdoctor's harness in its connector metadata. The harness
(`engine/pd_decode.PdLoads`) plays the transfer: the load finishes a step later, or fails on the
recipe's schedule through vLLM's `finished_recving` + `invalid_block_ids` path. Its worker-side methods
do nothing: no worker-role instance is built (kvdoctor's simulated worker stands in for the GPU).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, SupportsHMA

STANDIN_NAME = "KvdoctorNixlStandIn"
STANDIN_MODULE = "kvdoctor.engine.compat.pd_connector"


@dataclass
class PdLoadMetadata(KVConnectorMetadata):
    """The loads the stand-in issued in one step: request id -> the local block ids it fills."""

    loads: dict[str, list[int]] = field(default_factory=dict)


class KvdoctorNixlStandIn(KVConnectorBase_V1, SupportsHMA):
    """NIXL's decode-side scheduler answers, with no transport (see the module's docstring)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._pending: dict[str, list[int]] = {}

    # -- scheduler side: as NIXL's pull scheduler answers a remote prefill ----------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if params is not None and params.get("do_remote_prefill"):
            count = len(request.prompt_token_ids or []) - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        if num_external_tokens > 0:
            groups = blocks.get_unhashed_block_ids_all_groups()  # NIXL pulls every group's blocks
            self._pending[request.request_id] = [int(b) for group in groups for b in group]
        params["do_remote_prefill"] = False  # one transfer per request, as NIXL

    def build_connector_meta(self, scheduler_output: Any) -> PdLoadMetadata:
        meta = PdLoadMetadata(loads=self._pending)
        self._pending = {}
        return meta

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        self._pending.pop(request.request_id, None)
        return False, None

    def request_finished_all_groups(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, block_ids)

    def update_connector_output(self, connector_output: Any) -> None:
        return None

    # -- worker side: none is built (kvdoctor's simulated worker stands in) ---------------------------------
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None


def loads_of(metadata: Any) -> dict[str, list[int]]:
    """The loads one step's stand-in metadata carries (empty for any other metadata)."""
    return dict(getattr(metadata, "loads", {}) or {}) if isinstance(metadata, PdLoadMetadata) else {}


def connector_output(api_cls: Any, finished_recving: set[str], invalid_block_ids: set[int]) -> Any:
    """vLLM's KVConnectorOutput of the stand-in's worker for one step (`api_cls`: that class)."""
    out = api_cls()
    out.finished_recving = set(finished_recving) or None
    if invalid_block_ids:
        out.invalid_block_ids = set(invalid_block_ids)
    return out
