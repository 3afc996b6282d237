"""Which statements of one vLLM function a whole search executed, and in how many of its examples.

A hunt that does not reach its crash must say how near it came: the crash function's statements it ran
(and the crash statement's count), and how many generated examples entered the function at all. This is
`observe.coverage`'s site counting widened from one statement to every statement of the function, over a
scope that spans many runs (explore's search), with an example counter the caller supplies.

Tracing is `coverage.LineTracer`'s, the crash site's own, given every statement of the function in place of
one: per call on 3.11 (for the scope, each vLLM class that defines the function gets a pass-through that turns
a line tracer on around the call only; the rest of the search runs untraced), `sys.monitoring` on 3.12+;
removed on exit even when the search raises, a trace function installed before chained. A function no class
defines as a plain function (a staticmethod, a wrapped one) is not traced: `measured` says so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import CodeType, FrameType, FunctionType
from typing import Any

from kvdoctor.observe.coverage import LineTracer, _module_classes, _normalize, _owners, _short, _statements


@dataclass
class FunctionReach:
    """What a scope did in one function: calls, examples that called it, statements executed."""

    function: str
    where: str = ""  # Class.function (file:first line), of the first owner traced
    measured: bool = True
    why_not: str = ""  # when not measured
    calls: int = 0
    examples: int = 0  # distinct examples (as the caller's counter numbers them) that called it
    statements: list[int] = field(default_factory=list)  # first lines of the function's statements (first owner)
    reached: list[int] = field(default_factory=list)  # of those, the ones executed
    crash_line: int | None = None  # the crash statement's first line, when the statement is known and found
    crash_hits: int = 0  # times the crash statement began to execute

    def missed(self) -> list[int]:
        return [n for n in self.statements if n not in set(self.reached)]

    def line(self) -> str:
        """One line: 'reached 14 of 20 statements of X._f (file:930) in 41 calls from 12 examples; never ran
        lines 960, 975 (the crash statement, line 975)'."""
        if not self.measured:
            return f"{self.function}: lines not measured ({self.why_not})"
        if not self.calls:
            return f"{self.where or self.function}: never called (0 examples reached it)"
        text = (f"reached {len(self.reached)} of {len(self.statements)} statements of {self.where} in "
                f"{self.calls} call(s) from {self.examples} example(s)")
        missed = self.missed()
        if missed:
            shown = ", ".join(map(str, missed[:12])) + (", ..." if len(missed) > 12 else "")
            text += f"; never ran line(s) {shown}"
        if self.crash_line is not None:
            text += f"; the crash statement (line {self.crash_line}) ran {self.crash_hits}x"
        return text

    def as_dict(self) -> dict[str, Any]:
        return {"function": self.function, "where": self.where or None, "measured": self.measured,
                "why_not": self.why_not or None, "calls": self.calls, "examples": self.examples,
                "statements": len(self.statements), "reached_lines": list(self.reached),
                "missed_lines": self.missed(), "crash_line": self.crash_line, "crash_hits": self.crash_hits,
                "summary": self.line()}


class FunctionLines:
    """Counts `function`'s statements inside a `with` block (see the module docstring). `example`: the number
    of the example running now (called at each entry into the function); `file`: the log's path of the crash
    frame, to keep only the owners defined in that file (`prepare_store` is defined by several managers);
    `statement`: the crash statement's text, when the log shows it."""

    def __init__(self, function: str, example: Callable[[], int], file: str = "", statement: str = "") -> None:
        self.reach = FunctionReach(function)
        self._example = example
        self._file = _tail(file)
        self._statement = _normalize(statement.removeprefix("assert ").strip()) if statement else ""
        self._lines: LineTracer | None = None
        self._first: CodeType | None = None  # lines are kept for the first owner's code (the one `statements` lists)
        self._seen_examples: set[int] = set()
        self._reached: set[int] = set()

    def __enter__(self) -> FunctionReach:
        name = self.reach.function
        owners = [(k, c) for k, c in _owners(_module_classes(), name)
                  if type(k.__dict__.get(name)) is FunctionType]
        if self._file:
            owners = [(k, c) for k, c in owners if c.co_filename.replace("\\", "/").endswith(self._file)] or owners
        if not owners:
            self.reach.measured = False
            self.reach.why_not = f"no vLLM connector or scheduler class defines {name} as a plain function"
            return self.reach
        first_klass, self._first = owners[0]
        statements = _statements(self._first)
        self.reach.where = f"{first_klass.__qualname__}.{name} ({_short(self._first.co_filename)}:" \
                           f"{self._first.co_firstlineno})"
        self.reach.statements = sorted({first for first, _, _, _ in statements})
        if self._statement:
            crash = [first for first, _, text, _ in statements if self._statement in text]
            self.reach.crash_line = crash[0] if crash else None
        starts = {code: {n: first for first, end, _, _ in _statements(code) for n in range(first, end + 1)}
                  for _, code in owners}
        self._lines = LineTracer(name, starts, tuple(klass for klass, _ in owners), self._statement_ran, self._called)
        if not self._lines.start():
            self._lines = None
            self.reach.measured = False
            self.reach.why_not = "no free sys.monitoring tool id"
        return self.reach

    def __exit__(self, *exc: Any) -> None:
        if self._lines is not None:
            self._lines.stop()
            self._lines = None
        self.reach.reached = sorted(n for n in self._reached if n in set(self.reach.statements))
        self.reach.examples = len(self._seen_examples)

    def _called(self, code: CodeType) -> None:
        self.reach.calls += 1
        self._seen_examples.add(self._example())

    def _statement_ran(self, frame: FrameType, code: CodeType, start: int) -> None:
        if code is self._first:
            self._reached.add(start)
            if start == self.reach.crash_line:
                self.reach.crash_hits += 1


def _tail(path: str) -> str:
    """The last two parts of a log's path (`offloading/scheduler.py`), what an installed file must end with."""
    parts = [p for p in path.replace("\\", "/").split("/") if p and p not in ("...", "..", ".")]
    return "/".join(parts[-2:])
