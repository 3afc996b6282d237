"""kvdoctor's one way to write to stdout: a closed pipe is the reader's choice, not a failure.

`kvdoctor repro --list | head -1` closes stdout early. Python would raise
`BrokenPipeError` (and typer turns it into exit 1, "reproduced"); here the
write stops quietly, stdout is pointed at /dev/null so nothing later (the
interpreter's final flush included) raises again, and the command keeps the
exit code it earned.

It also remembers whether a JSON document already went out, so an error after
the verdict (an unwritable `--report`) never adds a second document.
"""

from __future__ import annotations

import os
import sys

_closed = False
_document_written = False


def begin_command() -> None:
    """Forget the previous command's stdout state (an in-process runner invokes many in one process)."""
    global _closed, _document_written
    _closed = False
    _document_written = False


def write_stdout(text: str) -> None:
    """Write `text` (a newline is not added) to stdout and flush it."""
    global _closed
    if _closed:
        return
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        silence_stdout()


def write_document(text: str) -> None:
    """Write one JSON document (and its newline) on stdout."""
    global _document_written
    _document_written = True
    write_stdout(text + "\n")


def document_written() -> bool:
    return _document_written


def stdout_closed() -> bool:
    return _closed


def silence_stdout() -> None:
    """The reader went away: send the rest of stdout to /dev/null (the usual BrokenPipeError pattern)."""
    global _closed
    _closed = True
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # stdout is not a real file (an in-process runner): drop writes only
        pass
