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
PENDING_LINES = 3  # an exception line this close above a traceback's first line is that traceback's
STALE_LINES = 500  # open tracebacks that gain nothing for this many lines were cut short: close them

_START = re.compile(r"^\s*Traceback \(most recent call last\):\s*$")
# `File "x.py", line 9, in f`; faulthandler writes `File "x.py", line 9 in f`; a native stack
# `File "<unknown>", line 0, in swap_blocks(at::Tensor&, ...)` (the rest of the line is its signature).
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]{1,1000})", line (?P<line>\d{1,9}),? in (?P<func>\S{1,200})(?P<rest>.*)$')
# A native crash: torch's `!!!!!!! Segfault encountered !!!!!!!`, Python's faulthandler, abseil's `*** SIGSEGV`.
_NATIVE = re.compile(r"Segfault encountered|Fatal Python error: (?P<fatal>Segmentation fault|Aborted|Bus error|"
                     r"Floating point exception)|\*\*\* (?P<sig>SIG[A-Z]+) received")
_NATIVE_SIGNALS = {"Segmentation fault": "SIGSEGV", "Aborted": "SIGABRT", "Bus error": "SIGBUS",
                   "Floating point exception": "SIGFPE"}
_THREAD = re.compile(r"^\s*(?P<current>Current thread|Thread|Stack)\b.*\(most recent call first\):\s*$")
# vLLM's offloading worker logs a failed transfer as `Exception in ('CPU', 'GPU') transfer 235: AssertionError()`
# and the traceback under it (a WARNING: the worker goes on, the job is reported failed).
_TRANSFER_HEADER = re.compile(r"^Exception in (?P<what>\(.{0,200}?\)|\S{1,100}) transfer (?P<job>\d{1,12}): "
                              r"(?P<name>[A-Za-z_][\w.]*)(?:\((?P<msg>.*)\))?\s*$")
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
    native: bool = False  # a native crash dump (a signal), not a Python traceback: frames are C++ or faulthandler's
    header: str = ""  # the line that announced it: vLLM's transfer-failure line, the segfault banner
    exception_from: str = ""  # "" (its own last line) | "above" (pasted above its frames) | "header" (the header's)

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


def native_name(signature: str) -> str:
    """A C++ frame's function without its template and parameter lists: `swap_blocks`, `c10::Dispatcher::callBoxed`."""
    text = signature.strip()
    for _ in range(20):  # innermost template lists first
        reduced = re.sub(r"<[^<>]*>", "", text)
        if reduced == text:
            break
        text = reduced
    name = text.split("(", 1)[0].strip()
    return (name or signature.strip())[:200]


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


