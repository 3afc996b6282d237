"""What a log holds about a crash beyond whole tracebacks: loose frames, statements, exception lines.

Operators paste fragments: `offloading/scheduler.py, in _build_store_jobs` and the
`assert` under it, a multi-line assert without its frame, an exception line alone,
a statement quoted in prose. `LooseCollector` is fed the cleaned lines that the
traceback assembler did not take and keeps what it finds (bounded). `units` turns
a `LogSummary` into bodies of evidence the matcher weighs one at a time: each
traceback (the engine's, a worker's WARNING one), and the loose lines together.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvdoctor.diagnose.logline import LogLine
from kvdoctor.diagnose.traceback import ELIDED, LogFrame, LogTraceback, _exception_line, balanced

if TYPE_CHECKING:  # the reader imports this module
    from kvdoctor.diagnose.reader import LogSummary

MAX_ITEMS = 64
MAX_STATEMENT_LINES = 12
MAX_BODY = 8192  # characters of a line looked at for loose evidence
# Frames written other than `File "...", line N, in f`: `scheduler.py, in f`, `scheduler.py, line 9, in f`,
# `scheduler.py:975 in f`, `scheduler.py:975, in f()`; and `f() at scheduler.py:975`, `f (scheduler.py:975)`.
# The file starts where a path does (the lookbehind): tried from inside a long word, it backtracked
# quadratically (a 4 KiB word took 1 s).
_LOOSE_FRAME = re.compile(
    r"""(?<![\w.\-/\\])(?P<file>[\w.\-/\\]*\w\.py)"?(?:,?\s*line\s+(?P<line>\d{1,7})|:(?P<line2>\d{1,7}))?,?\s+in\s+"""
    r"""(?P<func>[A-Za-z_]\w{0,199})\b""")
_LOOSE_FRAME_AFTER = re.compile(
    r"""\b(?P<func>[A-Za-z_]\w{0,199})(?:\(\))?\s+(?:at\s+|\()(?P<file>[\w.\-/\\]*\w\.py):(?P<line>\d{1,7})""")
_ASSERT_START = re.compile(r"^\s*(?:[>$#|]\s*)?(?P<stmt>assert\b(?:\s|\().*)$")
_QUOTED_ASSERT = re.compile(r"`(?P<stmt>assert\b[^`]{3,300})`")
# A function named in prose: `_build_store_jobs`, _build_store_jobs(), `update_state_after_alloc()`.
# Names are matched whole (possessive `\w*+`) and must hold an underscore after their first character
# (`_mentioned`): `\w*_\w*` backtracked quadratically over a long word (8 KiB took 5 s).
_MENTION = re.compile(r"`(?P<a>[A-Za-z_]\w*+)(?:\(\))?`|\b(?P<b>[A-Za-z_]\w*+)\(\)"
                      r"|\bin\s+(?P<c>_?[A-Za-z]\w*+)(?!\.py)")


def _mentioned(match: re.Match[str]) -> str | None:
    """The function a `_MENTION` match names, when it looks like one (an underscore inside the name)."""
    name = match.group("a") or match.group("b")
    if name is not None:
        return name if "_" in name[1:] else None
    name = match.group("c") or ""
    bare = name.removeprefix("_")
    return name if "_" in bare[1:] else None
# `assert` inside prose: "crashes in f (assert len(a) == len(b))"; what follows it up to where its
# brackets would close below zero.
_INLINE_ASSERT = re.compile(r"(?:^|[\s(\[\"'])(?P<stmt>assert\s+\S.*)")
MENTIONED = "(named in the text)"  # the file of a function only named, not a frame
_PY313_ELISION = re.compile(r"^\s*\.\.\.<\d+ lines?>\.\.\.\s*$")
_DUMP = re.compile(r"Dumping input data for V1 LLM engine|Dumping scheduler output for model execution")
# An exception line outside a traceback names a class: `AssertionError`, `torch.AcceleratorError`; not a
# bare `Error:` of prose, nor a warning.
_LOOSE_EXCEPTION = re.compile(r"(?:[A-Za-z_]\w*\.)*[A-Z]\w*?[a-z]\w*?(?:Error|Exception|Failure|Interrupt)")
_LOGGER_TAG = re.compile(r"\[[\w.\-/]+\.py:\d+\]")


@dataclass
class Statement:
    text: str  # as pasted, lines joined with "\n"
    line: int  # where it starts in the log


@dataclass
class LooseEvidence:
    frames: list[LogFrame] = field(default_factory=list)
    statements: list[Statement] = field(default_factory=list)
    exceptions: list[tuple[str, str, int]] = field(default_factory=list)  # (name, message, line)
    dump_line: int | None = None  # vLLM's crash dump ("Dumping input data ...") is there
    mentions: list[LogFrame] = field(default_factory=list)  # functions named in prose (weaker than a frame)


def _up_to_close(text: str) -> str:
    depth = 0
    for index, ch in enumerate(text):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if depth < 0:
            return text[:index].strip()
    return text.strip().rstrip(".,;")


