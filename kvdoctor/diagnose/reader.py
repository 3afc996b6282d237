"""Stream a log once, line by line, and keep only what diagnosis needs.

The file is never read whole: lines come from a buffered binary stream with a
per-line cap (`MAX_LINE`; the rest of a longer line is skipped), are decoded
with replacement (any bytes are accepted), cleaned, and fed to the version /
args finders and the traceback assembler. Memory is bounded by the number of
tracebacks kept and their frame cap, not by the log's size.
"""

from __future__ import annotations

import io
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from kvdoctor.diagnose import serveline
from kvdoctor.diagnose.evidence import LooseCollector, LooseEvidence
from kvdoctor.diagnose.features import Named, features_in, header_version
from kvdoctor.diagnose.logline import clean
from kvdoctor.diagnose.traceback import LogTraceback, TracebackAssembler, crash_rank
from kvdoctor.errors import UsageError

MAX_LINE = 64 * 1024
CHUNK = 4 << 20
# A line that can start what diagnosis reads contains one of these: a traceback's header or a frame (a
# paste may lack the header), the fatal-error markers, the version and args lines, and what a fragment
# holds (an assert, `x.py, in f` / `f() at x.py:9`, an exception line, a crash dump, prose quoting code), and
# native crashes (torch's segfault banner, faulthandler's `Fatal Python error` and thread headers, `*** SIGSEGV`).
# Each is searched for over a whole chunk (C-level `bytes.find`; a regex over the chunk costs 3x the
# whole read), so the bulk of a log (request lines) is never split into lines in Python. While a
# traceback or a multi-line assert is open, every line is looked at.
_MARKERS = (b"Traceback", b'File "', b"EngineCore encountered", b"Process EngineCore", b"version", b"args",
            b"serve", b"vllm", b"LLM engine (v", b"assert", b" in ", b" at ", b"Error", b"Exception", b"Dumping ",
            b"`", b"()", b"Segfault", b"Fatal Python error", b"SIG", b"call first",
            # a header's or collect_env's version, and the features a log names (`features`)
            b"Version", b"async", b"peculative", b"mtp", b"MTP", b"eagle", b"Connector", b"kv_role", b"Tiering",
            b"tiers", b"amba", b"sliding", b"ybrid", b"sleep", b"wake_up", b" node")


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
    fatal_line: int | None = None  # where the engine said it hit a fatal error (its traceback may be cut)
    loose: LooseEvidence | None = None  # frames, statements and exception lines outside whole tracebacks
    read_note: str = ""  # how the log was read, when not whole (a compressed log cut short)
    features: dict[str, Named] = field(default_factory=dict)  # what the text names: async scheduling, MTP...

    @property
    def holds_crash(self) -> bool:
        """Anything that says the engine crashed: a traceback (not one logged as a WARNING, which the
        process survived), the fatal-error line, the API server's re-raise, vLLM's crash dump, or a pasted
        vLLM frame, statement or exception line."""
        loose = self.loose
        loose_crash = loose is not None and (
            loose.dump_line is not None or loose.statements or loose.exceptions
            or any("/" in f.file or f.in_vllm for f in loose.frames))
        return bool((self.crash is not None and not self.crash.survived) or self.fatal_line is not None
                    or self.reraise_seen or loose_crash)

    @property
    def crash_found(self) -> bool:
        return self.crash is not None


def _pick_crash(tracebacks: list[LogTraceback]) -> LogTraceback | None:
    """The engine's own traceback: complete before cut short, engine process before others,
    never the API server's EngineDeadError re-raise unless nothing else is there; first wins."""
    candidates = [tb for tb in tracebacks if tb.frames or tb.exception]
    if not candidates:
        return None
    best = min(candidates, key=lambda tb: (crash_rank(tb), tb.start_line))
    if best.is_reraise:  # only the API server's EngineDeadError: the engine's traceback is not here
        return None
    return best


def _chunks(stream: IO[bytes]) -> Iterator[bytes]:
    """Whole lines, a few MiB at a time; a line longer than MAX_LINE is cut there (the rest skipped)."""
    carry = b""
    skipping = False
    while True:
        data = stream.read(CHUNK)
        if not data:
            if carry and not skipping:
                yield carry + b"\n"
            return
        if skipping:
            newline = data.find(b"\n")
            if newline < 0:
                continue
            data, skipping = data[newline + 1:], False
        buffer = carry + data
        cut = buffer.rfind(b"\n")
        if cut >= 0:
            yield buffer[: cut + 1]
            carry = buffer[cut + 1:]
        else:
            carry = buffer
        if len(carry) > MAX_LINE:
            yield carry[:MAX_LINE] + b"\n"
            carry, skipping = b"", True