def _names_exception(match: re.Match[str]) -> bool:
    """An exception line beyond doubt: the class's name says so (`OSError`, `torch.AcceleratorError`), not
    any `Word: text` (which, indented or above a traceback, is as likely prose or code)."""
    return match.group("name").rsplit(".", 1)[-1].endswith(("Error", "Exception", "Exit", "Interrupt", "Failure"))


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
            or (match.group("msg") is not None and name[:1].isupper())):
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
        # per process: a line just before a traceback that may name its exception (a transfer-failure
        # header, or an exception line pasted above the frames): (how, name, message, text, line number)
        self.pending: dict[str | None, tuple[str, str, str, str, int]] = {}
        self.frame_indent: dict[str | None, int] = {}  # indentation of the open traceback's last `File` line
        self.native_thread: dict[str | None, str] = {}  # a native dump's thread being read: current | other | done

    def _finish(self, key: str | None) -> None:
        tb = self.open.pop(key, None)
        self.native_thread.pop(key, None)
        if tb is None:
            return
        if tb.native:
            tb.frames.reverse()  # native stacks and faulthandler list the innermost frame first
        if tb.exception is None and tb.exception_from:  # cut short: the line above or the header names it
            name = tb.qualified_exception or ""
            tb.exception = name.rsplit(".", 1)[-1] or None
        elif tb.exception is not None and tb.exception_from and not tb.native:
            tb.exception_from = ""  # its own exception line came: that is the one
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

    def _new(self, key: str | None, number: int, line: LogLine, **fields: object) -> LogTraceback:
        """A traceback starting at `number`; a header or exception line just above it is kept for it."""
        self._finish(key)
        tb = LogTraceback(key, number, after_fatal_marker=key in self.fatal, level=line.level, **fields)  # type: ignore[arg-type]
        pending = self.pending.pop(key, None)
        if pending is not None and 0 < number - pending[4] <= PENDING_LINES and not tb.native:
            how, name, message, text, _ = pending
            tb.exception_from, tb.qualified_exception, tb.message = how, name, message
            if how == "header":
                tb.header = text
        self.open[key] = tb
        self.last_key = key
        return tb

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
        native = _NATIVE.search(body)
        if native:
            signal = native.group("sig") or _NATIVE_SIGNALS.get(native.group("fatal") or "", "SIGSEGV")
            self._new(key, number, line, native=True, exception=signal, qualified_exception=signal,
                      message=body.strip()[:MAX_MESSAGE], header=body.strip()[:MAX_MESSAGE], exception_from="header")
            return True
        if _START.match(body):
            self._new(key, number, line)
            self.frame_indent[key] = len(body) - len(body.lstrip())
            return True
        tb = self.open.get(key)
        frame = _FRAME.match(body)
        if tb is None:
            if frame is None:
                self._remember(key, body, number)
                return False
            # a traceback whose start was cut off (or pasted without its header)
            tb = self._new(key, number, line, elided=True, native=frame.group("file") == "<unknown>")
        self.last_key = key
        if tb.native:
            thread = _THREAD.match(body)
            if thread:  # faulthandler: the current thread's frames are the crash's; other threads' are not
                state = self.native_thread.get(key)
                if thread.group("current") == "Thread" and state in ("current", "done"):
                    self.native_thread[key] = "done"
                else:
                    tb.frames.clear()
                    self.native_thread[key] = "current" if thread.group("current") != "Thread" else "other"
                return True
            if frame and self.native_thread.get(key) == "done":
                return True
        if frame:
            if tb.native or frame.group("file") == "<unknown>":
                function = native_name(frame.group("func") + frame.group("rest"))
            else:
                function = frame.group("func")
            tb.frames.append(LogFrame(frame.group("file"), int(frame.group("line")), function))
            self.frame_indent[key] = len(body) - len(body.lstrip())
            if len(tb.frames) > MAX_FRAMES:
                del tb.frames[0]
                tb.elided = True
            return True
        if _ELISION.match(body):
            tb.elided = True
            return True
        if _CARET.match(body) or not body.strip() or tb.native:
            return False
        if body[:1] in " \t":
            indent = len(body) - len(body.lstrip())
            exception = _exception_line(body.strip())
            if exception and tb.frames and indent <= self.frame_indent.get(key, 0) and _names_exception(exception):
                return self._exception(tb, key, exception)  # ` OSError: ...` under the frames, not code
            if tb.frames and not tb.frames[-1].code:
                tb.frames[-1].code = body.strip()[:MAX_CODE]
                return True
            if tb.frames and not balanced(tb.frames[-1].code) and len(tb.frames[-1].code) < MAX_CODE:
                # the rest of a multi-line statement (Python 3.13 shows every line of it)
                more = ELIDED if _PY313_ELISION.match(body) else body.strip()  # `...<2 lines>...`: a gap
                tb.frames[-1].code = (tb.frames[-1].code + "\n" + more)[:MAX_CODE]
                return True
            return False
        match = _exception_line(body)
        if match:
            return self._exception(tb, key, match)
        return False

    def _exception(self, tb: LogTraceback, key: str | None, match: re.Match[str]) -> bool:
        tb.qualified_exception = match.group("name")[:200]
        tb.exception = tb.qualified_exception.rsplit(".", 1)[-1]
        tb.message = (match.group("msg") or "").strip()[:MAX_MESSAGE]
        self._finish(key)
        if key in self.fatal and key is not None:
            self.fatal.discard(key)
        return True

    def _remember(self, key: str | None, body: str, number: int) -> None:
        """A line outside any traceback that may name the exception of the one that follows it."""
        text = body.strip()
        header = _TRANSFER_HEADER.match(text)
        if header:
            name = header.group("name")[:200]
            self.pending[key] = ("header", name, (header.group("msg") or "").strip()[:MAX_MESSAGE], text[:MAX_MESSAGE],
                                 number)
            return
        exception = _exception_line(body) if body[:1] not in " \t" else None
        if exception and _names_exception(exception):
            self.pending[key] = ("above", exception.group("name")[:200],
                                 (exception.group("msg") or "").strip()[:MAX_MESSAGE], text[:MAX_MESSAGE], number)

    def close(self) -> list[LogTraceback]:
        """End of the log: whatever is still open was cut short."""
        for key in list(self.open):
            self._finish(key)
        return self.done