class LooseCollector:
    """Feed cleaned lines the traceback assembler did not take; `open` while a statement spans lines."""

    def __init__(self) -> None:
        self.found = LooseEvidence()
        self._statement: list[str] = []
        self._start = 0
        self._pending_frame: LogFrame | None = None
        self._message: list[str] | None = None  # lines under an exception line that had no message

    @property
    def waiting(self) -> bool:
        """A multi-line statement, or the lines under a bare exception line, may continue on the next line."""
        return bool(self._statement) or self._message is not None

    @property
    def open(self) -> bool:
        return bool(self._statement)

    def _add(self, items: list[Any], item: Any) -> None:
        if len(items) < MAX_ITEMS:
            items.append(item)

    def _close_statement(self) -> None:
        text = "\n".join(self._statement)
        self._statement = []
        if self._pending_frame is not None and not self._pending_frame.code:
            self._pending_frame.code = text
        self._add(self.found.statements, Statement(text, self._start))
        self._pending_frame = None

    def feed(self, line: LogLine, number: int) -> None:
        body = line.body[:MAX_BODY]  # fragments are short lines; a long one (a config dump) is cut here
        if self._message is not None:  # `AssertionError:` then the statement, indented, under it
            if body[:1] in " \t" and body.strip() and len(self._message) < MAX_STATEMENT_LINES:
                self._message.append(body.strip())
                return
            self._close_message()
        if self._statement:
            ends = not body.strip() or (body[:1] not in " \t)]}" and (
                _exception_line(body.strip()) is not None or body.startswith("Traceback")))
            if ends:  # the paste left the statement unclosed: what follows is not part of it
                self._close_statement()
            else:
                self._statement.append(ELIDED if _PY313_ELISION.match(body) else body.strip())
                if balanced("\n".join(self._statement)) or len(self._statement) >= MAX_STATEMENT_LINES:
                    self._close_statement()
                return
        if self.found.dump_line is None and _DUMP.search(body):
            self.found.dump_line = number
        match = _ASSERT_START.match(body)
        if match:
            self._statement, self._start = [match.group("stmt").strip()], number
            if balanced(self._statement[0]):
                self._close_statement()
            return
        for quoted in _QUOTED_ASSERT.finditer(body):
            self._add(self.found.statements, Statement(quoted.group("stmt").strip(), number))
        inline = None if _QUOTED_ASSERT.search(body) else _INLINE_ASSERT.search(body)
        if inline:
            self._add(self.found.statements, Statement(_up_to_close(inline.group("stmt")), number))
        for named in re.finditer(r"`((?:\w+\.)*\w+)`", body):  # an exception class quoted in prose
            if _LOOSE_EXCEPTION.fullmatch(named.group(1)):
                self._add(self.found.exceptions, (named.group(1).rsplit(".", 1)[-1], "", number))
        for mention in _MENTION.finditer(_QUOTED_ASSERT.sub("", body)):
            name = _mentioned(mention)
            if name is not None and all(f.function != name for f in self.found.mentions):
                self._add(self.found.mentions, LogFrame(MENTIONED, 0, name))
        searched = _LOGGER_TAG.sub("", body)
        frame = _LOOSE_FRAME.search(searched)
        after = None if frame else _LOOSE_FRAME_AFTER.search(searched)
        if frame or after:
            m = frame or after
            assert m is not None
            number_text = m.groupdict().get("line") or m.groupdict().get("line2") or "0"
            loose = LogFrame(m.group("file"), int(number_text), m.group("func"))
            self._add(self.found.frames, loose)
            self._pending_frame = loose
            return
        if body[:1] in " \t" and body.strip() and self._pending_frame is not None:
            self._pending_frame.code = body.strip()
            self._add(self.found.statements, Statement(body.strip(), number))
            self._pending_frame = None
            return
        exception = _exception_line(body.strip()) if body.strip() else None
        if exception and _LOOSE_EXCEPTION.fullmatch(exception.group("name")):
            name = exception.group("name").rsplit(".", 1)[-1]
            self._add(self.found.exceptions, (name, (exception.group("msg") or "").strip()[:500], number))
            if not (exception.group("msg") or "").strip():
                self._message, self._start = [], number + 1

    def _close_message(self) -> None:
        if self._message:
            self._add(self.found.statements, Statement("\n".join(self._message), self._start))
        self._message = None

    def close(self) -> LooseEvidence:
        if self._statement:
            self._close_statement()
        self._close_message()
        return self.found


@dataclass
class Unit:
    """One body of evidence the matcher weighs on its own."""

    label: str  # how the report names it
    frames: list[LogFrame]
    exception: str | None
    message: str
    complete: bool  # a traceback with its exception line: its innermost vLLM frame raised it
    statements: list[Statement] = field(default_factory=list)  # besides the frames' own code
    traceback: LogTraceback | None = None

    @property
    def innermost(self) -> LogFrame | None:
        vllm = [f for f in self.frames if f.in_vllm]
        return vllm[-1] if vllm else (self.frames[-1] if self.frames else None)


def traceback_unit(tb: LogTraceback) -> Unit:
    where = f" in {tb.process}" if tb.process else ""
    label = f"the traceback{where} at line {tb.start_line}"
    return Unit(label, list(tb.frames), tb.exception, tb.message, not tb.cut_short, traceback=tb)


def units(summary: LogSummary) -> list[Unit]:
    """The crash first, then the other tracebacks (worker WARNINGs), then the loose lines; no re-raises."""
    out: list[Unit] = []
    tracebacks = [tb for tb in summary.tracebacks if not tb.is_reraise and (tb.frames or tb.exception)]
    if summary.crash is not None and summary.crash in tracebacks:
        tracebacks.remove(summary.crash)
        tracebacks.insert(0, summary.crash)
    out += [traceback_unit(tb) for tb in tracebacks]
    loose = summary.loose
    if loose is not None and (loose.frames or loose.statements or loose.exceptions or loose.mentions):
        reraise = ("EngineDeadError", "AsyncEngineDeadError", "EngineGenerateError")
        exceptions = [e for e in loose.exceptions if e[0] not in reraise]
        exception, message = (exceptions[-1][0], exceptions[-1][1]) if exceptions else (None, "")
        out.append(Unit("the lines outside any whole traceback", list(loose.mentions) + list(loose.frames),
                        exception, message, False, statements=list(loose.statements)))
    return out
