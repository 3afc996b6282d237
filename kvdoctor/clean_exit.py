"""Nothing left behind, and the prompt back at once: how a process that imports vLLM ends.

- `throwaway_paths` points the temp files and caches vLLM and torch write (vLLM's model-info cache in
  ~/.cache/vllm, torch's `torchinductor_<user>`, a server's ZMQ sockets in $TMPDIR) into one folder the
  caller removes. A cache whose variable the user set stays where they put it.
- SIGTERM (a `timeout`, a CI runner) is answered as Ctrl-C is (`raise_on_sigterm`), so every `finally`
  runs; the process ends with one line and exit 143.
- After importing vLLM the interpreter's own teardown (finalising modules; no thread is left and the
  atexit handlers take ~0.1 s) takes 3-16 s. `exit_now` flushes stdout/stderr, runs the atexit handlers
  (logging's close, multiprocessing's joins, tempfile's and the caller's clean-ups), flushes again and
  ends the process with `os._exit`, skipping only that finalisation.

Stdlib only, importing neither kvdoctor nor vLLM: kvdoctor's console script uses it (`cli/teardown.py`) and
the exported scripts embed its text (`compat.inline_portable`).
"""

import atexit
import contextlib
import os
import signal
import sys
import traceback
from collections.abc import Callable, MutableMapping
from types import FrameType

CACHES = ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
RPC_ENV = "VLLM_RPC_BASE_PATH"  # where vLLM's API server and engine core bind their ZMQ IPC sockets
SOCKET_PATH_MAX = 107  # sun_path: a longer socket path cannot be bound (a longer base keeps vLLM's default)
TERMINATED_EXIT = 128 + signal.SIGTERM  # what a shell reports for a process SIGTERM ended
INTERRUPTED_EXIT = 130  # 128 + SIGINT


class Terminated(BaseException):
    """SIGTERM, raised where the process is. A BaseException, as KeyboardInterrupt is: an `except Exception`
    does not swallow it, and every `finally` on the way out runs."""


_terminated = False  # a SIGTERM arrived: kept, in case a library's handler swallowed its `Terminated`


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    global _terminated
    _terminated = True
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: a second SIGTERM must not cut the clean-up short
    raise Terminated


def raise_if_terminated() -> None:
    """Raise `Terminated` again if a SIGTERM arrived: its first `Terminated` can land inside a library that
    catches it (measured once at load ~10: SIGTERM during vLLM's config parsing ended in vLLM's "Error parsing
    config ..., retrying" and the run went on to its verdict, exit 1). Called between engine steps and before
    the process ends, so the run still stops and exits 143."""
    if _terminated:
        raise Terminated


def sigterm_arrived() -> bool:
    """Whether a SIGTERM arrived (its `Terminated` may have been swallowed on the way)."""
    return _terminated


def raise_on_sigterm() -> None:
    """From now on SIGTERM raises `Terminated` (in the main thread; elsewhere signals are the caller's)."""
    with contextlib.suppress(ValueError):
        signal.signal(signal.SIGTERM, _raise_terminated)


def run_main(main: Callable[[], object]) -> int:
    """`main()`'s exit status, with Python's own report of an exception escaping it (exit 1), one line for
    Ctrl-C (130) and SIGTERM (143)."""
    try:
        code = main()
    except SystemExit as exc:
        code = exc.code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return INTERRUPTED_EXIT
    except Terminated:
        print("terminated (SIGTERM)", file=sys.stderr)
        return TERMINATED_EXIT
    except BaseException:  # what escaped main(), reported as Python reports it
        traceback.print_exc()
        return 1
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)  # sys.exit("message"), as Python prints it
    return 1


def throwaway_paths(folder: str, env: MutableMapping[str, str], temp: bool = True) -> None:
    """Point `env`'s caches (VLLM_CACHE_ROOT, TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR, unless set), vLLM's
    socket folder (VLLM_RPC_BASE_PATH, where a socket path fits) and, with `temp`, TMPDIR into `folder`."""
    for name in CACHES:
        if not env.get(name):
            env[name] = os.path.join(folder, name.lower())
    if not env.get(RPC_ENV) and len(folder) + 1 + 36 <= SOCKET_PATH_MAX:  # vLLM binds `<base>/<uuid4>`
        env[RPC_ENV] = folder
    if temp:
        env["TMPDIR"] = folder


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing more can be written anyway
            stream.flush()


def exit_now(code: int) -> None:
    """Flush, run the atexit handlers, flush again, and end the process at once with `code`."""
    with contextlib.suppress(ValueError):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the process is ending: nothing left to stop
    _flush()
    try:
        atexit._run_exitfuncs()
    finally:
        _flush()
        os._exit(code)
