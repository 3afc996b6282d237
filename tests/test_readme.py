"""The README's examples are real output: each is rendered from a real run at 80 columns.

Each generated block sits between `<!-- example: NAME -->` and `<!-- /example -->`
in README.md or docs/commands.md. When the output changes on purpose, regenerate them with

    KVDOCTOR_UPDATE_README=1 uv run pytest tests/test_readme.py

and review the diff. The README shows vLLM 0.26.0 (the default environment); on
other releases the comparison is skipped (their output differs by design).
"""

from __future__ import annotations

import io
import os
import re

import pytest

from kvdoctor.engine.overrides import Overrides

from .conftest import ROOT, run_cli

README = ROOT / "README.md"
COMMANDS_DOC = ROOT / "docs" / "commands.md"
WIDTH = 80
BLOCK = re.compile(r"(<!-- example: (?P<name>[^>]+?) -->\n)(?P<body>.*?)(<!-- /example -->)", re.S)


def _render(renderables) -> str:
    from rich.console import Console

    console = Console(width=WIDTH, record=True, file=io.StringIO(), color_system=None, highlight=False,
                      soft_wrap=False)
    for item in renderables:
        console.print(item)
    return "\n".join(line.rstrip() for line in console.export_text().splitlines())


def _cli_defaults() -> Overrides:
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
            + _render([*timeline_renderables(report.results[0], 6), verdict_table(report)]))


def _audit():
    """The session's one audit (tests/recipe_runs.cli_audit): it serves both examples and
    tests/test_release_outcomes.py."""
    from .recipe_runs import cli_audit

    return cli_audit()


def example_audit() -> str:
    from kvdoctor.report.tables import audit_renderables

    return "$ kvdoctor audit\n" + _render(audit_renderables(_audit()))


def example_audit_verbose() -> str:
    from kvdoctor.report.tables import audit_renderables

    return "$ kvdoctor audit --verbose\n" + _render(audit_renderables(_audit(), verbose=True))


def example_usage_error() -> str:
    args = ["repro", "queued-abort", "--block-size", "0"]
    proc = run_cli(*args)
    return f"$ kvdoctor {' '.join(args)}; echo $?\n{proc.stderr.strip()}\n{proc.returncode}"


PAGES = {
    README: {"audit": example_audit, "usage error": example_usage_error},
    COMMANDS_DOC: {"repro queued-abort": example_repro_queued_abort,
                   "inspect queued-abort --step 6": example_inspect_queued_abort_step_6,
                   "audit --verbose": example_audit_verbose},
}


@pytest.mark.parametrize("page", list(PAGES), ids=lambda p: p.name)
def test_readme_examples_are_real_output(api, page):
    if api.version[:2] != (0, 26):
        pytest.skip(f"the README shows vLLM 0.26.0 output, not {api.version_text}")
    examples = PAGES[page]
    text = page.read_text()
    found = {m.group("name"): m for m in BLOCK.finditer(text)}
    assert set(found) == set(examples), f"{page.name} example markers: {sorted(found)}"
    rendered = {name: "```\n" + examples[name]() + "\n```\n" for name in examples}
    if os.environ.get("KVDOCTOR_UPDATE_README") == "1":
        page.write_text(BLOCK.sub(lambda m: m.group(1) + rendered[m.group("name")] + m.group(4), text))
        return
    for name, match in found.items():
        assert match.group("body") == rendered[name], (
            f"{page.name} example {name!r} differs from a real run; regenerate with "
            f"KVDOCTOR_UPDATE_README=1 uv run pytest tests/test_readme.py")


# -- a README a newcomer reads in two minutes (issue 28); no vLLM needed ---------------------------

def test_readme_is_short_and_starts_with_the_commands_and_a_real_output():
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines"
    head = "\n".join(lines[:60])
    assert "pip install uv && uv run kvdoctor repro queued-abort" in head
    assert "uv run pytest" in head
    example = BLOCK.search(head + "\n")
    assert example is not None and example.group("body").count("\n") >= 5, "a real output in the first 60 lines"


def test_readme_lists_every_command_once_in_one_table_and_links_docs():
    text = README.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `kvdoctor ")]
    commands = {row.split("`")[1].split()[1] for row in rows}
    from typer.main import get_command

    from kvdoctor.cli.app import app

    assert commands == set(get_command(app).commands), rows
    for page in ("docs/commands.md", "docs/recipes.md", "docs/worker.md"):
        assert f"]({page}" in text and (ROOT / page).is_file(), page
    for code in (*range(9), 130):
        assert f"| {code} |" in text
