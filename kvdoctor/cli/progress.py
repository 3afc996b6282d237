"""Progress on long work: one status line on stderr, on a terminal only.

What it shows: what runs now (a recipe, a logic variant), a count ("4/13") and the time
elapsed, redrawn a few times a second so the clock moves even while vLLM is being
imported. When stderr is not a terminal (piped, captured, CI) it writes nothing, so logs
and `--json` output stay clean. KVDOCTOR_NO_SPINNER=1 turns it off on a terminal too.

The API is three calls, for any command (audit, repro, matrix, diagnose):

    with Progress("audit", total=13) as progress:
        progress.update("preemption", done=3)   # 4th of 13 under way
    # or hand `progress.callback` to the application as its `on_progress(done, total, label)`

Cheap to import (stdlib only): the CLI imports it before it knows whether anything runs.
"""

from __future__ import annotations

import shutil
import threading
import time
from typing import IO, Any, TextIO

REDRAW_S = 0.25
_CLEAR = "\r\x1b[2K"


def enabled_for(stream: Any) -> bool:
    """A terminal, and not turned off (what the command's `streams.Environment` says)."""
    from kvdoctor.cli.streams import current

    environment = current()
    if environment.getenv("KVDOCTOR_NO_SPINNER"):
        return False
    if stream is environment.stderr_stream:
        return environment.isatty("stderr")
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def elapsed_text(seconds: float) -> str:
    """`7s`, `1m05s`."""
    seconds = int(seconds)
    return f"{seconds}s" if seconds < 60 else f"{seconds // 60}m{seconds % 60:02d}s"


class Progress:
    """One line `what  done/total  label  elapsed`, redrawn in place on a terminal; silent elsewhere."""

    def __init__(self, what: str, total: int | None = None, label: str = "", stream: TextIO | None = None,
                 enabled: bool | None = None) -> None:
        self.what = what
        self.total = total
        self.done = 0
        self.label = label
        self.stream: IO[str]
        if stream is None:
            from kvdoctor.cli.streams import current

            self.stream = current().stderr_stream
        else:
            self.stream = stream
        self.enabled = enabled_for(self.stream) if enabled is None else enabled
        self.started = time.monotonic()
        self._lock = threading.Lock()
        self._draw_lock = threading.Lock()  # the ticker and update() both draw
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._shown = ""

    # -- what the command reports --------------------------------------------------------------

    def update(self, label: str | None = None, done: int | None = None, total: int | None = None) -> None:
        """`label` is what runs now; `done` how many are finished (the line shows done+1 of total)."""
        with self._lock:
            if label is not None:
                self.label = label
            if done is not None:
                self.done = done
            if total is not None:
                self.total = total
        self._draw()

    def callback(self, done: int, total: int, label: str) -> None:
        """The `on_progress(done, total, label)` the application layer calls."""
        self.update(label, done=done, total=total)

    def line(self) -> str:
        """The status line as it is shown (without the terminal's control characters)."""
        with self._lock:
            parts = [self.what]
            if self.total:
                parts.append(f"{min(self.done + 1, self.total)}/{self.total}")
            if self.label:
                parts.append(self.label)
            parts.append(elapsed_text(time.monotonic() - self.started))
        return "  ".join(parts)

    # -- drawing -------------------------------------------------------------------------------

    def _draw(self) -> None:
        if not self.enabled or self._stop.is_set():
            return
        from kvdoctor.cli.streams import current

        width = current().width() or shutil.get_terminal_size((80, 24)).columns
        text = self.line()
        if len(text) > width - 1:
            text = text[:max(width - 2, 1)] + "…"
        show_status = getattr(self.stream, "show_status", None)  # the real stderr: others' lines clear it
        with self._draw_lock:
            if text == self._shown and getattr(self.stream, "status_shown", True):
                return
            self._shown = text
            try:
                if show_status is not None:
                    show_status(text)
                else:
                    self.stream.write(_CLEAR + text)
                    self.stream.flush()
            except (OSError, ValueError):  # the terminal went away: stop drawing, never fail the command
                self.enabled = False

    def _tick(self) -> None:
        while not self._stop.wait(REDRAW_S):
            self._draw()

    def __enter__(self) -> Progress:
        if self.enabled:
            self._draw()
            self._thread = threading.Thread(target=self._tick, name="kvdoctor-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Stop redrawing and clear the line, so the output that follows starts at column 0."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1)
        if self.enabled:
            with self._draw_lock:
                try:
                    self.stream.write(_CLEAR)  # the real stderr: clears it and forgets the line
                    self.stream.flush()
                except (OSError, ValueError):
                    pass
