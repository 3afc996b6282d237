"""Random files through the whole CLI: kvdoctor answers with an exit code, never a traceback."""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .cli_runner import invoke
from .conftest import ROOT

BASE = (ROOT / "repros" / "queued-abort.toml").read_text().splitlines()


def _mutations() -> st.SearchStrategy[str]:
    line = st.integers(0, len(BASE) - 1)
    junk = st.text(st.characters(codec="utf-8"), max_size=30)
    values = st.sampled_from(['"x"', "-1", "0", "99999", "true", "[]", "{}", '"B"', '"store"', "3.5"])

    @st.composite
    def mutate(draw) -> str:
        lines = list(BASE)
        for _ in range(draw(st.integers(1, 4))):
            i = draw(line) % len(lines)
            kind = draw(st.sampled_from(["delete", "duplicate", "junk", "value"]))
            if kind == "delete" and len(lines) > 1:
                del lines[i]
            elif kind == "duplicate":
                lines.insert(i, lines[i])
            elif kind == "junk":
                lines[i] = draw(junk)
            elif "=" in lines[i]:
                lines[i] = lines[i].split("=", 1)[0] + "= " + draw(values)
        return "\n".join(lines) + "\n"
    return mutate()


def _invoke(data: bytes):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fuzz.toml"
        path.write_bytes(data)
        return invoke("repro", str(path), "--logic", "installed", "--json")


def _assert_clean(result) -> None:
    """An exception escaping the command fails the test from inside `invoke` (it is not caught there)."""
    assert result.returncode in (0, 1, 2, 3, 4), result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300))
def test_random_bytes(data):
    _assert_clean(_invoke(data))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_mutations())
def test_mutated_recipes_run_or_fail_cleanly(api, text):
    _assert_clean(_invoke(text.encode()))
