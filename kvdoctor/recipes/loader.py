"""Load recipe TOML files with errors that name file, line and what was expected.

`tomllib` reports syntax errors with a line but gives no positions for valid
documents, so `_LineIndex` maps tables and keys back to lines by scanning the
text. Recipe files are data: they are parsed, never executed.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path
from typing import Any

from kvdoctor.engine.setup import Setup
from kvdoctor.errors import RecipeError
from kvdoctor.recipes.model import (
    ACTIONS, CONNECTOR_STATES, EXPECT_FIELDS, STEP_FIELDS, TRANSFER_KINDS, Recipe, Signature, Step,
)

_HEADER = re.compile(r"^\s*(\[\[?)\s*([A-Za-z0-9_.\-\"' ]+?)\s*(\]\]?)\s*(#.*)?$")
_TOP_TABLES = {"recipe", "setup", "signature", "step", "check"}
_RECIPE_KEYS = {"name": (str,), "summary": (str,), "bug": (str,), "title": (str,), "refs": (list,)}
_SIGNATURE_KEYS = {"exception": (str,), "function": (str,), "contains": (str,), "invariant": (str,)}
_SETUP_KEYS = {f.name: f for f in dataclasses.fields(Setup) if f.name not in ("model", "extra_connector_config")}
_TYPE_NAMES = {str: "a string", int: "an integer", bool: "true or false", list: "an array", dict: "a table"}


class _LineIndex:
    """Where each table and key of a TOML document starts (1-based lines)."""

    def __init__(self, text: str) -> None:
        self.lines = text.splitlines()
        self.headers: list[tuple[int, str, bool]] = []  # (line, name, is_array)
        for number, raw in enumerate(self.lines, start=1):
            match = _HEADER.match(raw)
            if match and raw.lstrip().startswith("["):
                self.headers.append((number, match.group(2).strip().strip("\"'"), match.group(1) == "[["))

    def table(self, name: str, index: int | None = None) -> int:
        found = [line for line, header, is_array in self.headers if header == name]
        if index is None:
            return found[0] if found else 0
        return found[index] if index < len(found) else 0

    def key(self, table_line: int, key: str) -> int:
        """The line of `key = ...` inside the table that starts at `table_line`."""
        if table_line == 0:
            return 0
        pattern = re.compile(r"^\s*[\"']?" + re.escape(key) + r"[\"']?\s*=")
        for number in range(table_line + 1, len(self.lines) + 1):
            text = self.lines[number - 1]
            if text.lstrip().startswith("["):
                break
            if pattern.match(text):
                return number
        return table_line


class _Reader:
    def __init__(self, source: str, text: str) -> None:
        self.source = source
        self.index = _LineIndex(text)

    def fail(self, line: int, message: str) -> RecipeError:
        return RecipeError(f"{self.source}:{line or 1}: {message}")

    def check_type(self, value: Any, types: tuple[type, ...], line: int, what: str) -> Any:
        ok = any(isinstance(value, t) and not (t is int and isinstance(value, bool)) for t in types)
        if not ok:
            expected = " or ".join(_TYPE_NAMES.get(t, t.__name__) for t in types)
            raise self.fail(line, f"{what} must be {expected}, got {_show(value)}")
        return value


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def load_recipe_text(text: str, source: str, builtin: bool = False) -> Recipe:
    """Parse and validate a recipe document; every error is one line with file:line."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        match = re.search(r"\(at line (\d+), column (\d+)\)", str(exc))
        line = int(match.group(1)) if match else (1 if "end of document" not in str(exc) else len(text.splitlines()))
        message = re.sub(r"\s*\(at line \d+, column \d+\)", "", str(exc)) or "syntax error"
        raise RecipeError(f"{source}:{line}: invalid TOML: {message}") from None
    reader = _Reader(source, text)
    return _build(reader, data, builtin)


def load_recipe_file(path: str | Path, builtin: bool = False) -> Recipe:
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise RecipeError(f"{path}: no such recipe file") from None
    except IsADirectoryError:
        raise RecipeError(f"{path}: is a directory, not a recipe file") from None
    except OSError as exc:
        raise RecipeError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise RecipeError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[exc.start]:02x})") from None
    if "\x00" in text:
        line = text[: text.index("\x00")].count("\n") + 1
        raise RecipeError(f"{path}:{line}: not a text file (NUL byte)")
    return load_recipe_text(text, str(path), builtin=builtin)


