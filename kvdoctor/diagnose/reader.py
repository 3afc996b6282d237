"""Stream a log once, line by line, and keep only what diagnosis needs.

The file is never read whole: lines come from a buffered binary stream with a
per-line cap (`MAX_LINE`; the rest of a longer line is skipped), are decoded
with replacement (any bytes are accepted), cleaned, and fed to the version /
args finders and the traceback assembler. Memory is bounded by the number of
tracebacks kept and their frame cap, not by the log's size.
"""

from __future__ import annotations

import io
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from kvdoctor.diagnose import serveline
from kvdoctor.diagnose.logline import clean
from kvdoctor.diagnose.traceback import LogTraceback, TracebackAssembler
from kvdoctor.errors import UsageError

MAX_LINE = 64 * 1024
_CHEAP_MARKERS = ("Traceback", "File ", "Error", "Exception", "version", "args", "serve", "vllm",
                  "EngineCore", "...", "Dead")


@dataclass
class LogSummary:
    source: str  # how the log is named to the user ("-" for stdin; a file name, never its directory)
    lines: int = 0
    version: str | None = None
    version_source: str | None = None  # "banner" | "image tag"
    serve_args: dict[str, Any] = field(default_factory=dict)
    args_source: str | None = None  # "non-default args" | "command line"
    tracebacks: list[LogTraceback] = field(default_factory=list)
    tracebacks_dropped: int = 0
    crash: LogTraceback | None = None
    reraise_seen: bool = False  # an EngineDeadError re-raised in the API server

    @property
    def crash_found(self) -> bool:
        return self.crash is not None


def _pick_crash(tracebacks: list[LogTraceback]) -> LogTraceback | None:
    """The engine's own traceback: complete before cut short, engine process before others,
    never the API server's EngineDeadError re-raise unless nothing else is there; first wins."""
    def rank(tb: LogTraceback) -> tuple[int, int, int, int]:
        engine = tb.process is not None and tb.process.startswith("EngineCore")
        return (1 if tb.is_reraise else 0, 1 if tb.cut_short else 0,
                0 if (engine or tb.after_fatal_marker) else 1, 0 if tb.vllm_frames else 1)

    candidates = [tb for tb in tracebacks if tb.frames or tb.exception]
    if not candidates:
        return None
    best = min(candidates, key=lambda tb: (rank(tb), tb.start_line))
    if best.is_reraise:  # only the API server's EngineDeadError: the engine's traceback is not here
        return None
    return best


def read_stream(stream: IO[bytes], source: str) -> LogSummary:
    summary = LogSummary(source=source)
    assembler = TracebackAssembler()
    image_version: str | None = None
    command_args: dict[str, Any] | None = None
    number = 0
    while True:
        raw = stream.readline(MAX_LINE)
        if not raw:
            break
        number += 1
        if len(raw) == MAX_LINE and not raw.endswith(b"\n"):
            while True:  # skip the rest of an over-long line without holding it
                rest = stream.readline(MAX_LINE)
                if not rest or rest.endswith(b"\n"):
                    break
        text = raw.decode("utf-8", errors="replace")
        if "\x00" in text:
            text = text.replace("\x00", "")
        if not any(marker in text for marker in _CHEAP_MARKERS) and not text.startswith((" ", "\t")) \
                and not assembler.open:
            continue  # the bulk of a log (request lines) costs one scan
        line = clean(text)
        body = line.body
        if summary.version is None and "version" in body:
            summary.version = serveline.banner_version(body)
            if summary.version:
                summary.version_source = "banner"
        if image_version is None and "vllm-openai:" in body:
            image_version = serveline.image_version(body)
        if summary.args_source != "non-default args" and "non-default args" in body:
            args = serveline.non_default_args(body)
            if args is not None:
                summary.serve_args, summary.args_source = args, "non-default args"
        if command_args is None and "serve" in body or command_args is None and "api_server" in body:
            command_args = serveline.command_line_args(body)
        assembler.feed(line, number)
    summary.lines = number
    summary.tracebacks = assembler.close()
    summary.tracebacks_dropped = assembler.dropped
    if summary.version is None and image_version is not None:
        summary.version, summary.version_source = image_version, "image tag"
    if summary.args_source is None and command_args:
        summary.serve_args, summary.args_source = command_args, "command line"
    summary.reraise_seen = any(tb.is_reraise for tb in summary.tracebacks)
    summary.crash = _pick_crash(summary.tracebacks)
    return summary


def read_log(path_text: str, stdin: IO[bytes] | None = None) -> LogSummary:
    """`-` reads stdin; anything else is a file path (a bad one is a usage error, one line)."""
    if path_text == "-":
        stream = stdin if stdin is not None else sys.stdin.buffer
        return read_stream(stream, "-")
    path = Path(path_text)
    try:
        handle = path.open("rb")
    except FileNotFoundError:
        raise UsageError(f"{path_text}: no such file") from None
    except IsADirectoryError:
        raise UsageError(f"{path_text}: is a directory, not a log file") from None
    except OSError as exc:
        raise UsageError(f"{path_text}: cannot read: {exc.strerror}") from None
    with handle:
        try:
            return read_stream(io.BufferedReader(handle) if not isinstance(handle, io.BufferedReader)
                               else handle, path.name)
        except IsADirectoryError:
            raise UsageError(f"{path_text}: is a directory, not a log file") from None
        except OSError as exc:
            raise UsageError(f"{path_text}: cannot read: {exc.strerror}") from None