def _interesting_starts(chunk: bytes) -> list[int]:
    starts: set[int] = set()
    for marker in _MARKERS:
        at = chunk.find(marker)
        while at >= 0:
            starts.add(chunk.rfind(b"\n", 0, at + (1 if marker[:1] == b"\n" else 0)) + 1)
            line_end = chunk.find(b"\n", at + 1)
            if line_end < 0:
                break
            at = chunk.find(marker, line_end + (0 if marker[:1] == b"\n" else 1))
    if chunk[:1] in (b" ", b"\t"):
        starts.add(0)
    return sorted(starts)


def read_stream(stream: IO[bytes], source: str) -> LogSummary:
    summary = LogSummary(source=source)
    assembler = TracebackAssembler()
    collector = LooseCollector()
    found: dict[str, Any] = {"image_version": None, "command_args": None, "header_version": None}

    def look_at(raw: bytes, number: int) -> None:
        text = raw[:MAX_LINE].decode("utf-8", errors="replace")
        if "\x00" in text:
            text = text.replace("\x00", "")
        line = clean(text)
        body = line.body
        if summary.version is None and ("version" in body or "LLM engine (v" in body):
            summary.version = serveline.banner_version(body)
            if summary.version:
                summary.version_source = "banner"
        if found["header_version"] is None and ("version" in body or "Version" in body):
            found["header_version"] = header_version(body)
        features_in(body, number, summary.features)
        if found["image_version"] is None and "vllm-openai:" in body:
            found["image_version"] = serveline.image_version(body)
        if summary.args_source != "non-default args" and "non-default args" in body:
            args = serveline.non_default_args(body)
            if args is not None:
                summary.serve_args, summary.args_source = args, "non-default args"
        if found["command_args"] is None and ("serve" in body or "api_server" in body):
            found["command_args"] = serveline.command_line_args(body)
        if not assembler.feed(line, number):
            collector.feed(line, number)

    number = 0  # lines before the current chunk
    for chunk in _chunks(stream):
        starts = _interesting_starts(chunk)
        index, position, counted, lines_before = 0, 0, 0, number
        size = len(chunk)
        while position < size:
            if not assembler.open and not collector.waiting:
                while index < len(starts) and starts[index] < position:
                    index += 1
                if index == len(starts):
                    break
                position = starts[index]
            end = chunk.find(b"\n", position)
            end = size if end < 0 else end
            lines_before += chunk.count(b"\n", counted, position)
            counted = position
            look_at(chunk[position:end], lines_before + 1)
            position = end + 1
        number += chunk.count(b"\n")
    image_version, command_args = found["image_version"], found["command_args"]
    summary.lines = number
    summary.tracebacks = assembler.close()
    summary.loose = collector.close()
    summary.tracebacks_dropped = assembler.dropped
    summary.fatal_line = assembler.fatal_line
    if summary.version is None and found["header_version"] is not None:
        summary.version, summary.version_source = found["header_version"], "header line"
    if summary.version is None and image_version is not None:
        summary.version, summary.version_source = image_version, "image tag"
    if summary.args_source is None and command_args:
        summary.serve_args, summary.args_source = command_args, "command line"
    summary.reraise_seen = any(tb.is_reraise for tb in summary.tracebacks)
    summary.crash = _pick_crash(summary.tracebacks)
    return summary


def _is_file(text: str) -> bool:
    try:
        return Path(text).exists()
    except (OSError, ValueError):  # a name too long, or a NUL: text, not a path
        return False


# One pasted line that is log text, not a file name: an exception line (`TimeoutError: Timed out ...`), a
# frame, an assert, a traceback's or a crash banner's words, a vLLM log line's prefix, a version line.
_ONE_LINE_TEXT = re.compile(r"^\s*(?:[\w.]*(?:Error|Exception|Failure|Interrupt)\b\s*(?::|\(|$)|assert\s|Traceback\b|"
                            r"File \"|.*\bline \d+, in \w|.*EngineCore encountered|.*Segfault|.*Fatal Python error|"
                            r"\([A-Za-z_][\w .\-]{0,80} pid=\d+\)|(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d |"
                            r".*\bvLLM (?:API server )?[Vv]ersion|.*LLM engine \(v)")


def looks_like_log_text(text: str) -> bool:
    """A one-line argument that is a pasted log line rather than a path (`--help` offers pasted text)."""
    return bool(_ONE_LINE_TEXT.match(text)) and not text.strip().endswith((".log", ".txt", ".gz", ".xz", ".zst"))


# Compressed logs by their magic bytes: gzip, xz, bzip2 (stdlib), zstd (the `zstandard` module, when installed).
_MAGIC = ((b"\x1f\x8b", "gzip"), (b"\xfd7zXZ\x00", "xz"), (b"BZh", "bzip2"), (b"\x28\xb5\x2f\xfd", "zstd"))
SNIFF = 8192  # bytes looked at to tell text from binary
BINARY_SHARE = 0.3  # above this share of undecodable or control characters, the head is not text


