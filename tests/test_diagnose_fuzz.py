"""Fuzzed logs through the reader and the whole `diagnose` command: never a traceback from kvdoctor."""

from __future__ import annotations

import io

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvdoctor.diagnose.match import match_crash
from kvdoctor.diagnose.pyrepr import parse_repr
from kvdoctor.diagnose.reader import read_stream
from kvdoctor.diagnose.redact import redact_serve_args
from kvdoctor.engine.serve_args import setup_overrides_from_serve_args
from kvdoctor.recipes.builtins import all_builtins

from .cli_runner import invoke
from .test_diagnose import SYNTHETIC

RECIPES = all_builtins()
LINES = SYNTHETIC.encode().splitlines(keepends=True)
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _through_everything(data: bytes) -> None:
    summary = read_stream(io.BytesIO(data), "fuzz")
    match_crash(summary.crash, RECIPES)
    setup_overrides_from_serve_args(summary.serve_args)
    redact_serve_args(summary.serve_args)


@FUZZ
@given(st.binary(max_size=4000))
def test_random_bytes(data):
    _through_everything(data)


@FUZZ
@given(st.integers(0, len(LINES)), st.integers(0, 200), st.lists(st.integers(0, len(LINES) - 1), max_size=6),
       st.binary(max_size=50))
def test_truncated_and_shuffled_tracebacks(cut, cut_chars, dropped, junk):
    lines = [line for i, line in enumerate(LINES[:cut]) if i not in dropped]
    data = b"".join(lines)
    data = data[: max(0, len(data) - cut_chars)] + junk
    _through_everything(data)


@FUZZ
@given(st.text(alphabet=st.sampled_from(list("{}[]()<>'\"\\:,=.- aZ_09\n")), max_size=400))
@example("0:'")  # found by this test: a non-string key reached the secret-key regex
@example("0: 1, 1.5: {'api_key': 'x'}, None: ''}")
def test_args_text(text):
    value = parse_repr("{" + text)
    redact_serve_args(value if isinstance(value, dict) else {})
    setup_overrides_from_serve_args(value if isinstance(value, dict) else {})


@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=2000))
def test_cli_on_random_bytes(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("fuzz") / "log"
    path.write_bytes(data)
    result = invoke("diagnose", str(path), "--no-run")
    assert result.returncode in (0, 2, 7), result.stderr  # 7: what it read looks like a crash no bug matches
    assert "Traceback" not in result.stdout + result.stderr
