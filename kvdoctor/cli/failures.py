"""How a command ends when something goes wrong: one line, the right exit status, never a traceback.

- `KvdoctorError` (bad input, vLLM missing or incompatible, ...): its message and its code.
- Any other exception is kvdoctor's own failure: exit 5 with one line naming
  the exception and asking for a bug report to kvdoctor. It never shares a code
  with "reproduced". The traceback is printed only with `--debug` or
  `KVDOCTOR_DEBUG=1`.
- With `--json`, stdout still gets one JSON document (`schema_version`, `error`),
  unless the command already wrote its document (an output file that failed after
  the verdict): one document, never two.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from typing import Any

from kvdoctor.errors import ExitStatus, InternalError, KvdoctorError, UsageError

BUG_REPORT = "this is a bug in kvdoctor, not a vLLM finding: please report it to kvdoctor"


def enable_debug() -> None:
    """`--debug`: for the command being run (its `streams.Environment`)."""
    from kvdoctor.cli.streams import current

    current().debug = True


def debug_enabled() -> bool:
    from kvdoctor.cli.streams import current

    environment = current()
    return environment.debug or (environment.getenv("KVDOCTOR_DEBUG", "") or "") not in ("", "0")


def _stderr() -> Any:
    from kvdoctor.cli.streams import current

    return current().stderr_stream


def error_document(kind: str, message: str, code: int) -> dict:
    from kvdoctor import __version__
    from kvdoctor.report.json_doc import SCHEMA_VERSION

    return {"schema_version": SCHEMA_VERSION, "kvdoctor_version": __version__,
            "error": {"kind": kind, "message": message, "exit_code": int(code)}}


def _fail(kind: str, message: str, code: int, json_out: bool) -> int:
    from kvdoctor.cli import streams

    streams.note(f"kvdoctor: error: {message}")

    if json_out and not streams.document_written():
        from kvdoctor.report.json_doc import dumps

        streams.write_document(dumps(error_document(kind, message, code)))
    return int(code)


def run_guarded(action: Callable[[], int], json_out: bool = False) -> int:
    """Run `action` and return the exit status it earned."""
    from kvdoctor.cli import streams

    streams.begin_command()
    return streams.settle_stdout(_run(action, json_out))


def _run(action: Callable[[], int], json_out: bool) -> int:
    try:
        return int(action())
    except KvdoctorError as exc:
        if debug_enabled() and exc.__cause__ is not None:
            traceback.print_exception(exc.__cause__, file=_stderr())
        message = str(exc)
        if isinstance(exc, InternalError):
            hint = "" if debug_enabled() else " (traceback: --debug or KVDOCTOR_DEBUG=1)"
            message = f"internal error: {message}; {BUG_REPORT}{hint}"
        return _fail(exc.kind, message, exc.exit_code, json_out)
    except KeyboardInterrupt:
        return _fail("interrupted", "interrupted", ExitStatus.INTERRUPTED, json_out)
    except Exception as exc:
        if debug_enabled():
            traceback.print_exc(file=_stderr())
        where = _innermost(exc)
        hint = "" if debug_enabled() else " (traceback: --debug or KVDOCTOR_DEBUG=1)"
        return _fail("internal_error", f"internal error: {type(exc).__name__}: {_one_line(exc)}{where}; "
                                       f"{BUG_REPORT}{hint}", ExitStatus.INTERNAL_ERROR, json_out)


def raise_unwritten(failures: list[str]) -> None:
    """Output files (--report, --svg, ...) that could not be written after the run: each named on
    one line; the command exits 2 (an unwritable output path is a usage error), the verdict printed."""
    if not failures:
        return
    from kvdoctor.cli.streams import note

    for line in failures[:-1]:
        note(f"kvdoctor: error: {line}")
    raise UsageError(failures[-1])


def _one_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else "(no message)"


def _innermost(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return ""
    last = frames[-1]
    return f" at {os.path.basename(last.filename)}:{last.lineno} in {last.name}"
