"""The README's examples are real output: each is rendered from a real run at 80 columns.

Each generated block sits between `<!-- example: NAME -->` and `<!-- /example -->`
in README.md. When the output changes on purpose, regenerate them with

    KVDOCTOR_UPDATE_README=1 uv run pytest tests/test_readme.py

and review the diff. The README shows vLLM 0.26.0 (the default environment); on
other releases the comparison is skipped (their output differs by design).
"""

from __future__ import annotations

import io
import os
import re

import pytest

from .conftest import ROOT, run_cli

README = ROOT / "README.md"
WIDTH = 80
BLOCK = re.compile(r"(<!-- example: (?P<name>[^>]+?) -->\n)(?P<body>.*?)(<!-- /example -->)", re.S)


def _render(renderables) -> str:
    from rich.console import Console

    console = Console(width=WIDTH, record=True, file=io.StringIO(), color_system=None, highlight=False,
                      soft_wrap=False)
    for item in renderables:
        console.print(item)
    return "\n".join(line.rstrip() for line in console.export_text().splitlines())


def _cli_defaults() -> dict:
    """The overrides a command line without flags gives (the default worker: vLLM's)."""
    from kvdoctor.cli.options import worker_overrides

    return worker_overrides(None, None, None)


def _repro(name: str, logic: str = "all"):
    from kvdoctor import app
    from kvdoctor.cli.options import DEFAULT_WORKER

    return app.repro(name, _cli_defaults(), logic, record_timeline=True, command=f"kvdoctor repro {name}",
                     default_worker=DEFAULT_WORKER)


def example_repro_queued_abort() -> str:
    from kvdoctor.report.tables import repro_renderables

    return "$ kvdoctor repro queued-abort\n" + _render(repro_renderables(_repro("queued-abort")))


def example_inspect_queued_abort_step_6() -> str:
    from kvdoctor.report.tables import timeline_renderables, verdict_table

    report = _repro("queued-abort", "installed")
    return ("$ kvdoctor inspect queued-abort --step 6\n"
            + _render(timeline_renderables(report.results[0], 6) + [verdict_table(report)]))


def example_audit() -> str:
    from kvdoctor import app
    from kvdoctor.cli.options import DEFAULT_WORKER
    from kvdoctor.report.tables import audit_renderables

    report = app.audit(command="kvdoctor audit", overrides=_cli_defaults(), default_worker=DEFAULT_WORKER)
    return "$ kvdoctor audit\n" + _render(audit_renderables(report))


def example_usage_error() -> str:
    args = ["repro", "queued-abort", "--block-size", "0"]
    proc = run_cli(*args)
    return f"$ kvdoctor {' '.join(args)}; echo $?\n{proc.stderr.strip()}\n{proc.returncode}"


EXAMPLES = {
    "repro queued-abort": example_repro_queued_abort,
    "inspect queued-abort --step 6": example_inspect_queued_abort_step_6,
    "audit": example_audit,
    "usage error": example_usage_error,
}


def test_readme_examples_are_real_output(api):
    if api.version[:2] != (0, 26):
        pytest.skip(f"the README shows vLLM 0.26.0 output, not {api.version_text}")
    text = README.read_text()
    found = {m.group("name"): m for m in BLOCK.finditer(text)}
    assert set(found) == set(EXAMPLES), f"README example markers: {sorted(found)}"
    rendered = {name: "```\n" + EXAMPLES[name]() + "\n```\n" for name in EXAMPLES}
    if os.environ.get("KVDOCTOR_UPDATE_README") == "1":
        README.write_text(BLOCK.sub(lambda m: m.group(1) + rendered[m.group("name")] + m.group(4), text))
        return
    for name, match in found.items():
        assert match.group("body") == rendered[name], (
            f"README example {name!r} differs from a real run; regenerate with "
            f"KVDOCTOR_UPDATE_README=1 uv run pytest tests/test_readme.py")
