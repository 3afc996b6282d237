"""Load recipe TOML files with errors that name file, line and what was expected.

`tomllib` reports syntax errors with a line but gives no positions for valid
documents, so `_LineIndex` maps tables and keys back to lines by scanning the
(already parsed, hence valid) text: strings, comments and multi-line values are
skipped, so a `[step]` line inside a multi-line string is not taken for a
table. Lines count `\\n` only, as tomllib does. Every error is one line
(`file:line: what was expected`), whatever the bytes. Recipe files are data:
they are parsed, never executed.
"""

from __future__ import annotations

import bisect
import dataclasses
import re
import tomllib
import typing
from pathlib import Path
from types import UnionType
from typing import Any

from kvdoctor.engine.kv_layout import shipped_layouts
from kvdoctor.engine.serve_args import PASSED_THROUGH_KV_TRANSFER_KEYS
from kvdoctor.engine.setup import MAX_GPU_BLOCKS, RECIPE_KEY, WORKERS, Setup
from kvdoctor.errors import RecipeError
from kvdoctor.observe.coverage import parse_when
from kvdoctor.observe.invariants import INVARIANTS
from kvdoctor.recipes.model import Recipe, Signature, Step
from kvdoctor.recipes.requirements import REQUIREMENT_FORMS, is_known_requirement
from kvdoctor.steps import EXPECT_FIELDS, REGISTRY, Field, Need
from kvdoctor.steps import shown as _show

_TOP_TABLES = {"recipe", "setup", "signature", "step", "check"}
MAX_NAME = 100  # a recipe's name: one line a report can head (a 2 MB name printed 60,734 lines)
_RECIPE_KEYS = {"name": (str,), "summary": (str,), "bug": (str,), "title": (str,), "refs": (list,),
                "requires": (list,), "invariants": (list,), "workaround": (str,)}
_SIGNATURE_KEYS = {"exception": (str,), "function": (str,), "contains": (str,), "invariant": (str,),
                   "request": (str,), "callers": (list,), "function_aliases": (list,), "site_function": (str,),
                   "site": (str,), "site_when": (str,)}
_SETUP_KEYS = {f.name: f for f in dataclasses.fields(Setup) if f.metadata.get(RECIPE_KEY, True)}
_SETUP_TABLES = ("kv_transfer_fields",)  # [setup] keys that are tables, checked apart


def _value_types(name: str, hint: Any) -> tuple[type, ...]:
    """The TOML value type a `Setup` field takes, from its real annotation (`int | None` -> int); a field
    of any other type is refused here, when the module is imported, never guessed."""
    args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, UnionType) else (hint,)
    kinds = [a for a in args if a is not type(None)]
    if len(kinds) != 1 or kinds[0] not in (int, bool, str):
        raise TypeError(f"Setup.{name}: a [setup] key of type {hint!r} has no TOML reading; add one")
    return (kinds[0],)


_SETUP_HINTS = typing.get_type_hints(Setup)
_SETUP_TYPES = {name: _value_types(name, _SETUP_HINTS[name]) for name in _SETUP_KEYS if name not in _SETUP_TABLES}
_WORKER_CHOICES = " or ".join(f'"{worker}"' for worker in WORKERS)
_TYPE_NAMES = {str: "a string", int: "an integer", bool: "true or false", list: "an array", dict: "a table"}
_NESTING_SHOWN = 100  # where a too-deep nesting is reported


def _key_path(raw: str) -> tuple[str, ...]:
    """The dotted path of a (valid) TOML key or table name, quotes and escapes resolved."""
    try:
        node: Any = tomllib.loads(raw.strip() + " = 0")
    except (tomllib.TOMLDecodeError, ValueError, RecursionError):
        return tuple(part.strip().strip("\"'") for part in raw.split("."))
    path: list[str] = []
    while isinstance(node, dict) and len(node) == 1:
        key = next(iter(node))
        path.append(key)
        node = node[key]
    return tuple(path)


