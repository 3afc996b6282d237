"""The one emit path: every command's result reaches stdout and its output files through here.

- `show`: a command's result in the `--format` asked for (a formatter of
  `kvdoctor.report.formats` each), optionally saved as SVG too.
- `emit_document` / `emit`: a JSON document / rich renderables as text, for output
  that has one form only.
- `write_output`: an output file (--report, --svg, --write-recipe, ...).

A file that cannot be written after the run is returned as a one-line failure, not
raised: the command prints everything else first, then `failures.raise_unwritten`
makes it exit 2 (an unwritable output path is a usage error). stdout itself goes
through `streams.write_stdout`, so a closed pipe never changes the exit code.
Cheap to import; rich is imported when something is shown.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def console(record: bool = False) -> Any:
    """stdout as the command's `streams.Environment` has it: the terminal's width, or $COLUMNS (else 80)
    when piped; tables that do not fit stack."""
    from rich.console import Console

    from kvdoctor.cli.streams import current

    environment = current()
    return Console(record=record, highlight=False, soft_wrap=False, file=environment.stdout_stream,
                   force_terminal=environment.isatty("stdout"), width=environment.width())


def emit_document(document: dict[str, Any]) -> None:
    """One JSON document on stdout."""
    from kvdoctor.cli.streams import write_document
    from kvdoctor.report.json_doc import dumps

    write_document(dumps(document))


def show(shown: Any, output_format: str = "text", svg: Path | None = None) -> list[str]:
    """Write a command's result (a `report.formats.Shown`) on stdout in `--format`'s format, and the
    `--svg` file; returns what could not be written. Text on a terminal keeps rich's colours."""
    from kvdoctor.cli.streams import current, write_document, write_stdout
    from kvdoctor.report.formats import SvgFormatter, formatter

    width = current().width()
    if output_format == "text":
        shown_on = console()
        if shown_on.is_terminal:
            for item in shown.renderables():
                shown_on.print(item)
            width = shown_on.width
        else:
            write_stdout(formatter("text").render(shown, width))
    elif output_format == "json":
        write_document(formatter("json").render(shown).rstrip("\n"))
    else:
        write_stdout(formatter(output_format).render(shown, width))
    if svg is None:
        return []
    return write_output(svg, SvgFormatter().render(shown, width), "--svg", "SVG")


def emit(renderables: list[Any], svg: Path | None = None) -> list[str]:
    """Show rich renderables as text on stdout (and save them as SVG); returns what could not be written."""
    from kvdoctor.report.formats import Shown

    return show(Shown(renderables=lambda: renderables, document=dict), "text", svg)


def write_output(path: Path, text: str, flag: str, what: str | None = None, whole: bool = False) -> list[str]:
    """Write an output file; returns `["FLAG PATH: why"]` when it cannot be written.

    `whole`: write a scratch file beside it and rename it over PATH, so a reader never sees a
    half-written file. Only for a regular file (or a new one): renaming over /dev/full or a
    FIFO would replace the device, not write to it."""
    try:
        if whole and (not path.exists() or path.is_file()):
            scratch = path.with_name(f".{path.name}.{os.getpid()}.partial")
            try:
                scratch.write_text(text)
                scratch.replace(path)
            finally:
                scratch.unlink(missing_ok=True)
        else:
            path.write_text(text)
    except OSError as exc:
        return [f"{flag} {path}: {exc.strerror or exc}"]
    if what is not None:
        from kvdoctor.cli.streams import note

        note(f"{what} written to {path}")
    return []


def note_untested_level(result: Any, engine: str) -> None:
    """One line on stderr when a run's result is not_applicable only because its engine level cannot
    play the recipe (exit 6): the verdict says why in full; this says what to do."""
    if not getattr(result, "unplayable", False):
        return
    import re

    from kvdoctor.cli.streams import note

    steps = list(dict.fromkeys(re.findall(r"`([a-z_]+)`", result.detail or "")))
    what = f"its {', '.join(steps)} step(s)" if steps else "its setup"
    other = "core (vLLM's EngineCore)" if engine == "scheduler" else "scheduler, the default"
    note(f"kvdoctor: not tested: --engine {engine} cannot play {what}; the bug may still be in this vLLM "
         f"(run it at --engine {other})")


def show_result(command: str, result: Any, output_format: str, document: Any, renderables: Any,
                svg: Path | None, report: Path | None) -> None:
    """A run's result (repro, inspect, audit) on stdout in `--format`'s format (and as SVG), then its
    Markdown attachment (`--report`).

    An output file that cannot be written after the run (a full disk) is named on stderr and
    the command exits 2: the verdict is printed, but what was asked for is not all there."""
    from kvdoctor.cli.failures import raise_unwritten
    from kvdoctor.report.formats import Shown
    from kvdoctor.report.markdown import render_markdown

    markdown: list[str] = []  # rendered once: `--format markdown` and `--report` are one document

    def attachment() -> str:
        if not markdown:
            markdown.append(render_markdown(command, result))
        return markdown[0]

    shown = Shown(renderables=lambda: renderables(result), document=lambda: document(result),
                  markdown=attachment)
    unwritten = show(shown, output_format, svg)
    if report is not None:
        unwritten += write_output(report, attachment(), "--report", "report")
    raise_unwritten(unwritten)
