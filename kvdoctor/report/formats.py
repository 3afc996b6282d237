"""One formatter per output format (`--format text|json|markdown|svg`). Formatting only.

A command hands its result over as a `Shown`: the same result drawn three
ways (rich renderables, a JSON document, Markdown). Each formatter turns a
`Shown` into the text of its format; writing it anywhere is the CLI's job
(`kvdoctor.cli.output`), so every command reaches stdout the same way.
Cheap to import: rich is imported when a formatter renders.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvdoctor.report.json_doc import dumps

FORMATS = ("text", "json", "markdown", "svg")


@dataclass(frozen=True)
class Shown:
    """What a command shows, in every format. `markdown` None: the text output in a code block."""

    renderables: Callable[[], list[Any]]
    document: Callable[[], dict[str, Any]]
    markdown: Callable[[], str] | None = None


def _recorded(renderables: list[Any], width: int | None) -> Any:
    """A console that drew the renderables off-screen, at the terminal's (or $COLUMNS') width."""
    import io

    from rich.console import Console

    console = Console(record=True, file=io.StringIO(), highlight=False, soft_wrap=False, width=width)
    for item in renderables:
        console.print(item)
    return console


class TextFormatter:
    """The rich tables as plain text, without the padding rich adds to the right of each line."""

    name = "text"

    def render(self, shown: Shown, width: int | None = None) -> str:
        console = _recorded(shown.renderables(), width)
        return "\n".join(line.rstrip() for line in console.export_text(clear=False).splitlines()) + "\n"


class JsonFormatter:
    """One JSON document (stable keys, `schema_version`)."""

    name = "json"

    def render(self, shown: Shown, width: int | None = None) -> str:
        return dumps(shown.document()) + "\n"


class MarkdownFormatter:
    """The Markdown a bug report takes (what `--report` writes)."""

    name = "markdown"

    def render(self, shown: Shown, width: int | None = None) -> str:
        if shown.markdown is not None:
            text = shown.markdown()
            return text if text.endswith("\n") else text + "\n"
        return "```\n" + TextFormatter().render(shown, width) + "```\n"


class SvgFormatter:
    """The rich tables drawn as an SVG image (what `--svg` saves)."""

    name = "svg"

    def render(self, shown: Shown, width: int | None = None) -> str:
        return _recorded(shown.renderables(), width).export_svg(title="kvdoctor")


_FORMATTERS = {f.name: f for f in (TextFormatter, JsonFormatter, MarkdownFormatter, SvgFormatter)}


def formatter(name: str) -> Any:
    """The formatter of `--format NAME` (one of FORMATS)."""
    return _FORMATTERS[name]()
