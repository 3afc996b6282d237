"""vLLM's MultiConnector over two OffloadingConnectors (`Setup.multi_connector`): the watched one first, then the
other. One builder for the in-process engines (`compat.kv_transfer_config`) and the `vllm serve` command
(`levels/serve.serve_command`), so both run the same connectors in the same order."""

from __future__ import annotations

from typing import Any

MULTI_CONNECTOR = "MultiConnector"


def multi_offloading_extra_config(watched: dict[str, Any], second: dict[str, Any], role: str) -> dict[str, Any]:
    """The MultiConnector's `kv_connector_extra_config`: its `connectors` list, each sub-connector's own config."""
    return {"connectors": [
        {"kv_connector": "OffloadingConnector", "kv_role": role, "kv_connector_extra_config": watched},
        {"kv_connector": "OffloadingConnector", "kv_role": role, "kv_connector_extra_config": second}]}
