"""A small, tolerant reader of the Python-repr text vLLM logs as `non-default args: {...}`.

It reads literals only (strings, numbers, True/False/None, lists, tuples,
dicts) and object reprs such as `KVTransferConfig(kv_connector='...', ...)`,
which become dicts with a `__class__` key. Nothing is evaluated: anything it
does not understand (a `<function ...>` repr, a cut-short line) becomes an
`Unreadable` value and the rest of the text is still read. Nesting deeper than
`MAX_DEPTH` is skipped, not recursed into.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

MAX_DEPTH = 32
MAX_TEXT = 1 << 20  # an args line longer than 1 MiB is read up to there

_NUMBER = re.compile(r"[-+]?(?:\d[\d_]*\.?\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?|inf|nan)")
_NAME = re.compile(r"[A-Za-z_][\w.]*")
_CLOSERS = {"{": "}", "[": "]", "(": ")", "<": ">"}


@dataclass(frozen=True)
class Unreadable:
    text: str  # at most 80 characters of what was skipped

    def __repr__(self) -> str:
        return f"<unreadable {self.text!r}>"


class _Reader:
    def __init__(self, text: str) -> None:
        self.text = text[:MAX_TEXT]
        self.i = 0

    def ws(self) -> None:
        n = len(self.text)
        while self.i < n and self.text[self.i] in " \t\r\n":
            self.i += 1

    def peek(self) -> str:
        return self.text[self.i] if self.i < len(self.text) else ""

    def skip_value(self, stops: str) -> Unreadable:
        """Skip to the next top-level character in `stops`, balancing brackets and quotes."""
        start, depth, n = self.i, 0, len(self.text)
        while self.i < n:
            c = self.text[self.i]
            if c in "'\"":
                self.string()
                continue
            if c in "{[(<":
                depth += 1
            elif c in "}])>":
                if depth == 0:
                    break
                depth -= 1
            elif depth == 0 and c in stops:
                break
            self.i += 1
        return Unreadable(self.text[start:self.i][:80])

    def string(self) -> str:
        quote = self.text[self.i]
        self.i += 1
        out: list[str] = []
        n = len(self.text)
        escapes = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", "'": "'", '"': '"', "0": "\0"}
        while self.i < n:
            c = self.text[self.i]
            if c == "\\" and self.i + 1 < n:
                nxt = self.text[self.i + 1]
                out.append(escapes.get(nxt, "\\" + nxt))
                self.i += 2
                continue
            self.i += 1
            if c == quote:
                return "".join(out)
            out.append(c)
        return "".join(out)  # unterminated (cut short): what there is

    def value(self, depth: int, stops: str) -> Any:
        self.ws()
        c = self.peek()
        if not c:
            return Unreadable("")
        if depth > MAX_DEPTH:
            return self.skip_value(stops)
        if c in "'\"":
            return self.string()
        if c == "{":
            return self.mapping(depth)
        if c in "[(":
            return self.sequence(depth)
        if c == "<":
            return self._skip_angle()
        match = _NUMBER.match(self.text, self.i)
        if match and match.end() > self.i and (c.isdigit() or c in "+-."):
            self.i = match.end()
            token = match.group().replace("_", "")
            try:
                return float(token) if any(ch in token for ch in ".eEn") else int(token)
            except ValueError:
                return Unreadable(token)
        match = _NAME.match(self.text, self.i)
        if match:
            name = match.group()
            self.i = match.end()
            if name in ("True", "False", "None"):
                return {"True": True, "False": False, "None": None}[name]
            self.ws()
            if self.peek() == "(":
                return self.call(name, depth)
            return Unreadable(name)
        return self.skip_value(stops)

    def _skip_angle(self) -> Unreadable:
        start, depth, n = self.i, 0, len(self.text)
        while self.i < n:
            c = self.text[self.i]
            self.i += 1
            if c == "<":
                depth += 1
            elif c == ">":
                depth -= 1
                if depth == 0:
                    break
        return Unreadable(self.text[start:self.i][:80])

    def _items(self, close: str, read_item: Any) -> None:
        """The loop every container shares: items separated by commas up to `close` (or the end).

        `read_item` reads one item; if it consumed nothing (a stray closer, say) the loop steps
        over one character, so the reader always moves on.
        """
        self.i += 1  # the opener
        while True:
            self.ws()
            c = self.peek()
            if not c:
                return
            if c == close:
                self.i += 1
                return
            if c == ",":
                self.i += 1
                continue
            before = self.i
            read_item()
            if self.i == before:
                self.i += 1

    def mapping(self, depth: int) -> dict[Any, Any]:
        out: dict[Any, Any] = {}

        def entry() -> None:
            key = self.value(depth + 1, ":,}")
            self.ws()
            if self.peek() != ":":
                self.skip_value(",}")
                return
            self.i += 1
            val = self.value(depth + 1, ",}")
            if isinstance(key, (str, int, float, bool)) or key is None:
                out[key] = val

        self._items("}", entry)
        return out

    def sequence(self, depth: int) -> list[Any]:
        close = _CLOSERS[self.peek()]
        out: list[Any] = []
        self._items(close, lambda: out.append(self.value(depth + 1, "," + close)))
        return out

    def call(self, name: str, depth: int) -> dict[str, Any]:
        out: dict[str, Any] = {"__class__": name}

        def argument() -> None:
            match = _NAME.match(self.text, self.i)
            if match:
                after = self.i
                self.i = match.end()
                self.ws()
                if self.peek() == "=":
                    self.i += 1
                    out[match.group()] = self.value(depth + 1, ",)")
                    return
                self.i = after
            self.value(depth + 1, ",)")  # positional argument: read past it

        self._items(")", argument)
        return out


def parse_repr(text: str) -> Any:
    """The value the repr text describes, as far as it can be read; never raises."""
    try:
        return _Reader(text).value(0, "")
    except RecursionError:  # pragma: no cover - MAX_DEPTH keeps the stack shallow
        return Unreadable(text[:80])
