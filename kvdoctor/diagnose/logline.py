"""One log line, cleaned: ANSI codes, process prefix, timestamp, level and source stripped.

vLLM prefixes every line of a subprocess with `(EngineCore_DP0 pid=123) ` (in
colour on a terminal), then its logger writes `ERROR 08-04 09:48:15
[core.py:1332] ` (older releases: `core.py:1142] `). Container runtimes may put
an ISO timestamp in front of all that, and some log collectors a `>>` or `|`
after it. GitHub pastes show ESC as the two characters `^[`, so both forms of
colour codes are removed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_ANSI = re.compile(r"(?:\x1b|\^\[)\[[0-9;?]*[A-Za-z]|\x1b[()][A-Z0-9]|\x1b")
_ISO_STAMP = re.compile(r"^\s*\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(?:[.,]\d+)?(?:Z|[+-]\d\d:?\d\d)?\s+(?:(?:>>|\|)\s+)?")
# `(EngineCore_DP0 pid=7) `; Ray nests them: `(API Server pid=11) (RayWorkerProc pid=12) (Worker_TP6 pid=12) `
# (the innermost, last one, is the process that wrote the line; a name may hold spaces).
_PROCESS = re.compile(r"^\((?P<proc>[A-Za-z_][\w.\- ]{0,80}?) pid=(?P<pid>\d+)(?:, ip=[\w.:]+)?\)\s?")
_LOGGER = re.compile(
    r"^(?P<level>DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL)\s+\d\d-\d\d\s+\d\d:\d\d:\d\d(?:\.\d+)?\s+"
    r"\[?[\w.\-/]+:\d+\]\s?")  # `[core.py:1332]`, newer `[v1/executor/multiproc_executor.py:962]`
_BARE_LEVEL = re.compile(r"^(?P<level>INFO|WARNING|ERROR|CRITICAL|DEBUG):\s+")


@dataclass(frozen=True)
class LogLine:
    process: str | None  # e.g. "EngineCore_DP0"; None when the line has no process prefix
    level: str | None
    body: str  # the message, indentation kept (traceback frames are indented)


def strip_ansi(text: str) -> str:
    return _ANSI.sub("", text)


def clean(raw: str) -> LogLine:
    text = strip_ansi(raw.rstrip("\r\n")).replace("\r", "")
    text = _ISO_STAMP.sub("", text, count=1)
    process = None
    match = _PROCESS.match(text)
    while match:
        process = match.group("proc").replace(" ", "")
        text = text[match.end():]
        match = _PROCESS.match(text)
    level = None
    match = _LOGGER.match(text)
    if match:
        level = match.group("level")
        text = text[match.end():]
    else:
        match = _BARE_LEVEL.match(text)
        if match:
            level = match.group("level")
            text = text[match.end():]
    return LogLine(process, level, text)
