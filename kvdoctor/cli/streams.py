"""What the CLI reads of the world (`Environment`), and its one way to write to stdout.

`Environment` (httpie's idea): stdin/stdout/stderr, whether each is a terminal, the
terminal's columns, the environment variables, the command line and `--debug`. The CLI
asks `current()` for these instead of reading `sys.*`/`os.environ` itself, so a test can
run a command in-process with its own streams, a fake terminal and its own variables
(`use(Environment(...))`) and a real process sees the real ones (the default reads
`sys.*` and `os.environ` when asked, never at import).

stdout: `kvdoctor repro --list | head -1` closes stdout early. Python would raise
`BrokenPipeError` (and typer turns it into exit 1, "reproduced"); here the
write stops quietly, stdout is pointed at /dev/null so nothing later (the
interpreter's final flush included) raises again, and the command keeps the
exit code it earned. stdout that cannot take the output (`> /dev/full`) is no closed
pipe: the output asked for is not there, exit 2 with one line ("stdout: No space left on
device", `settle_stdout`, when the command ends), never kvdoctor's own failure.

stderr: `kvdoctor ... 2>&1 | true` (or `2>&-`) closes stderr too. A one-line error
that cannot be shown must not change the code it reports (a usage error's 2 became
0 or 1): `note` drops what cannot be written, and `guard_process_streams` (the real
process only) makes the process's stderr quiet once its reader is gone, so every other
writer (rich's consoles, `print(..., file=sys.stderr)`, a traceback) keeps the code too.

It also remembers (on the command's Environment) whether a JSON document already
went out, so an error after the verdict (an unwritable `--report`) never adds a
second document.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import IO, Any

DEFAULT_WIDTH = 80  # rich's own, where no terminal says otherwise
MIN_WIDTH = 20  # below this no table or wrapped sentence is readable: a nonsense width, not a request


@dataclass
class Environment:
    """The streams, terminal, variables and command line a command runs with. None: the process's own
    (`sys.stdin/stdout/stderr`, the stream's `isatty()`, $COLUMNS, `os.environ`, `sys.argv`), read when
    asked."""

    stdin: IO[Any] | None = None
    stdout: IO[Any] | None = None
    stderr: IO[Any] | None = None
    stdin_isatty: bool | None = None
    stdout_isatty: bool | None = None
    stderr_isatty: bool | None = None
    columns: int | None = None
    env: Mapping[str, str] | None = None
    argv: list[str] | None = None
    debug: bool = field(default=False)  # --debug (KVDOCTOR_DEBUG=1 is read from `env`)
    stdout_closed: bool = field(default=False)  # the reader went away: later writes are dropped
    document_written: bool = field(default=False)  # a JSON document went out: never a second one
    stdout_failure: str | None = field(default=None)  # "stdout: No space left on device", not yet named

    @property
    def stdin_stream(self) -> IO[Any]:
        return self.stdin if self.stdin is not None else sys.stdin

    @property
    def stdout_stream(self) -> IO[Any]:
        return self.stdout if self.stdout is not None else sys.stdout

    @property
    def stderr_stream(self) -> IO[Any]:
        return self.stderr if self.stderr is not None else sys.stderr

    @property
    def arguments(self) -> list[str]:
        """The command line after the program's name."""
        return list((self.argv if self.argv is not None else sys.argv)[1:])

    def getenv(self, name: str, default: str | None = None) -> str | None:
        return (self.env if self.env is not None else os.environ).get(name, default)

    def isatty(self, which: str) -> bool:
        """Whether "stdin", "stdout" or "stderr" is a terminal."""
        given = getattr(self, f"{which}_isatty")
        if given is not None:
            return given
        try:
            return bool(getattr(self, f"{which}_stream").isatty())
        except (AttributeError, ValueError, OSError):
            return False

    def width(self) -> int | None:
        """The columns given, else $COLUMNS; None: let the terminal (or rich's 80) decide. A nonsense
        width (`COLUMNS=0`, negative, not a number, under MIN_WIDTH) is DEFAULT_WIDTH: rich took
        `COLUMNS=0` at its word and every line of text was lost."""
        if self.columns is not None:
            return self.columns if self.columns >= MIN_WIDTH else DEFAULT_WIDTH
        columns = (self.getenv("COLUMNS", "") or "").strip()
        if not columns:
            return None
        return int(columns) if columns.isdigit() and int(columns) >= MIN_WIDTH else DEFAULT_WIDTH


_current = Environment()


def current() -> Environment:
    """The environment the running command reads."""
    return _current


@contextlib.contextmanager
def use(environment: Environment) -> Iterator[Environment]:
    """Run the commands inside with `environment` (an in-process runner); the previous one after."""
    global _current
    before = _current
    _current = environment
    try:
        yield environment
    finally:
        _current = before


def note(text: str) -> None:
    """One line on stderr (a note, a file written); nothing, and no error, when stderr is gone."""
    stream = current().stderr_stream
    try:
        stream.write(text + "\n")
        stream.flush()
    except (OSError, ValueError):  # closed (a pipe's reader gone, `2>&-`): the exit code says the rest
        pass


CLEAR_LINE = "\r\x1b[2K"  # back to column 0, erase the line


class QuietWhenClosed:
    """A process stream that stops writing, without raising, once the far end is gone; and where a
    progress line is drawn on it, clears that line before anything else is written.

    The first write or flush that fails (EPIPE, a closed descriptor) points the descriptor at
    /dev/null and every later write is dropped; everything else (fileno, isatty, encoding) is the
    stream's own. For stderr: nothing kvdoctor says there may change the exit code."""

    def __init__(self, stream: IO[Any]) -> None:
        self._stream = stream
        self.closed_by_reader = False
        self.status_shown = False  # a progress line is drawn (cli.progress), with no newline after it

    def write(self, text: str) -> int:
        if text and self.status_shown:  # anyone else's line (a note, vLLM's, the serve child's PID) starts
            self.status_shown = False    # at column 0 of a cleared line, not after the progress text
            self._write(CLEAR_LINE)
        return self._write(text)

    def show_status(self, text: str) -> None:
        """Draw a progress line in place (the next other write clears it first)."""
        self._write(CLEAR_LINE + text)
        self.flush()
        self.status_shown = True

    def _write(self, text: str) -> int:
        if not self.closed_by_reader:
            try:
                return self._stream.write(text)
            except (OSError, ValueError):
                self._go_quiet()
        return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if not self.closed_by_reader:
            try:
                self._stream.flush()
            except (OSError, ValueError):
                self._go_quiet()

    def _go_quiet(self) -> None:
        self.closed_by_reader = True
        _point_at_devnull(self._stream)
        with contextlib.suppress(OSError, ValueError):
            self._stream.flush()  # what was buffered goes to /dev/null, not to the interpreter's exit

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def guard_process_streams() -> None:
    """The real `kvdoctor` process: stderr quiet once closed, and a stream closed at start (`>&-`,
    `2>&-`: Python's None) replaced by /dev/null, so no write raises where it was not expected."""
    # the process's own streams, open for its lifetime: no context manager closes them
    if sys.stdout is None:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - the process's stdout, for its lifetime
    if sys.stderr is None:
        sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - the process's stderr, for its lifetime
    if not isinstance(sys.stderr, QuietWhenClosed):
        sys.stderr = QuietWhenClosed(sys.stderr)


def _point_at_devnull(stream: Any) -> None:
    try:
        target = stream.fileno()
    except (OSError, ValueError, AttributeError):  # not a real file (an in-process runner)
        return
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, target)
        os.close(devnull)
    except OSError:
        pass