def _build(r: _Reader, data: dict[str, Any], builtin: bool) -> Recipe:
    for key in data:
        if key not in _TOP_TABLES:
            line = r.index.table(key) or _top_key_line(r, key)
            raise r.fail(line, f"unknown table [{key}] (expected {', '.join(sorted(_TOP_TABLES))})")

    meta = _table(r, data, "recipe", required=True)
    meta_line = r.index.table("recipe")
    _known_keys(r, meta, _RECIPE_KEYS, meta_line, "[recipe]")
    for required in ("name", "summary"):
        if required not in meta:
            raise r.fail(meta_line, f"[recipe] needs '{required}'")
    for key, types in _RECIPE_KEYS.items():
        if key in meta:
            r.check_type(meta[key], types, r.index.key(meta_line, key), f"[recipe] {key}")
    refs = meta.get("refs", [])
    for ref in refs:
        r.check_type(ref, (str,), r.index.key(meta_line, "refs"), "[recipe] refs entries")

    setup = _setup(r, data.get("setup", {}))
    signature = _signature(r, data)
    steps = _steps(r, data, "step", STEP_FIELDS)
    if not steps:
        raise r.fail(0, "a recipe needs at least one [[step]]")
    checks = _steps(r, data, "check", {"expect": EXPECT_FIELDS}, implicit_action="expect")
    _check_request_ids(r, steps, checks)
    return Recipe(
        name=meta["name"], summary=meta["summary"].strip(), signature=signature, steps=tuple(steps),
        setup=setup, checks=tuple(checks), bug=meta.get("bug"), title=meta.get("title"),
        refs=tuple(refs), source=r.source, builtin=builtin,
    )


def _top_key_line(r: _Reader, key: str) -> int:
    pattern = re.compile(r"^\s*" + re.escape(key) + r"\s*=")
    for number, text in enumerate(r.index.lines, start=1):
        if pattern.match(text):
            return number
    return 1


def _table(r: _Reader, data: dict[str, Any], name: str, required: bool = False) -> dict[str, Any]:
    if name not in data:
        if required:
            raise r.fail(1, f"missing [{name}] table")
        return {}
    value = data[name]
    if not isinstance(value, dict):
        raise r.fail(r.index.table(name) or _top_key_line(r, name), f"[{name}] must be a table")
    return value


def _known_keys(r: _Reader, table: dict[str, Any], allowed: Any, table_line: int, where: str) -> None:
    for key in table:
        if key not in allowed:
            raise r.fail(r.index.key(table_line, key),
                         f"{where}: unknown key '{key}' (expected one of {', '.join(sorted(allowed))})")


def _setup(r: _Reader, raw: Any) -> dict[str, Any]:
    line = r.index.table("setup")
    if not isinstance(raw, dict):
        raise r.fail(line or _top_key_line(r, "setup"), "[setup] must be a table")
    allowed = set(_SETUP_KEYS) | {"kv_connector_extra_config"}
    _known_keys(r, raw, allowed, line, "[setup]")
    setup: dict[str, Any] = {}
    for key, value in raw.items():
        key_line = r.index.key(line, key)
        if key == "kv_connector_extra_config":
            r.check_type(value, (dict,), r.index.table("setup.kv_connector_extra_config") or key_line,
                         "[setup] kv_connector_extra_config")
            setup["extra_connector_config"] = dict(value)
            continue
        field = _SETUP_KEYS[key]
        types: tuple[type, ...] = {"int": (int,), "bool": (bool,), "str | None": (str,)}.get(str(field.type), (int,))
        r.check_type(value, types, key_line, f"[setup] {key}")
        if types == (int,) and value < 1:
            raise r.fail(key_line, f"[setup] {key} must be a positive integer, got {value}")
        setup[key] = value
    return setup


def _signature(r: _Reader, data: dict[str, Any]) -> Signature:
    if "signature" not in data:
        raise r.fail(1, "missing [signature] table: say what 'reproduced' means "
                        "(exception + function, or invariant)")
    raw = _table(r, data, "signature")
    line = r.index.table("signature")
    _known_keys(r, raw, _SIGNATURE_KEYS, line, "[signature]")
    for key, types in _SIGNATURE_KEYS.items():
        if key in raw:
            r.check_type(raw[key], types, r.index.key(line, key), f"[signature] {key}")
    if "invariant" in raw:
        if "exception" in raw or "function" in raw:
            raise r.fail(line, "[signature] takes either 'invariant' or 'exception' + 'function', not both")
    elif not ("exception" in raw and "function" in raw):
        raise r.fail(line, "[signature] needs 'exception' and 'function' (or 'invariant')")
    return Signature(**raw)


