"""What of the serve arguments may be shown or attached: an allow-list, never the raw line.

The reader keeps only the arguments of interest; this trims what is inside
them: the connector config keeps its geometry keys (secondary tiers keep only
their type), paths become their last component, and anything under a
secret-looking key is `<redacted>`.
"""

from __future__ import annotations

import re
from typing import Any

from kvdoctor.diagnose.pyrepr import Unreadable

_SECRET_KEY = re.compile(r"key|token|secret|passw|auth|credential|cookie|bearer|host|ip$|addr|port|url|endpoint"
                         r"|dir$|path|root", re.I)
_SECRET_VALUE = re.compile(r"^(?:sk|hf|ghp|gho|xox[bp])[-_][A-Za-z0-9_\-]{8,}$|^eyJ[\w-]{10,}\.")
_EXTRA_KEYS = ("cpu_bytes_to_use", "block_size", "spec_name", "offload_prompt_only", "eviction_policy",
               "secondary_tiers", "store_threshold", "lazy_offload")
_SPEC_KEYS = ("method", "num_speculative_tokens", "model")
REDACTED = "<redacted>"


def _path_tail(text: str) -> str:
    if text.startswith(("/", "~", "./", "../")) or "\\" in text:
        parts = [p for p in re.split(r"[\\/]", text) if p]
        return parts[-1] if parts else REDACTED
    return text


def _scalar(key: Any, value: Any) -> Any:
    key = str(key)  # a log's args repr can have any literal as a key (`{0: ''}`)
    if isinstance(value, Unreadable):
        return "<unreadable>"
    if isinstance(value, str):
        if _SECRET_KEY.search(key) or _SECRET_VALUE.search(value.strip()):
            return REDACTED
        return _path_tail(value)[:200]
    if isinstance(value, (bool, int, float)) or value is None:
        return value
    return REDACTED


def _mapping(value: Any) -> dict[str, Any] | None:
    if isinstance(value, dict):
        return {str(k): v for k, v in value.items() if not str(k).startswith("__")}
    if isinstance(value, str):
        import json

        try:
            data = json.loads(value)
        except ValueError:
            return None
        return data if isinstance(data, dict) else None
    return None


def redact_serve_args(args: dict[str, Any]) -> dict[str, Any]:
    shown: dict[str, Any] = {}
    for key, value in args.items():
        key = str(key)
        if key == "kv_transfer_config":
            data = _mapping(value)
            if data is None:
                shown[key] = "<unreadable>"
                continue
            out: dict[str, Any] = {k: _scalar(k, data[k]) for k in ("kv_connector", "kv_role") if k in data}
            extra = _mapping(data.get("kv_connector_extra_config")) or {}
            kept: dict[str, Any] = {}
            for k in _EXTRA_KEYS:
                if k not in extra:
                    continue
                if k == "secondary_tiers":
                    tiers = extra[k] if isinstance(extra[k], list) else []
                    kept[k] = [{"type": _scalar("type", t.get("type"))} for t in tiers if isinstance(t, dict)]
                else:
                    kept[k] = _scalar(k, extra[k])
            if kept:
                out["kv_connector_extra_config"] = kept
            shown[key] = out
        elif key == "speculative_config":
            data = _mapping(value)
            shown[key] = ({k: _scalar(k, data[k]) for k in _SPEC_KEYS if k in data} if data is not None
                          else _scalar(key, value))
        else:
            shown[key] = _scalar(key, value)
    return shown


def format_value(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {format_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)
