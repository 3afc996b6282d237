"""Where a failure fired, and whose code raised it.

Attribution is by the innermost frame that belongs to vLLM or to kvdoctor
(frames of the standard library, torch, numpy… are skipped: they only carry
out what their caller asked). An exception whose innermost owned frame is
kvdoctor's — including kvdoctor's patched `storable_chunks`, which vLLM calls —
is kvdoctor's own failure, never a vLLM finding, however many vLLM frames sit
above it.
"""

from __future__ import annotations

import ast
import linecache
import os
import re
import traceback
from dataclasses import dataclass, field
from functools import lru_cache

_VLLM_MARKER = "/vllm/"
_KVDOCTOR_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))).replace("\\", "/") + "/"


@dataclass
class Frame:
    file: str  # relative to site-packages ("vllm/...") for vLLM frames
    line: int
    function: str
    code: str


@dataclass
class Failure:
    exception: str
    message: str
    file: str | None
    line: int | None
    function: str | None
    code: str | None
    vllm_frames: list[Frame] = field(default_factory=list)
    in_vllm: bool = True  # the innermost owned frame is vLLM's
    involved_request: str | None = None  # the request vLLM was working on when it raised, when known

    def as_dict(self) -> dict:
        return {
            "exception": self.exception, "message": self.message, "file": self.file, "line": self.line,
            "function": self.function, "code": self.code,
            "vllm_frames": [f.__dict__ for f in self.vllm_frames], "in_vllm": self.in_vllm,
            "involved_request": self.involved_request,
        }

    def where(self) -> str:
        return f"{self.file}:{self.line} in {self.function}"


def _relative(path: str) -> str:
    index = path.rfind(_VLLM_MARKER)
    return path[index + 1:] if index >= 0 else path


def is_vllm_file(path: str) -> bool:
    return _VLLM_MARKER in path.replace("\\", "/")


def is_kvdoctor_file(path: str) -> bool:
    return os.path.abspath(path).replace("\\", "/").startswith(_KVDOCTOR_DIR)


def describe_exception(exc: BaseException) -> Failure:
    # Line numbers only: `extract_tb` also works out each frame's column span, which cost explore
    # (thousands of failing runs while shrinking) more than the rest of the description.
    frames = traceback.StackSummary.extract(traceback.walk_tb(exc.__traceback__))
    vllm_summaries = [f for f in frames if is_vllm_file(f.filename)]
    # The outer frames keep Python's line (a call site: often one argument of a long call); the frame
    # that raised shows its whole statement, which is what a recipe's `contains` is matched against.
    vllm_frames = [Frame(_relative(f.filename), f.lineno or 0, f.name,
                         statement_source(f.filename, f.lineno, f.line) if f is vllm_summaries[-1]
                         else (f.line or "").strip())
                   for f in vllm_summaries]
    owned = next((f for f in reversed(frames) if is_vllm_file(f.filename) or is_kvdoctor_file(f.filename)),
                 frames[-1] if frames else None)
    in_vllm = owned is not None and is_vllm_file(owned.filename)
    innermost_vllm = vllm_frames[-1] if vllm_frames else None
    message = str(exc).strip()
    if not message and in_vllm and innermost_vllm is not None:
        message = innermost_vllm.code  # a bare `assert` says nothing; its source line does
    file: str | None
    line: int | None
    function: str | None
    code: str | None
    if in_vllm and innermost_vllm is not None:
        file, line, function, code = (innermost_vllm.file, innermost_vllm.line, innermost_vllm.function,
                                      innermost_vllm.code)
    elif owned is not None:
        file, line, function, code = (_kvdoctor_relative(owned.filename), owned.lineno, owned.name,
                                      statement_source(owned.filename, owned.lineno, owned.line))
    else:
        file = line = function = code = None
    return Failure(
        exception=type(exc).__name__,
        message=message.splitlines()[0] if message else "",
        file=file, line=line, function=function, code=code,
        vllm_frames=vllm_frames,
        in_vllm=in_vllm,
    )


def statement_source(filename: str, lineno: int | None, line: str | None) -> str:
    """The whole statement a traceback line belongs to, on one line. A frame names one line of a
    statement that spans several, and which one differs by Python version (a multi-line `assert (`:
    the condition's line on 3.11 and 3.13, the `assert (` line on 3.12), so a recipe's `contains`
    matched on 3.11 and not on 3.12. A compound statement (`if`, `for`, ...) contributes its header."""
    text = (line or "").strip()
    if not lineno:
        return text
    span = _statement_span(filename, lineno)
    if span is None or span[0] == span[1]:
        return text
    joined = " ".join(linecache.getline(filename, n).strip() for n in range(span[0], span[1] + 1))
    return re.sub(r"\s+\)", ")", re.sub(r"\(\s+", "(", joined)).strip() or text


@lru_cache(maxsize=4096)
def _statement_span(filename: str, lineno: int) -> tuple[int, int] | None:
    """(first, last) line of the innermost statement holding `lineno` (a compound one: its header)."""
    spans = _statement_spans(filename)
    holding = [span for span in spans if span[0] <= lineno <= span[1]]
    return min(holding, key=lambda span: span[1] - span[0]) if holding else None


@lru_cache(maxsize=64)
def _statement_spans(filename: str) -> tuple[tuple[int, int], ...]:
    try:
        tree = ast.parse("".join(linecache.getlines(filename)))
    except (SyntaxError, ValueError):
        return ()
    spans = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.stmt) or node.end_lineno is None:
            continue
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.stmt):  # compound: the header
            spans.append((node.lineno, max(node.lineno, body[0].lineno - 1)))
        else:
            spans.append((node.lineno, node.end_lineno))
    return tuple(spans)


def _kvdoctor_relative(path: str) -> str:
    full = os.path.abspath(path).replace("\\", "/")
    root = os.path.dirname(_KVDOCTOR_DIR.rstrip("/")) + "/"
    return full[len(root):] if full.startswith(root) else os.path.basename(path)