def _steps(r: _Reader, data: dict[str, Any], table: str, vocabulary: dict[str, Any],
           implicit_action: str | None = None) -> list[Step]:
    raw = data.get(table, [])
    if not isinstance(raw, list):
        raise r.fail(r.index.table(table) or _top_key_line(r, table), f"[[{table}]] must be an array of tables")
    steps = []
    for i, entry in enumerate(raw):
        line = r.index.table(table, i)
        where = f"{table} {i + 1}"
        if not isinstance(entry, dict):
            raise r.fail(line or _top_key_line(r, table), f"{where} must be a table")
        entry = dict(entry)
        if implicit_action:
            action = implicit_action
        else:
            if "action" not in entry:
                raise r.fail(line, f"{where} needs 'action' (one of {', '.join(ACTIONS)})")
            action = entry.pop("action")
            if not isinstance(action, str) or action not in ACTIONS:
                raise r.fail(r.index.key(line, "action"),
                             f"{where}: unknown action {_show(action)} (expected one of {', '.join(ACTIONS)})")
        fields = vocabulary[action]
        for key, value in entry.items():
            if key not in fields:
                allowed = ", ".join(sorted(fields)) or "no fields"
                raise r.fail(r.index.key(line, key), f"{where} ({action}): unknown field '{key}' (expected {allowed})")
            types, _ = fields[key]
            r.check_type(value, types, r.index.key(line, key), f"{where} ({action}) {key}")
        for key, (_, required) in fields.items():
            if required and key not in entry:
                raise r.fail(line, f"{where} ({action}) needs '{key}'")
        _check_values(r, action, entry, line, where)
        steps.append(Step(action=action, args=entry, line=line))
    return steps


def _check_values(r: _Reader, action: str, args: dict[str, Any], line: int, where: str) -> None:
    def at(key: str) -> int:
        return r.index.key(line, key)

    for key in ("prompt_tokens", "prompt_chunks", "max_tokens", "count", "shared_prefix_tokens"):
        if key in args and args[key] < 1:
            raise r.fail(at(key), f"{where} ({action}) {key} must be a positive integer, got {args[key]}")
    for key in ("allocated_blocks", "min_allocated_blocks", "in_flight_jobs", "min_in_flight_jobs",
                "store_jobs_built", "min_store_jobs_built"):
        if key in args and args[key] < 0:
            raise r.fail(at(key), f"{where} ({action}) {key} must be >= 0, got {args[key]}")
    if action == "add":
        sizes = [k for k in ("prompt_tokens", "prompt_chunks", "prompt", "fill_pool") if k in args]
        if len(sizes) != 1 or args.get("fill_pool") is False:
            raise r.fail(line, f"{where} (add) needs exactly one of 'prompt_tokens', 'prompt_chunks', "
                               f"'prompt' or 'fill_pool = true'")
        if "prompt" in args:
            if not args["prompt"] or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1024
                                             for t in args["prompt"]):
                raise r.fail(at("prompt"), f"{where} (add) prompt must be a non-empty array of token ids in [0, 1024)")
        if ("shared_prefix_with" in args) != ("shared_prefix_tokens" in args):
            raise r.fail(line, f"{where} (add) needs both 'shared_prefix_with' and 'shared_prefix_tokens'")
    if "kind" in args and args["kind"] not in TRANSFER_KINDS:
        raise r.fail(at("kind"), f"{where} ({action}) kind must be one of {', '.join(TRANSFER_KINDS)}, "
                                 f"got {_show(args['kind'])}")
    if "connector_state" in args and args["connector_state"] not in CONNECTOR_STATES:
        raise r.fail(at("connector_state"),
                     f"{where} ({action}) connector_state must be one of {', '.join(CONNECTOR_STATES)}")
    if "status" in args:
        statuses = args["status"] if isinstance(args["status"], list) else [args["status"]]
        for status in statuses:
            if not isinstance(status, str) or not re.fullmatch(r"[A-Z_]+", status):
                raise r.fail(at("status"), f"{where} ({action}) status must be a RequestStatus name "
                                           f"such as WAITING or PREEMPTED, got {_show(status)}")


def _check_request_ids(r: _Reader, steps: list[Step], checks: list[Step]) -> None:
    added: dict[str, int] = {}
    for i, step in enumerate(steps):
        if step.action == "add":
            rid = step.args["request"]
            if rid in added:
                raise r.fail(step.line, f"step {i + 1} (add): request '{rid}' was already added")
            other = step.args.get("shared_prefix_with")
            if other is not None and other not in added:
                raise r.fail(r.index.key(step.line, "shared_prefix_with"),
                             f"step {i + 1} (add): shared_prefix_with names unknown request '{other}'")
            added[rid] = i
            continue
        rid = step.args.get("request")
        if rid is not None and rid not in added:
            known = ", ".join(added) or "none yet"
            raise r.fail(r.index.key(step.line, "request"),
                         f"step {i + 1} ({step.action}): unknown request '{rid}' (added so far: {known})")
    for i, check in enumerate(checks):
        rid = check.args["request"]
        if rid not in added:
            raise r.fail(r.index.key(check.line, "request"), f"check {i + 1}: unknown request '{rid}'")
