"""Run a `kvdoctor` command in this process, through an injected `streams.Environment`.

A `run_cli` subprocess pays a fresh vLLM import (6+ s, far more under load); here the
command runs on the test process's vLLM, imported once. The command reads its streams,
terminals, columns, variables and command line from the `Environment` it is given
(`kvdoctor.cli.streams`); `sys.stdin/stdout/stderr`, `os.environ` and the working
directory are swapped too for what the CLI does not own (click's help, vLLM's and
kvdoctor's application code reading a variable), and put back after (the variables `env`
named; those the run set itself, e.g. kvdoctor's quiet-import defaults, stay, as they
would for the rest of a process). Tests that run vLLM take the `api` fixture first, so
vLLM's import (and its chatter) happens once, outside any command's captured streams.

Keep `run_cli` (a real process) where the process itself is under test: pipes and exit
statuses, /dev/full, signals, what is imported at start, the console script, teardown.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from collections.abc import Mapping

from .conftest import ROOT


def invoke(*args: str, env: Mapping[str, str] | None = None, stdin: str | bytes | None = None,
           stdout_isatty: bool = False, stderr_isatty: bool = False, columns: int | None = None,
           timeout: int | None = None) -> subprocess.CompletedProcess:
    """`kvdoctor ARGS` in-process: a `CompletedProcess` (returncode, stdout, stderr) as `run_cli`
    returns. `env` adds variables (as `run_cli`'s does); `timeout` is accepted for `run_cli`'s
    signature and not enforced (nothing to kill in-process)."""
    from kvdoctor.cli import streams
    from kvdoctor.cli.app import app

    data = stdin.encode() if isinstance(stdin, str) else (stdin or b"")
    stdin_stream = io.TextIOWrapper(io.BytesIO(data), encoding="utf-8")
    out, err = io.StringIO(), io.StringIO()
    variables = {**os.environ, **(env or {})}
    environment = streams.Environment(stdin=stdin_stream, stdout=out, stderr=err, stdin_isatty=False,
                                      stdout_isatty=stdout_isatty, stderr_isatty=stderr_isatty, columns=columns,
                                      env=variables, argv=["kvdoctor", *args])
    saved_streams = sys.stdin, sys.stdout, sys.stderr
    saved_environ = {name: os.environ.get(name) for name in (env or {})}
    saved_cwd = os.getcwd()
    try:
        os.environ.update(env or {})
        os.chdir(ROOT)
        sys.stdin, sys.stdout, sys.stderr = stdin_stream, out, err
        with streams.use(environment):
            try:
                code = app(args=list(args), prog_name="kvdoctor", standalone_mode=False)
            except SystemExit as exc:
                code = exc.code
    finally:
        sys.stdin, sys.stdout, sys.stderr = saved_streams
        os.chdir(saved_cwd)
        for name, value in saved_environ.items():  # only what `env` set: a variable the code set stays, as
            if value is None:                       # kvdoctor's own quiet-import defaults must
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    code = 0 if code is None else code
    if not isinstance(code, int):
        err.write(f"{code}\n")
        code = 1
    return subprocess.CompletedProcess(["kvdoctor", *args], code, out.getvalue(), err.getvalue())
