"""The real `kvdoctor` process: nothing left behind, and the prompt back once the output is out.

- torch and vLLM write caches on import and on `--model` runs (an empty `torchinductor_<user>`
  in $TMPDIR, `~/.cache/vllm/modelinfos`). `redirect_caches` points them at one scratch folder
  (env vars read when torch and vLLM are imported, so it runs first) and `exit_now` removes it.
  A cache the user pointed somewhere themselves is left where they put it. Child processes
  (explore's workers, matrix's runs in other environments) inherit the folder; only the process
  that named it removes it.
- The interpreter's teardown after importing vLLM takes 3-16 s (module finalisation, not atexit
  handlers, which take milliseconds). `exit_now` flushes stdout/stderr, runs the atexit handlers
  (logging's flush and close, multiprocessing's joins, tempfile's clean-ups), removes the scratch
  folder, then ends the process with `os._exit`, skipping only the finalisation.

Only `kvdoctor.cli.app.main` (the console script and `python -m kvdoctor`) calls these; tests
that call the Typer app in-process keep their interpreter.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
import uuid

SCRATCH_ENV = "KVDOCTOR_SCRATCH_DIR"  # set by the process that owns the folder; children reuse it
CACHE_ENV = ("TORCHINDUCTOR_CACHE_DIR", "VLLM_CACHE_ROOT", "TRITON_CACHE_DIR")

_owned: str | None = None


def redirect_caches() -> str:
    """Name a scratch folder (created only by whoever writes into it) and point the caches at it."""
    global _owned
    scratch = os.environ.get(SCRATCH_ENV)
    if not scratch:
        scratch = os.path.join(tempfile.gettempdir(), f"kvdoctor-scratch-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        os.environ[SCRATCH_ENV] = scratch
        _owned = scratch
    for name in CACHE_ENV:
        if not os.environ.get(name):  # a cache the user placed stays theirs
            os.environ[name] = os.path.join(scratch, name.lower())
    return scratch


def remove_scratch() -> None:
    global _owned
    if _owned is not None:
        shutil.rmtree(_owned, ignore_errors=True)
        _owned = None


def exit_now(code: int) -> None:
    """Flush, run the atexit handlers, remove the scratch folder, and end the process at once."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be written anyway
            pass
    try:
        atexit._run_exitfuncs()  # noqa: SLF001 - the handlers a normal exit would run
    finally:
        remove_scratch()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)