def _decompressed(stream: IO[bytes], kind: str, name: str) -> IO[bytes]:
    if kind == "gzip":
        import gzip

        return gzip.GzipFile(fileobj=stream, mode="rb")  # type: ignore[return-value]  # a binary IO in all but name
    if kind == "xz":
        import lzma

        return lzma.LZMAFile(stream)
    if kind == "bzip2":
        import bz2

        return bz2.BZ2File(stream)
    try:
        import zstandard  # type: ignore[import-not-found]
    except ImportError:
        raise UsageError(f"{name}: a zstd-compressed log, and the `zstandard` module is not installed: decompress "
                         f"it first (zstd -d) or pipe it in (zstd -dc {name} | kvdoctor diagnose -)") from None
    return zstandard.ZstdDecompressor().stream_reader(stream)


def _is_binary(head: bytes) -> bool:
    """Not a text log: a large share of the head is undecodable or control characters (a few stray bytes in
    a log are read past; `read_stream` accepts any bytes)."""
    if not head:
        return False
    text = head.decode("utf-8", errors="replace")
    bad = sum(1 for ch in text if ch == "\ufffd" or (ch < " " and ch not in "\t\n\r\x1b\x0c\x08") or ch == "\x7f")
    return bad > BINARY_SHARE * len(text)


def open_log_stream(stream: IO[bytes], name: str) -> IO[bytes]:
    """The log's text bytes: decompressed when compressed; a file that is not text is a usage error (one line)."""
    buffered = stream if isinstance(stream, io.BufferedReader) else io.BufferedReader(stream)  # type: ignore[type-var]  # reads any binary stream
    head = buffered.peek(SNIFF)[:SNIFF]
    kind = next((k for magic, k in _MAGIC if head.startswith(magic)), None)
    text_stream: IO[bytes] = buffered
    if kind is not None:  # (marked, so that `_read_checked` reads it up to a break)
        text_stream = _decompressed(buffered, kind, name)
        if not hasattr(text_stream, "peek"):
            text_stream = io.BufferedReader(text_stream)  # type: ignore[type-var]  # reads any binary stream
        try:
            head = text_stream.peek(SNIFF)[:SNIFF]
        except (OSError, EOFError, ValueError) as exc:
            raise UsageError(f"{name}: a {kind}-compressed file that cannot be decompressed: {exc}") from None
    if kind is not None:
        text_stream.decompressed = True  # type: ignore[attr-defined]
    if _is_binary(head):
        what = f"its {kind} content is" if kind else "it is"
        raise UsageError(f"{name}: not a text log ({what} binary data); give the vLLM log as text, or gzip, xz, "
                         f"bzip2 or zstd compressed")
    return text_stream


class _UpToCut:
    """A decompressing stream read up to where it breaks: a compressed log cut short still holds its head."""

    def __init__(self, stream: IO[bytes]) -> None:
        self.stream = stream
        self.cut = ""
        self._read1 = getattr(stream, "read1", stream.read)  # one decompressor read: nothing held back on a break

    def read(self, size: int = -1) -> bytes:
        if self.cut:
            return b""
        pieces: list[bytes] = []
        wanted = size if size >= 0 else 1 << 62
        while wanted > 0:  # small reads: what was decompressed before the break is kept
            try:
                piece = self._read1(min(wanted, 64 << 10))
            except (EOFError, ValueError, OSError) as exc:  # zlib.error, lzma.LZMAError: OSError/ValueError kin
                self.cut = str(exc) or type(exc).__name__
                break
            if not piece:
                break
            pieces.append(piece)
            wanted -= len(piece)
        return b"".join(pieces)


def _read_checked(stream: IO[bytes], name: str, source: str) -> LogSummary:
    text_stream = open_log_stream(stream, name)
    if not getattr(text_stream, "decompressed", False):
        return read_stream(text_stream, source)
    reader = _UpToCut(text_stream)
    summary = read_stream(reader, source)  # type: ignore[arg-type]
    if reader.cut:
        summary.read_note = f"the compressed log ends early ({reader.cut}): read up to there"
    return summary


def read_log(path_text: str, stdin: IO[bytes] | None = None) -> LogSummary:
    """`-` reads stdin; text that is not a file is a pasted log when it has several lines or its one line is
    log text (`looks_like_log_text`); anything else is a file path (a bad one is a usage error, one line).
    A compressed file or stdin is decompressed as it is read; one that is not text is refused (`open_log_stream`)."""
    if path_text == "-":
        stream = stdin if stdin is not None else sys.stdin.buffer
        return _read_checked(stream, "stdin", "-")
    if not _is_file(path_text) and ("\n" in path_text.strip("\r\n") or looks_like_log_text(path_text)):
        return read_stream(io.BytesIO(path_text.encode("utf-8", errors="replace")), "pasted text")
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
            return _read_checked(handle, path_text, path.name)
        except IsADirectoryError:
            raise UsageError(f"{path_text}: is a directory, not a log file") from None
        except OSError as exc:
            raise UsageError(f"{path_text}: cannot read: {exc.strerror}") from None
