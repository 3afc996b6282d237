"""Where a failure fired: exception, message, and the vLLM frames of its traceback."""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field

_VLLM_MARKER = "/vllm/"


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
    in_vllm: bool = True

    def as_dict(self) -> dict:
        return {
            "exception": self.exception, "message": self.message, "file": self.file, "line": self.line,
            "function": self.function, "code": self.code,
            "vllm_frames": [f.__dict__ for f in self.vllm_frames], "in_vllm": self.in_vllm,
        }


def _relative(path: str) -> str:
    index = path.rfind(_VLLM_MARKER)
    return path[index + 1:] if index >= 0 else path


def describe_exception(exc: BaseException) -> Failure:
    frames = traceback.extract_tb(exc.__traceback__)
    vllm_frames = [Frame(_relative(f.filename), f.lineno or 0, f.name, (f.line or "").strip())
                   for f in frames if _VLLM_MARKER in f.filename.replace("\\", "/")]
    innermost = vllm_frames[-1] if vllm_frames else None
    message = str(exc).strip()
    if not message and innermost is not None:
        message = innermost.code  # a bare `assert` says nothing; its source line does
    last = frames[-1] if frames else None
    return Failure(
        exception=type(exc).__name__,
        message=message.splitlines()[0] if message else "",
        file=innermost.file if innermost else (last.filename if last else None),
        line=innermost.line if innermost else (last.lineno if last else None),
        function=innermost.function if innermost else (last.name if last else None),
        code=innermost.code if innermost else ((last.line or "").strip() if last else None),
        vllm_frames=vllm_frames,
        in_vllm=innermost is not None,
    )