class _LineIndex:
    """Where each table header and each key of a valid TOML document is (1-based lines)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.lines = text.split("\n")
        self._newlines = [i for i, c in enumerate(text) if c == "\n"]
        self.headers: list[tuple[int, tuple[str, ...], bool]] = []  # (line, path, is_array)
        self.keys: list[tuple[int, int, tuple[str, ...]]] = []  # (line, header line of its table or 0, path)
        self._scan()

    def line_of(self, pos: int) -> int:
        return bisect.bisect_left(self._newlines, pos) + 1

    # -- scanning --------------------------------------------------------------
    def _scan(self) -> None:
        text, n = self.text, len(self.text)
        section = 0
        i = 0
        while i < n:
            c = text[i]
            if c in " \t\r\n":
                i += 1
            elif c == "#":
                i = self._to_eol(i)
            elif c == "[":
                is_array = text.startswith("[[", i)
                start = i + (2 if is_array else 1)
                end = self._key_end(start, "]")
                section = self.line_of(i)
                self.headers.append((section, _key_path(text[start:end]), is_array))
                i = self._to_eol(end)
            else:
                end = self._key_end(i, "=")
                self.keys.append((self.line_of(i), section, _key_path(text[i:end])))
                i = self._skip_value(end + 1)

    def _to_eol(self, i: int) -> int:
        end = self.text.find("\n", i)
        return len(self.text) if end < 0 else end + 1

    def _skip_string(self, i: int) -> int:
        """From the opening quote at `i` to just past the closing one."""
        text, n = self.text, len(self.text)
        for quote in ('"' * 3, "'" * 3):
            if text.startswith(quote, i):
                j = i + 3
                while j < n:
                    if quote[0] == '"' and text[j] == "\\":
                        j += 2
                    elif text.startswith(quote, j):
                        j += 3
                        extra = 0
                        while j < n and text[j] == quote[0] and extra < 2:  # """a"""" ends with a quote
                            j += 1
                            extra += 1
                        return j
                    else:
                        j += 1
                return n
        quote = text[i]
        j = i + 1
        while j < n and text[j] != quote and text[j] != "\n":
            j += 2 if (quote == '"' and text[j] == "\\") else 1
        return min(j + 1, n)

    def _key_end(self, i: int, stop: str) -> int:
        """The index of the `stop` that ends the key starting at `i` (quoted parts skipped)."""
        text, n = self.text, len(self.text)
        while i < n and text[i] != stop and text[i] != "\n":
            i = self._skip_string(i) if text[i] in "\"'" else i + 1
        return i

    def _skip_value(self, i: int) -> int:
        """Past the value starting at `i`, which may span lines inside brackets or strings."""
        text, n = self.text, len(self.text)
        depth = 0
        while i < n:
            c = text[i]
            if c in "\"'":
                i = self._skip_string(i)
                continue
            if c == "#":
                end = text.find("\n", i)
                i = n if end < 0 else end
                continue
            if c in "[{":
                depth += 1
            elif c in "]}":
                depth -= 1
            elif c == "\n" and depth <= 0:
                return i + 1
            i += 1
        return n

    # -- queries -----------------------------------------------------------------
    def top_key(self, key: str) -> int:
        """The line of a top-level `key = ...` (else of the first table under `key`); 0 if none."""
        for line, section, path in self.keys:
            if section == 0 and path and path[0] == key:
                return line
        for line, path, _ in self.headers:
            if path and path[0] == key:
                return line
        return 0

    def is_table_header(self, key: str) -> bool:
        return any(path and path[0] == key for _, path, _ in self.headers) and not any(
            section == 0 and path and path[0] == key for _, section, path in self.keys)

    def table(self, name: str, index: int | None = None) -> int:
        """The header line of table `name` (dotted) or of the `index`-th `[[name]]`; else its top-level key."""
        path = tuple(name.split("."))
        found = [line for line, header, _ in self.headers if header == path]
        if index is None:
            if found:
                return found[0]
        elif index < len(found):
            return found[index]
        return self.top_key(path[0]) if len(path) == 1 else 0

    def key(self, table_line: int, key: str) -> int:
        """The line of `key = ...` (or of a `[table.key]` header) in the table headed at `table_line`."""
        if table_line == 0:
            return 0
        for line, section, path in self.keys:
            if section == table_line and path and path[0] == key:
                return line
        table_path = next((header for line, header, _ in self.headers if line == table_line), None)
        if table_path is not None:
            for line, header, _ in self.headers:
                if line > table_line and header[: len(table_path) + 1] == (*table_path, key):
                    return line
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
        if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**63:
            raise self.fail(line, f"{what} must fit in 64 bits (|n| < 2**63), got {_show(value)}")
        return value


def _label(name: str) -> str:
    """A key or request id as a message shows it: bare when plain, else quoted and escaped."""
    return name if re.fullmatch(r"[A-Za-z0-9_\-]{1,40}", name) else _show(name)


def _quoted(name: str) -> str:
    return f"'{name}'" if re.fullmatch(r"[A-Za-z0-9_\-]{1,40}", name) else _show(name)


def _syntax_error(text: str, source: str, exc: Exception) -> RecipeError:
    """One line saying what tomllib refused, at the line it names."""
    if isinstance(exc, RecursionError):
        return RecipeError(f"{source}:{_deep_nesting_line(text)}: invalid TOML: arrays or inline tables "
                           f"nested too deeply")
    if not isinstance(exc, tomllib.TOMLDecodeError):  # int() refusing a literal of thousands of digits
        match = re.search(r"[0-9A-Fa-f_]{1000,}", text)
        line = text.count("\n", 0, match.start()) + 1 if match else 1
        return RecipeError(f"{source}:{line}: invalid TOML: number literal too long")
    full = str(exc)
    match = re.search(r"\(at line (\d+), column (\d+)\)", full)
    if match:
        line, where = int(match.group(1)), f" (column {match.group(2)})"
    else:  # "(at end of document)": the last line with content
        line, where = text.rstrip("\n").count("\n") + 1, " (at end of file)"
    message = re.sub(r"\s*\(at (line \d+, column \d+|end of document)\)", "", full)
    message = " ".join(message.split()) or "syntax error"
    return RecipeError(f"{source}:{line}: invalid TOML: {message}{where}")


def _deep_nesting_line(text: str) -> int:
    depth = 0
    for pos, char in enumerate(text):
        if char in "[{":
            depth += 1
            if depth > _NESTING_SHOWN:
                return text.count("\n", 0, pos) + 1
        elif char in "]}":
            depth = max(0, depth - 1)
    return 1


def load_recipe_text(text: str, source: str, builtin: bool = False) -> Recipe:
    """Parse and validate a recipe document; every error is one line with file:line."""
    if text.startswith("\ufeff"):  # a UTF-8 byte order mark, as some editors write
        text = text[1:]
    try:
        data = tomllib.loads(text)
    except (tomllib.TOMLDecodeError, ValueError, RecursionError) as exc:
        raise _syntax_error(text, source, exc) from None
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
        raise RecipeError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[exc.start]:02x}); "
                          f"recipe files must be UTF-8") from None
    if "\x00" in text:
        line = text[: text.index("\x00")].count("\n") + 1
        raise RecipeError(f"{path}:{line}: not a text file (NUL byte)")
    return load_recipe_text(text, str(path), builtin=builtin)


def _build(r: _Reader, data: dict[str, Any], builtin: bool) -> Recipe:
    for key in data:
        if key not in _TOP_TABLES:
            expected = ", ".join(sorted(_TOP_TABLES))
            if r.index.is_table_header(key):
                raise r.fail(r.index.top_key(key), f"unknown table [{_label(key)}] (expected {expected})")
            raise r.fail(r.index.top_key(key),
                         f"unknown top-level key {_quoted(key)} (expected the tables {expected})")

    meta = _table(r, data, "recipe", required=True)
    meta_line = r.index.table("recipe")
    _known_keys(r, meta, _RECIPE_KEYS, meta_line, "[recipe]")
    for required in ("name", "summary"):
        if required not in meta:
            raise r.fail(meta_line, f"[recipe] needs '{required}'")
    for key, types in _RECIPE_KEYS.items():
        if key in meta:
            r.check_type(meta[key], types, r.index.key(meta_line, key), f"[recipe] {key}")
    name = meta["name"]
    if len(name) > MAX_NAME or "\n" in name:  # it heads every report and names files
        raise r.fail(r.index.key(meta_line, "name"), f"[recipe] name must be one line of at most {MAX_NAME} "
                                                     f"characters, got {_show(name)} ({len(name):,} characters)")
    if "workaround" in meta and not meta["workaround"].strip():
        raise r.fail(r.index.key(meta_line, "workaround"),
                     "[recipe] workaround must say what avoids the bug (leave the key out when none is known)")
    refs = meta.get("refs", [])
    for ref in refs:
        r.check_type(ref, (str,), r.index.key(meta_line, "refs"), "[recipe] refs entries")
    requires = meta.get("requires", [])
    for requirement in requires:
        r.check_type(requirement, (str,), r.index.key(meta_line, "requires"), "[recipe] requires entries")
        if not is_known_requirement(requirement):
            raise r.fail(r.index.key(meta_line, "requires"),
                         f"[recipe] requires: unknown requirement {_show(requirement)} "
                         f"(expected {', '.join(REQUIREMENT_FORMS)})")
    invariants = meta.get("invariants", [])
    for name in invariants:
        r.check_type(name, (str,), r.index.key(meta_line, "invariants"), "[recipe] invariants entries")
        if name not in INVARIANTS:
            raise r.fail(r.index.key(meta_line, "invariants"),
                         f"[recipe] invariants: unknown invariant {_show(name)} "
                         f"(expected one of {', '.join(sorted(INVARIANTS))})")

    setup = _setup(r, data.get("setup", {}))
    signature = _signature(r, data)
    steps = _steps(r, data, "step", {name: kind.fields for name, kind in REGISTRY.items()})
    if not steps:
        raise r.fail(0, "a recipe needs at least one [[step]]")
    checks = _steps(r, data, "check", {"expect": EXPECT_FIELDS}, implicit_action="expect")
    _check_request_ids(r, steps, checks)
    if not setup.get("pd_decode"):  # a PD_DECODE kind without the stand-in has nothing to play on
        bare = next((s for s in steps if Need.PD_DECODE in REGISTRY[s.action].needs), None)
        if bare is not None:
            raise r.fail(bare.line, f"`{bare.action}` fails a remote-prefill load of kvdoctor's NIXL stand-in: "
                                    f"it needs [setup] pd_decode = true")
    if signature.request is not None:
        added = {step.args["request"] for step in steps if REGISTRY[step.action].admits}
        if signature.request not in added:
            raise r.fail(r.index.key(r.index.table("signature"), "request"),
                         f"[signature] request {_show(signature.request)} is not added by any step")
    return Recipe(
        name=meta["name"], summary=meta["summary"].strip(), signature=signature, steps=tuple(steps),
        setup=setup, checks=tuple(checks), bug=meta.get("bug"), title=meta.get("title"),
        refs=tuple(refs), source=r.source, builtin=builtin,
        requires=tuple(requires), invariants=tuple(invariants),
        workaround=" ".join(meta["workaround"].split()) if meta.get("workaround", "").strip() else None,
    )


def _table(r: _Reader, data: dict[str, Any], name: str, required: bool = False) -> dict[str, Any]:
    if name not in data:
        if required:
            raise r.fail(1, f"missing [{name}] table")
        return {}
    value = data[name]
    if not isinstance(value, dict):
        raise r.fail(r.index.table(name), f"[{name}] must be a table, got {_show(value)}")
    return value


def _known_keys(r: _Reader, table: dict[str, Any], allowed: Any, table_line: int, where: str) -> None:
    for key in table:
        if key not in allowed:
            raise r.fail(r.index.key(table_line, key),
                         f"{where}: unknown key {_quoted(key)} (expected one of {', '.join(sorted(allowed))})")


def _setup(r: _Reader, raw: Any) -> dict[str, Any]:
    line = r.index.table("setup")
    if not isinstance(raw, dict):
        raise r.fail(line, f"[setup] must be a table, got {_show(raw)}")
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
        if key == "kv_transfer_fields":
            r.check_type(value, (dict,), r.index.table("setup.kv_transfer_fields") or key_line,
                         "[setup] kv_transfer_fields")
            _known_keys(r, value, set(PASSED_THROUGH_KV_TRANSFER_KEYS), key_line, "[setup] kv_transfer_fields")
            setup[key] = dict(value)
            continue
        kinds = _SETUP_TYPES[key]
        r.check_type(value, kinds, key_line, f"[setup] {key}")
        if kinds == (int,) and value < 1:
            raise r.fail(key_line, f"[setup] {key} must be a positive integer, got {value}")
        if key == "gpu_blocks" and value > MAX_GPU_BLOCKS:  # Setup's own check names the CLI flag
            raise r.fail(key_line, f"[setup] gpu_blocks {value}: kvdoctor simulates pools up to "
                                   f"{MAX_GPU_BLOCKS:,} blocks (vLLM's scheduler builds one Python object per block)")
        if key == "worker" and value not in WORKERS:
            raise r.fail(key_line, f"[setup] worker must be {_WORKER_CHOICES}, got {_show(value)}")
        if key == "layout" and value not in shipped_layouts():
            raise r.fail(key_line, f"[setup] layout {_quoted(value)} is not a layout kvdoctor ships "
                                   f"(expected one of {', '.join(shipped_layouts())})")
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
        if raw["invariant"] not in INVARIANTS:
            raise r.fail(r.index.key(line, "invariant"),
                         f"[signature] unknown invariant {_show(raw['invariant'])} "
                         f"(expected one of {', '.join(sorted(INVARIANTS))})")
    elif not ("exception" in raw and "function" in raw):
        missing = " and ".join(f"'{k}'" for k in ("exception", "function") if k not in raw)
        raise r.fail(line, f"[signature] needs 'exception' and 'function' (or 'invariant'); missing {missing}")
    raw = dict(raw)
    if "site_function" in raw and not re.fullmatch(r"[A-Za-z_]\w*", raw["site_function"]):
        raise r.fail(r.index.key(line, "site_function"),
                     f"[signature] site_function must be a function name, got {_show(raw['site_function'])}")
    if "site_function" in raw and "site" not in raw and "contains" not in raw:
        raise r.fail(r.index.key(line, "site_function"),
                     "[signature] site_function needs 'site': text of the statement that is the crash site")
    if "site" in raw and "site_function" not in raw and "function" not in raw:
        raise r.fail(r.index.key(line, "site"), "[signature] site needs 'site_function' with an invariant: "
                                                "the vLLM function that holds the statement")
    if "site_when" in raw:
        try:
            parse_when(raw["site_when"])
        except ValueError as exc:
            raise r.fail(r.index.key(line, "site_when"),
                         f"[signature] site_when {_show(raw['site_when'])}: {exc}") from None
    if "site" in raw and not raw["site"].strip():
        raise r.fail(r.index.key(line, "site"), "[signature] site must name a statement's text, got an empty string")
    for key in ("callers", "function_aliases"):  # lists of function names, beside exception + function
        if key not in raw:
            continue
        key_line = r.index.key(line, key)
        if "invariant" in raw:
            raise r.fail(key_line, f"[signature] {key} go with 'exception' + 'function', not 'invariant'")
        for name in raw[key]:
            r.check_type(name, (str,), key_line, f"[signature] {key} entries")
            if not re.fullmatch(r"[A-Za-z_]\w*", name):
                raise r.fail(key_line, f"[signature] {key} entries must be function names, got {_show(name)}")
        raw[key] = tuple(raw[key])
    return Signature(**raw)


def _steps(r: _Reader, data: dict[str, Any], table: str, vocabulary: dict[str, dict[str, Field]],
           implicit_action: str | None = None) -> list[Step]:
    """The `[[table]]` entries as steps; `vocabulary`: each kind's declared fields (`kvdoctor.steps`)."""
    raw = data.get(table, [])
    if not isinstance(raw, list):
        raise r.fail(r.index.table(table), f"[[{table}]] must be an array of tables")
    steps = []
    for i, entry in enumerate(raw):
        line = r.index.table(table, i)
        where = f"{table} {i + 1}"
        if not isinstance(entry, dict):
            raise r.fail(line, f"{where} must be a table, got {_show(entry)}")
        entry = dict(entry)
        if implicit_action:
            action = implicit_action
            if "action" in entry:
                raise r.fail(r.index.key(line, "action"),
                             f"{where}: a [[{table}]] takes no 'action' (it is always an {implicit_action}); "
                             f"use [[step]] action = ... for steps")
        else:
            if "action" not in entry:
                raise r.fail(line, f"{where} needs 'action' (one of {', '.join(vocabulary)})")
            action = entry.pop("action")
            if not isinstance(action, str) or action not in vocabulary:
                raise r.fail(r.index.key(line, "action"),
                             f"{where}: unknown action {_show(action)} (expected one of {', '.join(vocabulary)})")
        fields = vocabulary[action]
        for key, value in entry.items():
            if key not in fields:
                allowed = ", ".join(sorted(fields)) or "no fields"
                raise r.fail(r.index.key(line, key),
                             f"{where} ({action}): unknown field {_quoted(key)} (expected {allowed})")
            r.check_type(value, fields[key].types, r.index.key(line, key), f"{where} ({action}) {key}")
        for key, spec in fields.items():
            if spec.required and key not in entry:
                raise r.fail(line, f"{where} ({action}) needs '{key}'")
        _check_values(r, action, fields, entry, line, where)
        steps.append(Step(action=action, args=entry, line=line))
    _check_preempt_fill(r, steps, table)
    return steps


