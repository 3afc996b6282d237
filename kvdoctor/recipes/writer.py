"""Write a `Recipe` as a TOML recipe file that `kvdoctor.recipes.loader` loads back.

The inverse of the loader: `load_recipe_text(recipe_to_toml(r), ...)` gives a
recipe equal to `r` except for `source`, `builtin` and the steps' `line`
numbers (which the loader fills from the text). The summary is written
stripped, as the loader strips it. Every string is written as a TOML basic
string with escapes, so any text survives (quotes, backslashes, newlines,
control characters); keys that are not bare TOML keys are quoted.

Used by `kvdoctor explore` to save shrunk findings; no vLLM import.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any

from kvdoctor.recipes.model import Recipe, Signature, Step

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
# The order [setup] keys are written in (the rest follow alphabetically).
_SETUP_ORDER = ("block_size", "blocks_per_chunk", "gpu_blocks", "async_scheduling", "max_num_seqs",
                "max_num_batched_tokens", "max_model_len", "enable_chunked_prefill", "offload_prompt_only",
                "cpu_bytes_to_use", "spec_name")


def toml_key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else toml_string(key)


def _escape(text: str, literal: str) -> str:
    """TOML basic-string escapes; characters in `literal` are written as they are."""
    named = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r"}
    out = []
    for ch in text:
        if ch in literal:
            out.append(ch)
        elif ch in named:
            out.append(named[ch])  # escaping every quote rules out a stray closing delimiter
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return "".join(out)


def toml_string(text: str) -> str:
    """`text` as a one-line TOML basic string."""
    return '"' + _escape(text, literal="") + '"'


def toml_multiline(text: str) -> str:
    """`text` as a TOML multi-line basic string (newlines kept as lines, readable)."""
    return '"""\n' + _escape(text, literal="\n\t") + '\n"""'


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        if not value:
            return "{}"
        return "{ " + ", ".join(f"{toml_key(str(k))} = {toml_value(v)}" for k, v in value.items()
                                if v is not None) + " }"
    raise TypeError(f"cannot write {type(value).__name__} {value!r} as TOML")


def _pairs(items: Iterable[tuple[str, Any]]) -> list[str]:
    return [f"{toml_key(k)} = {toml_value(v)}" for k, v in items if v is not None]


def _setup_lines(setup: dict[str, Any]) -> list[str]:
    plain = {k: v for k, v in setup.items() if k not in ("extra_connector_config", "model") and v is not None}
    ordered = [k for k in _SETUP_ORDER if k in plain] + sorted(k for k in plain if k not in _SETUP_ORDER)
    lines = ["[setup]", *_pairs((k, plain[k]) for k in ordered)]
    extra = setup.get("extra_connector_config")
    if extra:
        lines += ["", "[setup.kv_connector_extra_config]", *_pairs(extra.items())]
    return lines


def _signature_lines(signature: Signature) -> list[str]:
    lines = ["[signature]", *_pairs((k, getattr(signature, k)) for k in ("exception", "function", "contains",
                                                                         "request", "invariant"))]
    if signature.callers:
        lines.append(f"callers = {toml_value(list(signature.callers))}")
    if signature.function_aliases:
        lines.append(f"function_aliases = {toml_value(list(signature.function_aliases))}")
    lines += _pairs((k, getattr(signature, k)) for k in ("site_function", "site", "site_when"))
    return lines


def _step_lines(step: Step, table: str, comment: str | None = None) -> list[str]:
    lines = [f"[[{table}]]" + (f"  # {comment}" if comment else "")]
    if table == "step":
        lines.append(f"action = {toml_string(step.action)}")
    lines += _pairs(step.args.items())
    return lines


def recipe_to_toml(recipe: Recipe, header: str = "", step_comments: dict[int, str] | None = None) -> str:
    """The recipe as TOML text. `header` becomes leading `#` comment lines; `step_comments`
    maps a step's 0-based index to a comment written after its `[[step]]` header."""
    lines: list[str] = [f"# {line}".rstrip() for line in header.splitlines()]
    meta: list[tuple[str, Any]] = [("name", recipe.name)]
    if recipe.bug is not None:
        meta.append(("bug", recipe.bug))
    if recipe.title is not None:
        meta.append(("title", recipe.title))
    lines += ["[recipe]", *_pairs(meta)]
    summary = recipe.summary.strip()
    lines.append("summary = " + (toml_multiline(summary) if "\n" in summary else toml_string(summary)))
    if recipe.workaround is not None:
        lines.append(f"workaround = {toml_string(recipe.workaround)}")
    for key in ("refs", "requires", "invariants"):
        values = list(getattr(recipe, key))
        if values:
            lines.append(f"{key} = {toml_value(values)}")
    if recipe.setup:
        lines += ["", *_setup_lines(recipe.setup)]
    lines += ["", *_signature_lines(recipe.signature)]
    comments = step_comments or {}
    for index, step in enumerate(recipe.steps):
        lines += ["", *_step_lines(step, "step", comments.get(index))]
    for check in recipe.checks:
        lines += ["", *_step_lines(check, "check")]
    return "\n".join(lines) + "\n"
