"""What `kvdoctor check` is asked about: a deployment's `vllm serve` flags, as one typed value."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from kvdoctor.errors import UsageError

DEFAULT_BLOCK_SIZE = 16  # vLLM's CacheConfig default on a GPU
DEFAULT_MAX_MODEL_LEN = 4096  # a context to plan for when --max-model-len is not given
DEFAULT_GPU_BLOCKS = 2048  # the pool planned when --num-gpu-blocks-override is not given (a GPU sizes its own)


@dataclass(frozen=True)
class CheckFlags:
    """The deployment's serve flags (None: vLLM's default, or kvdoctor's planning default, said in the result)."""

    model: str | None = None
    block_size: int | None = None
    gpu_blocks: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool | None = None
    enable_chunked_prefill: bool | None = None
    async_scheduling: bool | None = None
    kv_transfer_config: dict[str, Any] | None = None  # as `--kv-transfer-config` gives it (JSON object)
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    speculative_config: dict[str, Any] | None = None
    host_memory: int | None = None  # bytes the user says the serving host has (None: this host's)

    @property
    def extra_config(self) -> dict[str, Any]:
        extra = (self.kv_transfer_config or {}).get("kv_connector_extra_config") or {}
        return dict(extra) if isinstance(extra, dict) else {}

    def planned_block_size(self) -> int:
        return self.block_size or DEFAULT_BLOCK_SIZE

    def planned_max_model_len(self) -> int:
        return self.max_model_len or DEFAULT_MAX_MODEL_LEN


def parse_json_flag(flag: str, text: str | None) -> dict[str, Any] | None:
    """A JSON-object flag (`--kv-transfer-config`, `--speculative-config`), refused in one line if it is not one."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{flag} is not valid JSON: {exc.msg} (column {exc.colno})") from None
    if not isinstance(value, dict):
        raise UsageError(f"{flag} must be a JSON object")
    return value


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(flag: str, text: str) -> int:
    """`64G`, `64GiB`, `512MiB`, `1.5T` or a byte count -> bytes (binary units, as /proc/meminfo counts)."""
    match = _SIZE.match(text)
    if not match:
        raise UsageError(f"{flag} must be a size such as 64GiB, 512M or a number of bytes, got {text!r}")
    number, unit = float(match.group(1)), match.group(2).lower()
    size = int(number * (1 << (10 * "bkmgt".index(unit or "b"))))
    if size < 1:
        raise UsageError(f"{flag} must be positive, got {text!r}")
    return size