def _check_preempt_fill(r: _Reader, steps: list[Step], table: str) -> None:
    """A `fill_pool = "preempt_next"` is planned around the one `prompt_rest_of_pool` add after it."""
    fills = [(i, s) for i, s in enumerate(steps) if s.action == "add" and s.args.get("fill_pool") == "preempt_next"]
    rests = [(i, s) for i, s in enumerate(steps) if s.action == "add" and s.args.get("prompt_rest_of_pool")]
    for i, step in fills[1:] + rests[1:]:
        raise r.fail(step.line, f"{table} {i + 1} (add): a recipe takes one fill_pool = \"preempt_next\" and one "
                                f"prompt_rest_of_pool add after it")
    if fills and not rests:
        i, step = fills[0]
        raise r.fail(step.line, f"{table} {i + 1} (add) fill_pool = \"preempt_next\" needs a later add with "
                                f"prompt_rest_of_pool = true (the request it preempts)")
    if rests and (not fills or fills[0][0] > rests[0][0]):
        i, step = rests[0]
        raise r.fail(step.line, f"{table} {i + 1} (add) prompt_rest_of_pool needs an earlier add with "
                                f"fill_pool = \"preempt_next\" (the fill whose blocks it is sized by)")


def _check_values(r: _Reader, action: str, fields: dict[str, Field], args: dict[str, Any], line: int,
                  where: str) -> None:
    """Each field's declared bounds and choices, in declaration order, then the kind's own checks across
    its fields (`validate` in its `kvdoctor.steps` declaration)."""
    def fail(key: str | None, text: str) -> RecipeError:
        return r.fail(line if key is None else r.index.key(line, key), f"{where} ({action}) {text}")

    for key, spec in fields.items():
        if key not in args:
            continue
        value = args[key]
        if spec.minimum is not None and value < spec.minimum:
            raise fail(key, f"{key} must be a positive integer, got {value}" if spec.minimum == 1
                       else f"{key} must be >= {spec.minimum}, got {value}")
        if spec.maximum is not None and value > spec.maximum:
            # vLLM has no context that long, and a plan or run at such a size would take minutes
            raise fail(key, f"{key} = {value} is above kvdoctor's bound {spec.maximum:,}")
        if spec.choices and value not in spec.choices:
            raise fail(key, f"{key} must be one of {', '.join(spec.choices)}, got {_show(value)}")
    REGISTRY[action].validate(args, fail)


