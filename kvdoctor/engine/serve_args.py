"""`vllm serve` arguments -> kvdoctor `Setup` fields: the one mapping.

`kvdoctor diagnose` reads serve arguments from a log (the `non-default args:`
line or a `vllm serve ...` command line); the geometry options of the other
commands are named after the same flags. Both go through `SERVE_ARG_TO_SETUP`
so a flag means one thing everywhere. No vLLM import.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kvdoctor.engine.setup import parse_kv_transfer_config
from kvdoctor.errors import UsageError

# serve-argument name (underscored, as in vLLM's EngineArgs) -> Setup field
SERVE_ARG_TO_SETUP: dict[str, str] = {
    "block_size": "block_size",
    "num_gpu_blocks_override": "gpu_blocks",
    "async_scheduling": "async_scheduling",
    "enable_chunked_prefill": "enable_chunked_prefill",
    "max_num_batched_tokens": "max_num_batched_tokens",
    "max_num_seqs": "max_num_seqs",
    "max_model_len": "max_model_len",
}
# Serve arguments that shape the offloading connector but are not a plain Setup field.
CONNECTOR_ARGS = ("kv_transfer_config", "kv_offloading_size", "kv_offloading_backend")
# Shown to the user, never mapped (kvdoctor downloads no model and simulates no drafter).
REPORTED_ONLY = ("model", "model_tag", "speculative_config", "enable_prefix_caching")
SERVE_ARGS_OF_INTEREST = tuple(SERVE_ARG_TO_SETUP) + CONNECTOR_ARGS + REPORTED_ONLY

_BOOL_FIELDS = {"async_scheduling", "enable_chunked_prefill"}
GIB = 1 << 30


def normalise_arg_name(name: str) -> str:
    """`--max-num-seqs`, `max_num_seqs` and `--max_num_seqs` are one argument."""
    return name.lstrip("-").replace("-", "_").strip().lower()


@dataclass
class MappedGeometry:
    """Setup overrides taken from serve arguments, and what could not be taken (said, not hidden)."""

    overrides: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def _as_int(name: str, value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            return None
    return None


def _as_bool(value: Any) -> bool | None:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0", "yes", "no"):
        return value.strip().lower() in ("true", "1", "yes")
    return None


def setup_overrides_from_serve_args(args: dict[str, Any]) -> MappedGeometry:
    """Map serve arguments (names normalised) onto `Setup` overrides.

    Values that are not what vLLM would accept are reported in `notes` and
    left out; `kv_transfer_config` goes through the same parser as
    `--kv-transfer-config`.
    """
    mapped = MappedGeometry()
    for arg, setup_field in SERVE_ARG_TO_SETUP.items():
        if arg not in args or args[arg] is None:
            continue
        value = args[arg]
        converted = _as_bool(value) if setup_field in _BOOL_FIELDS else _as_int(arg, value)
        if converted is None or (not isinstance(converted, bool) and converted < 1):
            mapped.notes.append(f"{arg}={value!r} is not usable as kvdoctor's {setup_field}; ignored")
            continue
        mapped.overrides[setup_field] = converted
    backend = args.get("kv_offloading_backend")
    if backend is not None and str(backend).lower() not in ("native",):
        mapped.notes.append(f"kv_offloading_backend={backend!r}: kvdoctor drives vLLM's native "
                            f"OffloadingConnector only")
    size = args.get("kv_offloading_size")
    if size is not None:
        try:
            gib = float(size)
        except (TypeError, ValueError):
            gib = -1.0
        if gib > 0:
            mapped.overrides["cpu_bytes_to_use"] = int(gib * GIB)
        else:
            mapped.notes.append(f"kv_offloading_size={size!r} is not a size in GiB; ignored")
    ktc = args.get("kv_transfer_config")
    if ktc is not None:
        _map_kv_transfer_config(ktc, mapped)
    return mapped


def _map_kv_transfer_config(value: Any, mapped: MappedGeometry) -> None:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            mapped.notes.append("kv_transfer_config is not valid JSON; ignored")
            return
    if isinstance(value, dict):
        data = {k: v for k, v in value.items() if not str(k).startswith("__")}
        connector = data.get("kv_connector")
        if connector is not None and connector != "OffloadingConnector":
            mapped.notes.append(f"kv_connector={connector!r}: kvdoctor drives OffloadingConnector only; "
                                f"its offloading geometry is used where the config names one")
        extra = data.get("kv_connector_extra_config") or {}
        data = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": extra if isinstance(extra, dict) else {}}
        try:
            text = json.dumps(data, default=str)
        except (TypeError, ValueError):
            mapped.notes.append("kv_transfer_config could not be read; ignored")
            return
    else:
        mapped.notes.append("kv_transfer_config could not be read; ignored")
        return

    try:
        overrides = parse_kv_transfer_config(text)
    except UsageError as exc:
        mapped.notes.append(f"kv_transfer_config not used: {exc}")
        return
    extra = overrides.pop("extra_connector_config", {}) or {}
    # Only the keys kvdoctor's CPU tier understands travel on; the rest (hosts, paths of
    # secondary tiers, credentials) stays in the user's deployment.
    kept = {k: v for k, v in extra.items() if k in ("eviction_policy",)}
    if set(extra) - set(kept):
        mapped.notes.append("kv_connector_extra_config keys not reproduced here: "
                            + ", ".join(sorted(str(k) for k in set(extra) - set(kept))))
    if kept:
        overrides["extra_connector_config"] = kept
    mapped.overrides.update(overrides)
