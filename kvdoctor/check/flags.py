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


_INT_ARGS = {"block_size": "block_size", "num_gpu_blocks_override": "gpu_blocks", "max_model_len": "max_model_len",
             "max_num_seqs": "max_num_seqs", "max_num_batched_tokens": "max_num_batched_tokens",
             "tensor_parallel_size": "tensor_parallel_size", "data_parallel_size": "data_parallel_size"}
_SWITCH_ARGS = ("enable_prefix_caching", "enable_chunked_prefill", "async_scheduling")


def _plain(value: Any) -> Any:
    """A value read from a log's repr as JSON data: a dataclass's repr (`KVTransferConfig(...)`, read as a dict
    with its `__class__`) as its fields; what the log could not spell (an object's `<...>` repr) left out."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()
                if k != "__class__" and _plain(v) is not _DROPPED}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value if _plain(v) is not _DROPPED]
    return value if value is None or isinstance(value, str | int | float | bool) else _DROPPED


_DROPPED = object()


def _json_object(name: str, value: Any) -> dict[str, Any]:
    """A JSON-object argument as a log or a command line carries it: a dict already (a log's repr), or JSON text."""
    if isinstance(value, dict):
        plain: dict[str, Any] = _plain(value)
        return plain
    parsed = parse_json_flag(f"--{name.replace('_', '-')}", str(value))
    return parsed or {}


def _switch(value: Any) -> bool:
    return value if isinstance(value, bool) else str(value).strip().lower() not in ("false", "0", "no", "off")


def flags_from_serve_args(args: dict[str, Any], simple_offload: str = "0") -> tuple[CheckFlags, list[str]]:
    """`vllm serve` arguments (underscore names: a log's `non-default args`, a command line's flags) as the
    flags `kvdoctor check` runs vLLM's start-up at, and what of them it could not use (a model that is not a
    local directory: kvdoctor's tiny model stands in; a value that is not one). Bad JSON: UsageError."""
    from pathlib import Path

    from kvdoctor.engine.serve_args import offloading_transfer_config

    values: dict[str, Any] = {}
    notes: list[str] = []
    for name, field_name in _INT_ARGS.items():
        if name in args and args[name] is not None:
            try:
                values[field_name] = int(str(args[name]))
            except ValueError:
                notes.append(f"{name} = {args[name]!r} is not a number: vLLM's default planned")
    for name in _SWITCH_ARGS:
        if name in args and args[name] is not None:
            values[name] = _switch(args[name])
    transfer = args.get("kv_transfer_config")
    transfer_text = None if transfer is None else json.dumps(_json_object("kv_transfer_config", transfer))
    size = args.get("kv_offloading_size")
    try:
        size_gib = None if size is None else float(str(size))
    except ValueError:
        raise UsageError(f"--kv-offloading-size must be a number of GiB, got {size!r}") from None
    transfer_text, offload_notes = offloading_transfer_config(size_gib, args.get("kv_offloading_backend"),
                                                              transfer_text, simple_offload)
    notes += offload_notes
    if transfer_text is not None:
        values["kv_transfer_config"] = _json_object("kv_transfer_config", transfer_text)
    if args.get("speculative_config") is not None:
        values["speculative_config"] = _json_object("speculative_config", args["speculative_config"])
    model = args.get("model") or args.get("model_tag")
    if model is not None:
        if Path(str(model)).is_dir():
            values["model"] = str(model)
        else:
            notes.append(f"model {model}: not a local directory here, so kvdoctor's tiny model stands in for its "
                         f"layers (give `--model DIR` with its config.json to plan its KV layout)")
    return CheckFlags(**values), notes
