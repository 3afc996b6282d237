"""Renderables that fit the width they are given: nothing cut, nothing collapsed to `…`.

`Fit` shows its wide form (a table) when that fits at its natural width and
its narrow form (blocks, one per row) when it does not; `Items` packs short
items onto as few lines as the width allows, breaking only between items, so
a name, path or request id is never split or cut.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rich.console import Console, ConsoleOptions, RenderResult
from rich.measure import Measurement
from rich.text import Text


class Fit:
    def __init__(self, wide: Any, narrow: Any) -> None:
        self.wide = wide
        self.narrow = narrow

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        unbounded = options.update_width(1 << 16)  # Measurement.get clamps to the width it is given
        width = Measurement.get(console, unbounded, self.wide).maximum
        yield self.wide if width <= options.max_width else self.narrow

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        return Measurement.get(console, options, self.wide)


class Items:
    """`prefix` then items separated by `sep`, wrapped between items (continuations indented)."""

    def __init__(self, items: Iterable[Any], prefix: Any = "", indent: int = 2, sep: str = "  ",
                 style: str = "") -> None:
        self.items = [item if isinstance(item, Text) else Text(str(item)) for item in items if str(item)]
        self.prefix = prefix if isinstance(prefix, Text) else Text(str(prefix))
        self.indent = indent
        self.sep = sep
        self.style = style

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width = options.max_width
        line = self.prefix.copy()
        started = bool(self.prefix.plain.strip())
        for item in self.items:
            addition = (self.sep if started else "") + item.plain
            if started and line.cell_len + len(addition) > width and line.plain.strip():
                yield line
                line = Text(" " * self.indent)
                started = False
            if started:
                line.append(self.sep)
            line.append_text(item)
            started = True
        if line.plain.strip():
            if self.style:
                line.stylize(self.style)
            yield line

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        longest = max([self.prefix.cell_len + (self.items[0].cell_len if self.items else 0)]
                      + [self.indent + item.cell_len for item in self.items])
        total = self.prefix.cell_len + sum(len(self.sep) + item.cell_len for item in self.items)
        return Measurement(min(longest, options.max_width), min(total, options.max_width))


class Hanging:
    """Lines of plain text wrapped at the width with a hanging indent: each continuation goes under its
    line's own indent plus `extra`, so `    impact: ...` and `  K1 ...` keep their shape when wrapped
    (plain rich Text starts continuations at column 0). A line that fits is shown as it is."""

    def __init__(self, text: str, extra: int = 2, style: str = "") -> None:
        self.lines = text.split("\n")
        self.extra = extra
        self.style = style

    def _indent(self, line: str, width: int) -> str:
        lead = len(line) - len(line.lstrip(" "))
        return " " * min(lead + self.extra, width // 2)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        import textwrap

        width = options.max_width
        for line in self.lines:
            if len(line) <= width:
                yield Text(line, style=self.style)
                continue
            for wrapped in textwrap.wrap(line, width=width, subsequent_indent=self._indent(line, width),
                                         break_on_hyphens=False) or [line]:  # a word longer than a line: cut, indented
                yield Text(wrapped, style=self.style)

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        longest = max(len(line) for line in self.lines)
        words = max((len(word) for line in self.lines for word in line.split()), default=0)
        return Measurement(min(words + self.extra, options.max_width), min(longest, options.max_width))


def plural(count: int, word: str, plural_word: str | None = None) -> str:
    """`1 chunk`, `4 chunks`."""
    return f"{count} {word if count == 1 else (plural_word or word + 's')}"


class Cut:
    """One line: `head` whole, then `tail` cut with `…` to the width it is given.

    For lists a user scans (one recipe a line): the name they type next is in `head`,
    never cut; only the free-text tail gives way on a narrow terminal."""

    def __init__(self, head: Any, tail: str, style: str = "") -> None:
        self.head = head if isinstance(head, Text) else Text(str(head))
        self.tail = " ".join(tail.split())
        self.style = style

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        room = options.max_width - self.head.cell_len
        line = self.head.copy()
        if room >= 2 and self.tail:
            tail = self.tail if len(self.tail) <= room else self.tail[:room - 1].rstrip() + "…"
            line.append(tail, style=self.style)
        yield line

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        return Measurement(self.head.cell_len, min(self.head.cell_len + len(self.tail), options.max_width))
