"""Where a failure fired: the statement a traceback names, the same on every Python (no vLLM import)."""

from __future__ import annotations

import pytest

from kvdoctor.observe.failure import describe_exception, statement_source

SOURCE = """\
def store(pending, window, per_chunk):
    if pending:
        assert (
            pending
            <= window
            * per_chunk
        )
    total = pending + 1
    return total
"""


@pytest.fixture
def vllm_file(tmp_path):
    """A module whose path reads as vLLM's (`/vllm/` in it), run from its file as vLLM's code is."""
    path = tmp_path / "vllm" / "scheduler.py"
    path.parent.mkdir()
    path.write_text(SOURCE)
    namespace: dict = {}
    exec(compile(SOURCE, str(path), "exec"), namespace)
    return path, namespace["store"]


def test_a_multi_line_assert_is_shown_whole_from_any_of_its_lines(vllm_file):
    """Python 3.12 names a multi-line assert's `assert (` line, 3.11 and 3.13 its condition's (measured by a
    helper: K3's and K7's recipes, whose `contains` is in the condition, ended other_failure on 3.12)."""
    path, _ = vllm_file
    whole = "assert (pending <= window * per_chunk)"
    for line in range(3, 8):
        assert statement_source(str(path), line, "whatever the traceback says") == whole
    # a one-line statement keeps the traceback's text; a compound statement gives its header only
    assert statement_source(str(path), 8, "    total = pending + 1\n") == "total = pending + 1"
    assert statement_source(str(path), 2, "    if pending:") == "if pending:"


def test_a_bare_multi_line_assert_is_described_by_its_whole_condition(vllm_file):
    _, store = vllm_file
    with pytest.raises(AssertionError) as info:
        store(3, 1, 2)
    failure = describe_exception(info.value)
    assert failure.in_vllm and failure.function == "store"
    assert failure.code == failure.message == "assert (pending <= window * per_chunk)"
    assert failure.vllm_frames[-1].code == failure.code


def test_an_unreadable_file_keeps_the_tracebacks_line(tmp_path):
    assert statement_source(str(tmp_path / "gone.py"), 4, "  x = 1 ") == "x = 1"
    assert statement_source("<string>", None, None) == ""