def _check_request_ids(r: _Reader, steps: list[Step], checks: list[Step]) -> None:
    adds: dict[str, tuple[int, int]] = {}  # request -> (its add's step number, line), first add only
    for i, step in enumerate(steps):
        if REGISTRY[step.action].admits:
            adds.setdefault(step.args["request"], (i + 1, step.line))
    added: dict[str, int] = {}
    for i, step in enumerate(steps):
        if REGISTRY[step.action].admits:
            rid = step.args["request"]
            if rid in added:
                first, first_line = adds[rid]
                raise r.fail(r.index.key(step.line, "request"),
                             f"step {i + 1} ({step.action}): request {_quoted(rid)} was already added "
                             f"(step {first}, line {first_line}); request ids must be unique")
            other = step.args.get("shared_prefix_with")
            if other is not None and other not in added:
                raise r.fail(r.index.key(step.line, "shared_prefix_with"),
                             f"step {i + 1} ({step.action}): shared_prefix_with names unknown request {_quoted(other)} "
                             f"(added so far: {_known(added)})")
            added[rid] = i
            continue
        rid = step.args.get("request")
        if rid is not None and rid not in added:
            if rid in adds:
                later, later_line = adds[rid]
                raise r.fail(r.index.key(step.line, "request"),
                             f"step {i + 1} ({step.action}): request {_quoted(rid)} is used before it is added "
                             f"(its add is step {later}, line {later_line})")
            raise r.fail(r.index.key(step.line, "request"),
                         f"step {i + 1} ({step.action}): unknown request {_quoted(rid)} "
                         f"(added so far: {_known(added)})")
    for i, check in enumerate(checks):
        rid = check.args["request"]
        if rid not in added:
            raise r.fail(r.index.key(check.line, "request"),
                         f"check {i + 1}: unknown request {_quoted(rid)} (added: {_known(added)})")


def _known(added: dict[str, int]) -> str:
    return ", ".join(_label(rid) for rid in added) or "none yet"
