"""The one emit path: every command's result reaches stdout and its output files through here.

- `emit_document`: one JSON document on stdout.
- `emit`: rich renderables on stdout (right-trimmed when piped), optionally saved as SVG.
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

import typer


def console(record: bool = False) -> Any:
    """The terminal's width, or $COLUMNS (else 80) when piped; tables that do not fit stack."""
    from rich.console import Console

    return Console(record=record, highlight=False, soft_wrap=False)


def emit_document(document: dict[str, Any]) -> None:
    """One JSON document on stdout."""
    from kvdoctor.cli.streams import write_document
    from kvdoctor.report.json_doc import dumps

    write_document(dumps(document))


def emit(renderables: list[Any], svg: Path | None = None) -> list[str]:
    """Show the renderables on stdout (and save them as SVG); returns what could not be written."""
    from kvdoctor.cli.streams import write_stdout

    shown = console(record=svg is not None)
    if shown.is_terminal:
        for item in renderables:
            shown.print(item)
    else:  # piped: the same text without the padding rich adds to the right of each line
        import io

        from rich.console import Console

        shown = Console(record=True, file=io.StringIO(), highlight=False, soft_wrap=False)
        for item in renderables:
            shown.print(item)
        text = "\n".join(line.rstrip() for line in shown.export_text(clear=False).splitlines())
        write_stdout(text + "\n")
    if svg is not None:
        try:
            shown.save_svg(str(svg), title="kvdoctor")
        except OSError as exc:  # checked before the run; the verdict is out, the file is not: exit 2
            return [f"--svg {svg}: {exc.strerror or exc}"]
        typer.echo(f"SVG written to {svg}", err=True)
    return []


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
        typer.echo(f"{what} written to {path}", err=True)
    return []
