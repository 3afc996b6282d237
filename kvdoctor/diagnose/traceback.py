"""Tracebacks assembled from cleaned log lines, one open traceback per process.

Lines of several processes interleave; each process prefix has its own
traceback in progress, and a line without a prefix continues the traceback
last written to. A traceback ends at its exception line; one that never gets
one (the log was cut) is kept as `cut_short`. Frames are bounded
(`MAX_FRAMES`, innermost kept) so a pathological log cannot grow memory.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from kvdoctor.diagnose.logline import LogLine

MAX_FRAMES = 200
MAX_CODE = 300
MAX_MESSAGE = 500
STALE_LINES = 500  # open tracebacks that gain nothing for this many lines were cut short: close them

_START = re.compile(r"^\s*Traceback \(most recent call last\):\s*$")
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]{1,1000})", line (?P<line>\d{1,9}), in (?P<func>\S{1,200})')
_CARET = re.compile(r"^\s*[\^~]+\s*$")
_ELISION = re.compile(r"^\s*(?:\.\.\.|…|\[Previous line repeated \d+ more times?\])\s*$")
_EXCEPTION = re.compile(r"^(?P<name>[A-Za-z_][\w]*(?:\.[A-Za-z_]\w*)*)(?::\s?(?P<msg>.*))?$")
_FATAL = re.compile(r"EngineCore encountered a fatal error|^Process EngineCore")
ELIDED = "…"  # a line of a statement's code that the traceback left out (Python 3.13's `...<N lines>...`)
_PY313_ELISION = re.compile(r"^\s*\.\.\.<\d+ lines?>\.\.\.\s*$")
_RERAISE_NAMES = ("EngineDeadError", "AsyncEngineDeadError", "EngineGenerateError")


@dataclass
class LogFrame:
    file: str  # as written in the log (trimmed for display by `display_path`)
    line: int
    function: str
    code: str = ""

    @property
    def in_vllm(self) -> bool:
        path = self.file.replace("\\", "/")
        return "/vllm/" in path or path.startswith("vllm/")


@dataclass
class LogTraceback:
    process: str | None
    start_line: int  # 1-based line of the log where it started
    frames: list[LogFrame] = field(default_factory=list)
    exception: str | None = None  # short name, e.g. "AssertionError"
    qualified_exception: str | None = None
    message: str = ""
    elided: bool = False  # the traceback has `...` elisions or dropped frames
    after_fatal_marker: bool = False  # "EngineCore encountered a fatal error" came first
    level: str | None = None  # the log level its first line was written at (WARNING: the process went on)

    @property
    def survived(self) -> bool:
        """Logged as a warning: the process caught it and went on (a worker's failed transfer, say)."""
        return self.level in ("WARNING", "WARN", "INFO", "DEBUG") and not self.after_fatal_marker

    @property
    def cut_short(self) -> bool:
        return self.exception is None

    @property
    def is_reraise(self) -> bool:
        """The API server's EngineDeadError: a consequence of the engine's crash, not the crash."""
        return self.exception in _RERAISE_NAMES or "EngineCore encountered an issue" in self.message

    @property
    def vllm_frames(self) -> list[LogFrame]:
        return [f for f in self.frames if f.in_vllm]


def balanced(code: str) -> bool:
    """Whether the brackets of `code` close (string literals left out): a whole statement, not one line of it."""
    depth = 0
    for ch in re.sub(r"'[^'\n]*'|\"[^\"\n]*\"", "", code):
        depth += ch in "([{"
        depth -= ch in ")]}"
    return depth <= 0


def crash_rank(tb: LogTraceback) -> tuple[int, ...]:
    """Lower is likelier the engine's crash: not the API server's re-raise, complete, after the fatal-error
    marker, in an engine process, with vLLM frames."""
    engine = tb.process is not None and tb.process.startswith("EngineCore")
    return (1 if tb.is_reraise else 0, 1 if tb.cut_short else 0, 0 if tb.after_fatal_marker else 1,
            0 if engine else 1, 0 if tb.vllm_frames else 1)


def display_path(path: str) -> str:
    """A frame's file without the machine's prefix: `vllm/...`, else its last two components."""
    path = path.replace("\\", "/")
    index = path.rfind("/vllm/")
    if index >= 0:
        return path[index + 1:]
    if path.startswith("vllm/"):
        return path
    parts = [p for p in path.split("/") if p and p not in ("...", "..", ".")]
    return "/".join(parts[-2:]) if parts else path


def _exception_line(body: str) -> re.Match[str] | None:
    if not body or body[0] in " \t" or body.startswith(("Traceback", "File ", "During handling",
                                                        "The above exception")):
        return None
    match = _EXCEPTION.match(body.rstrip())
    if not match:
        return None
    name = match.group("name").rsplit(".", 1)[-1]
    # an exception class: ends like one, or is a bare known-looking name followed by ':'
    if not (name.endswith(("Error", "Exception", "Exit", "Interrupt", "Warning", "Dead", "Failure"))
            or match.group("msg") is not None and name[:1].isupper()):
        return None
    return match


class TracebackAssembler:
    """Feed cleaned lines; finished tracebacks accumulate in `done` (at most `keep` of them)."""

    def __init__(self, keep: int = 64) -> None:
        self.open: dict[str | None, LogTraceback] = {}
        self.fatal: set[str | None] = set()
        self.last_key: str | None = None
        self.done: list[LogTraceback] = []
        self.keep = keep
        self.dropped = 0
        self.idle = 0  # lines since an open traceback last gained a frame, code line or exception
        self.fatal_line: int | None = None  # the first fatal-error marker's line

    def _finish(self, key: str | None) -> None:
        tb = self.open.pop(key, None)
        if tb is None:
            return
        self.done.append(tb)
        if len(self.done) > self.keep:  # keep the `keep` likeliest crashes, earliest first among equals
            self.done.remove(max(self.done, key=lambda t: (crash_rank(t), t.start_line)))
            self.dropped += 1

    def feed(self, line: LogLine, number: int) -> bool:
        """One line; True when a traceback took it (else it is loose evidence, or nothing)."""
        if self.open:
            self.idle += 1
            if self.idle > STALE_LINES:
                for key in list(self.open):
                    self._finish(key)
        if self._feed(line, number):
            self.idle = 0
            return True
        return False

    def _feed(self, line: LogLine, number: int) -> bool:
        """One line; True when it added to a traceback."""
        body = line.body
        key = line.process if line.process is not None else self.last_key
        if _FATAL.search(body):
            self.fatal.add(key)
            # an unprefixed traceback pasted under the engine's prefixed fatal-error line is the engine's
            self.last_key = key
            if self.fatal_line is None:
                self.fatal_line = number
        if _START.match(body):
            self._finish(key)
            self.open[key] = LogTraceback(key, number, after_fatal_marker=key in self.fatal, level=line.level)
            self.last_key = key
            return True
        tb = self.open.get(key)
        if tb is None:
            frame = _FRAME.match(body)
            if frame is None:
                return False
            # a traceback whose start was cut off (or pasted without its header)
            tb = self.open[key] = LogTraceback(key, number, elided=True, after_fatal_marker=key in self.fatal,
                                               level=line.level)
        self.last_key = key
        frame = _FRAME.match(body)
        if frame:
            tb.frames.append(LogFrame(frame.group("file"), int(frame.group("line")), frame.group("func")))
            if len(tb.frames) > MAX_FRAMES:
                del tb.frames[0]
                tb.elided = True
            return True
        if _ELISION.match(body):
            tb.elided = True
            return True
        if _CARET.match(body) or not body.strip():
            return False
        if body[:1] in " \t":
            if tb.frames and not tb.frames[-1].code:
                tb.frames[-1].code = body.strip()[:MAX_CODE]
                return True
            if tb.frames and not balanced(tb.frames[-1].code) and len(tb.frames[-1].code) < MAX_CODE:
                # the rest of a multi-line statement (Python 3.13 shows every line of it)
                line = ELIDED if _PY313_ELISION.match(body) else body.strip()  # `...<2 lines>...`: a gap
                tb.frames[-1].code = (tb.frames[-1].code + "\n" + line)[:MAX_CODE]
                return True
            return False
        match = _exception_line(body)
        if match:
            tb.qualified_exception = match.group("name")[:200]
            tb.exception = tb.qualified_exception.rsplit(".", 1)[-1]
            tb.message = (match.group("msg") or "").strip()[:MAX_MESSAGE]
            self._finish(key)
            if key in self.fatal and key is not None:
                self.fatal.discard(key)
            return True
        return False

    def close(self) -> list[LogTraceback]:
        """End of the log: whatever is still open was cut short."""
        for key in list(self.open):
            self._finish(key)
        return self.done
