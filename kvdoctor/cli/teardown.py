"""The real `kvdoctor` process: nothing left behind, a SIGTERM answered, and the prompt back once the
output is out.

- What is worth keeping is kept in kvdoctor's own cache directory (`kvdoctor.user_cache`: vLLM's
  model-info cache, without which every run pays a second vLLM import, and compiled bytecode where
  the interpreter writes none); everything else a run
  writes goes into one scratch folder removed at exit: torch's and Triton's caches (an empty
  `torchinductor_<user>` otherwise) and the ZMQ sockets of a `vllm serve` child
  (`VLLM_RPC_BASE_PATH`, three zero-byte sockets in $TMPDIR otherwise). These are variables read
  when torch and vLLM are imported or the server starts, so `prepare` runs first. A cache the
  user pointed somewhere themselves is left where they put it. Child processes (explore's workers,
  matrix's runs in other environments, the server) inherit the folder; only the process that
  made it removes it.
- SIGTERM (a `timeout`, a CI runner) raises `Terminated` where the process is, so every `finally`
  runs as on Ctrl-C (a server child stopped, temp folders removed); the command ends with one line
  and exit 143 (128 + SIGTERM, what a shell reports for it). A second SIGTERM waits for that.
- The interpreter's teardown after importing vLLM takes seconds: the process ends with
  `clean_exit.exit_now` (flush, the atexit handlers, the scratch folder's removal among them,
  then `os._exit`), as the exported scripts do.

Only `kvdoctor.cli.app.main` (the console script and `python -m kvdoctor`) calls these; tests
that call the Typer app in-process keep their interpreter and its signal handlers.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

from kvdoctor.clean_exit import TERMINATED_EXIT, raise_on_sigterm, throwaway_paths
from kvdoctor.user_cache import keep_bytecode, keep_vllm_cache

SCRATCH_ENV = "KVDOCTOR_SCRATCH_DIR"  # set by the process that owns the folder; children reuse it

_owned: str | None = None


def prepare() -> str:
    """Answer SIGTERM, then redirect the caches (see the module's docstring); the scratch folder."""
    raise_on_sigterm()
    return redirect_caches()


def redirect_caches() -> str:
    """Make (or reuse) the scratch folder and point torch's, Triton's and vLLM's throw-away paths at it;
    vLLM's model-info cache at kvdoctor's cache directory."""
    global _owned
    scratch = os.environ.get(SCRATCH_ENV)
    if not scratch or not os.path.isdir(scratch):
        scratch = tempfile.mkdtemp(prefix="kvdoctor-scratch-")  # 0700, unique, short (socket paths)
        os.environ[SCRATCH_ENV] = scratch
        _owned = scratch
        atexit.register(remove_scratch)  # the last handler to run (they run last in, first out)
    keep_vllm_cache()  # first: the model-info cache is kept, in kvdoctor's cache directory
    keep_bytecode()  # and torch's and vLLM's compiled bytecode, where the interpreter writes none
    throwaway_paths(scratch, os.environ, temp=False)  # kvdoctor's own temp folders are removed by their makers
    return scratch


def remove_scratch() -> None:
    global _owned
    if _owned is not None:
        shutil.rmtree(_owned, ignore_errors=True)
        _owned = None


def terminated() -> int:
    """The one line (and, under --json, the error document) a SIGTERM ends the command with; its code."""
    from kvdoctor.cli import streams
    from kvdoctor.cli.shell import json_requested

    message = "terminated (SIGTERM): the run was stopped"
    try:
        streams.note(f"kvdoctor: error: {message}")
        if json_requested(streams.current().arguments) and not streams.document_written():
            from kvdoctor.cli.failures import error_document
            from kvdoctor.report.json_doc import dumps

            streams.write_document(dumps(error_document("terminated", message, TERMINATED_EXIT)))
    except (OSError, ValueError):  # the reader is gone too: the code still says what happened
        pass
    return TERMINATED_EXIT
