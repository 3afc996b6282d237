"""What the user gave over a recipe's [setup]: one typed value, read by `kvdoctor.resolution`.

Flags (`cli/serve_flags.py`), a log's serve arguments (`engine/serve_args.py`) and
`--kv-transfer-config` all become an `Overrides`; None means "not given" (the recipe's
value stays). `offloaded_block_size` is the connector's `kv_connector_extra_config.block_size`
in tokens, which only becomes `blocks_per_chunk` once the GPU block size is known.
No vLLM import.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Overrides:
    """`Setup` fields given by the user (None: not given)."""

    block_size: int | None = None
    blocks_per_chunk: int | None = None
    gpu_blocks: int | None = None
    async_scheduling: bool | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    enable_chunked_prefill: bool | None = None
    enable_prefix_caching: bool | None = None
    model: str | None = None
    cpu_bytes_to_use: int | None = None
    offload_prompt_only: bool | None = None
    spec_name: str | None = None
    # merged over the recipe's own kv_connector_extra_config
    extra_connector_config: dict[str, Any] | None = None
    kv_transfer_fields: dict[str, Any] | None = None
    # kv_connector_extra_config.block_size (tokens): resolved to blocks_per_chunk against block_size
    offloaded_block_size: int | None = None
    worker: str | None = None
    model_runner: str | None = None
    device: str | None = None
    engine: str | None = None
    num_workers: int | None = None
    speculative_method: str | None = None
    num_speculative_tokens: int | None = None
    secondary_tier: str | None = None
    mamba_cache_mode: str | None = None
    scheduling_policy: str | None = None
    offloading: bool | None = None

    def given(self) -> dict[str, Any]:
        """The `Setup` fields given, by name (`offloaded_block_size` is not a `Setup` field: read it apart)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name != "offloaded_block_size" and getattr(self, f.name) is not None}

    def any_given(self) -> bool:
        return bool(self.given()) or self.offloaded_block_size is not None

    def merged(self, other: Overrides) -> Overrides:
        """`other`'s given values over these."""
        given: dict[str, Any] = other.given()
        if other.offloaded_block_size is not None:
            given["offloaded_block_size"] = other.offloaded_block_size
        return dataclasses.replace(self, **given)

    def replaced(self, **values: Any) -> Overrides:
        return dataclasses.replace(self, **values)