def begin_command() -> None:
    """Forget a previous command's stdout state (one process may run several on one Environment)."""
    environment = current()
    environment.stdout_closed = False
    environment.document_written = False
    environment.stdout_failure = None


def write_stdout(text: str) -> None:
    """Write `text` (a newline is not added) to stdout and flush it."""
    if current().stdout_closed:
        return
    stream = current().stdout_stream
    try:
        stream.write(text)
        stream.flush()
    except BrokenPipeError:
        silence_stdout()
    except OSError as exc:  # `> /dev/full`, an I/O error: named once the command ends (`settle_stdout`)
        silence_stdout()
        current().stdout_failure = f"stdout: {exc.strerror or exc}"


RESULT_CODES = (0, 1, 4, 6, 7)  # what a run found; an error's own code (2, 3, 5, 130) says more


def settle_stdout(code: int) -> int:
    """The exit code once stdout's fate is known: a write that failed for want of room (not a reader
    gone) is named on one line, once, and a result's code becomes 2 (the output asked for is not there);
    an error's own code stays."""
    environment = current()
    if environment.stdout_failure is None:
        return code
    note(f"kvdoctor: error: {environment.stdout_failure}")
    environment.stdout_failure = None
    return 2 if code in RESULT_CODES else code


def write_document(text: str) -> None:
    """Write one JSON document (and its newline) on stdout."""
    current().document_written = True
    write_stdout(text + "\n")


def document_written() -> bool:
    return current().document_written


def stdout_closed() -> bool:
    return current().stdout_closed


def silence_stdout() -> None:
    """The reader went away: send the rest of stdout to /dev/null (the usual BrokenPipeError pattern)."""
    current().stdout_closed = True
    _point_at_devnull(current().stdout_stream)  # an in-process runner's stdout: writes are dropped only
