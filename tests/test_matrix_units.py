"""`kvdoctor matrix` pieces that need no vLLM: release specs, bisection, environment
discovery, the release-outcomes data file and the upgrade hint drawn from it."""

from __future__ import annotations

import math

import pytest

from kvdoctor.errors import ExitStatus, UsageError
from kvdoctor.matrix import data, known
from kvdoctor.matrix.bisect import bisect_releases
from kvdoctor.matrix.envs import EnvironmentBuildError, EnvStore, _why, installed_vllm_release, lent_environments
from kvdoctor.matrix.releases import parse_spec
from kvdoctor.releases import KNOWN_RELEASES
from tests.conftest import run_cli


def test_default_spec_is_every_known_release():
    assert parse_spec(None) == list(KNOWN_RELEASES)


def test_range_is_inclusive_over_known_releases():
    assert parse_spec("0.27.0..0.28.0") == ["0.27.0", "0.27.1", "0.28.0"]
    assert parse_spec("0.26.0..0.26.0") == ["0.26.0"]


def test_list_is_ordered_and_deduplicated():
    assert parse_spec("0.30.0, 0.26.0,0.30.0") == ["0.26.0", "0.30.0"]


@pytest.mark.parametrize("spec, words", [
    ("0.25.0", "outside kvdoctor's supported range"),
    ("0.35.0", "not a vLLM release in range"),  # supported (probes decide), but matrix runs measured ones
    ("0.27.2", "not a vLLM release in range"),
    ("latest", "not a release name"),
    ("0.26", "not a release name"),
    ("0.30.0..0.26.0", "empty"),
    ("0.26.0..0.30.0,0.33.0", "not both"),
    ("0.26.0,,0.27.0", "empty release name"),
])
def test_bad_specs_are_one_line_usage_errors(spec, words):
    with pytest.raises(UsageError, match=words) as info:
        parse_spec(spec)
    assert "\n" not in str(info.value)


def _probe_from(outcomes: dict[str, str], calls: list[str]):
    def probe(release: str) -> str:
        calls.append(release)
        return outcomes[release]
    return probe


@pytest.mark.parametrize("fixed_at", range(1, len(KNOWN_RELEASES)))
def test_bisect_finds_the_first_release_that_stops_reproducing(fixed_at):
    releases = list(KNOWN_RELEASES)
    outcomes = {r: ("reproduced" if i < fixed_at else "not_reproduced") for i, r in enumerate(releases)}
    calls: list[str] = []
    found = bisect_releases("r", releases, _probe_from(outcomes, calls))
    assert (found.last_reproducing, found.first_not_reproducing) == (releases[fixed_at - 1], releases[fixed_at])
    # both ends, then a binary search over the 9 gaps between them: never a release twice
    assert len(calls) == len(set(calls)) <= 2 + math.ceil(math.log2(len(releases) - 1))
    assert len(calls) < len(releases)


def test_bisect_two_releases_tests_both_once():
    calls: list[str] = []
    found = bisect_releases("r", ["0.26.0", "0.27.0"],
                            _probe_from({"0.26.0": "reproduced", "0.27.0": "not_reproduced"}, calls))
    assert (found.first_not_reproducing, found.last_reproducing, calls) == ("0.27.0", "0.26.0", ["0.26.0", "0.27.0"])


def test_bisect_never_reproducing_stops_after_one_test():
    calls: list[str] = []
    found = bisect_releases("r", list(KNOWN_RELEASES), _probe_from(dict.fromkeys(KNOWN_RELEASES, "not_applicable"),
                                                                   calls))
    assert (found.first_not_reproducing, found.last_reproducing, calls) == ("0.26.0", None, ["0.26.0"])


def test_bisect_reproducing_everywhere_tests_the_ends_only():
    calls: list[str] = []
    found = bisect_releases("r", list(KNOWN_RELEASES), _probe_from(dict.fromkeys(KNOWN_RELEASES, "reproduced"), calls))
    assert (found.first_not_reproducing, found.last_reproducing) == (None, "0.34.0")
    assert calls == ["0.26.0", "0.34.0"]


def test_bisect_stops_at_an_inconclusive_release():
    outcomes = {r: "reproduced" for r in KNOWN_RELEASES} | {"0.34.0": "other_failure"}
    found = bisect_releases("r", list(KNOWN_RELEASES), _probe_from(outcomes, []))
    assert found.inconclusive == "0.34.0"
    assert found.first_not_reproducing is None and found.last_reproducing is None


def _fake_env(path, release):
    (path / "bin").mkdir(parents=True)
    (path / "bin" / "python").write_text("")
    (path / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (path / "lib" / "python3.11" / "site-packages" / f"vllm-{release}.dist-info").mkdir(parents=True)


def test_lent_environments_are_found_by_their_installed_vllm(tmp_path):
    _fake_env(tmp_path / ".venv", "0.26.0")
    _fake_env(tmp_path / ".venv-vllm-0.27", "0.27.0")
    (tmp_path / "not-an-env").mkdir()
    assert installed_vllm_release(tmp_path / "not-an-env") is None
    assert lent_environments(tmp_path) == {"0.26.0": tmp_path / ".venv", "0.27.0": tmp_path / ".venv-vllm-0.27"}
    store = EnvStore(root=tmp_path / "cache", env_dir=tmp_path)
    assert store.ready("0.26.0").lent
    assert store.missing(["0.26.0", "0.27.0", "0.30.0"]) == ["0.30.0"]


def test_a_cached_environment_without_its_marker_is_not_ready(tmp_path):
    store = EnvStore(root=tmp_path)
    _fake_env(store.cached_path("0.30.0"), "0.30.0")
    assert store.ready("0.30.0") is None
    (store.cached_path("0.30.0") / ".kvdoctor-env.json").write_text("{}")
    assert store.ready("0.30.0") is not None


def test_no_registry_is_one_line_exit_3(tmp_path, monkeypatch):
    """uv offline with an empty cache: the build fails in one line and leaves nothing behind."""
    monkeypatch.setenv("UV_OFFLINE", "1")
    monkeypatch.setenv("UV_CACHE_DIR", str(tmp_path / "uv-cache"))
    store = EnvStore(root=tmp_path / "envs")
    with pytest.raises(EnvironmentBuildError) as info:
        store.build("0.30.0")
    assert info.value.exit_code == ExitStatus.VLLM_UNAVAILABLE
    assert "\n" not in str(info.value) and "0.30.0" in str(info.value)
    assert list((tmp_path / "envs").iterdir()) == []


def test_registry_errors_are_named():
    stderr = ("error: Failed to fetch: `https://pypi.org/simple/vllm/`\n  Caused by: Request failed after 3 retries\n"
              "  Caused by: error sending request for url (https://pypi.org/simple/vllm/)\n")
    assert _why(stderr).startswith("the package registry cannot be reached")


def test_cli_bad_release_is_exit_2_before_any_environment(tmp_path):
    proc = run_cli("matrix", "queued-abort", "--vllm", "0.25.0",
                   env={"KVDOCTOR_CACHE_DIR": str(tmp_path), "KVDOCTOR_BYTECODE_CACHE": "0"})  # environments only
    assert proc.returncode == ExitStatus.USAGE
    assert proc.stderr.strip().count("\n") == 0 and "outside kvdoctor's supported range" in proc.stderr
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("args, words", [
    ((), "give one or more RECIPEs"),
    (("no-such-recipe", "--audit"), "--audit runs built-in recipes; not one: no-such-recipe"),
    (("no-such-recipe",), "unknown recipe"),
    (("queued-abort", "--write-data", "x.toml"), "--write-data"),
    (("--audit", "--report", "/no/such/dir/r.md"), "no such directory"),
])
def test_cli_usage_errors(tmp_path, args, words):
    proc = run_cli("matrix", *args, env={"KVDOCTOR_CACHE_DIR": str(tmp_path), "KVDOCTOR_BYTECODE_CACHE": "0"})
    assert proc.returncode == ExitStatus.USAGE, proc.stderr
    assert words in proc.stderr and proc.stderr.strip().count("\n") == 0


_COVERAGE = {"reproduced": "reached 1x: fired", "not_reproduced": "reached 2x: held"}


def _rows(*triples, coverage=None):
    return [data.OutcomeRow(release=r, recipe=n, bug="K1", outcome=o, failure_site="AssertionError at x.py:1 in f"
                            if o == "reproduced" else None, measured_on="2026-12-02", kvdoctor_version="0.1.0",
                            coverage=(_COVERAGE if coverage is None else coverage).get(o))
            for r, n, o in triples]


def test_data_file_round_trips_and_merges(tmp_path):
    path = tmp_path / "outcomes.toml"
    old = _rows(("0.26.0", "a", "reproduced"), ("0.27.0", "a", "reproduced"))
    path.write_text(data.render(old))
    assert data.load(path) == old
    merged = data.merge(data.load(path), _rows(("0.27.0", "a", "not_reproduced")))
    assert sorted((r.release, r.outcome) for r in merged) == [("0.26.0", "reproduced"), ("0.27.0", "not_reproduced")]



def test_an_audit_limited_to_named_recipes_replaces_only_their_rows():
    """`matrix --audit RECIPE... --write-data`: the release's other rows stay as they were."""
    old = _rows(("0.27.0", "a", "reproduced"), ("0.27.0", "b", "reproduced"), ("0.28.0", "a", "reproduced"))
    merged = data.merge(old, _rows(("0.27.0", "a", "not_reproduced")), recipes=["a"])
    assert sorted((r.release, r.recipe, r.outcome) for r in merged) == [
        ("0.27.0", "a", "not_reproduced"), ("0.27.0", "b", "reproduced"), ("0.28.0", "a", "reproduced")]


def test_optional_dimensions_round_trip_and_absent_means_not_measured(tmp_path):
    """fixed_logic_outcome / async_* are optional keys: written when measured, None (not measured) when
    absent, so a file from before them still loads, and a schema-1 reader ignores them."""
    import dataclasses

    path = tmp_path / "outcomes.toml"
    (old,) = _rows(("0.26.0", "a", "reproduced"))
    new = dataclasses.replace(old, recipe="b", fixed_logic_outcome="not_reproduced", async_outcome="untested",
                              async_fixed_logic_outcome="untested")
    path.write_text(data.render([old, new]))
    text = path.read_text()
    assert text.count("fixed_logic_outcome = ") == 2 and text.count("async_outcome = ") == 1
    assert data.load(path) == [old, new]
    assert (old.outcome_for("fixed"), old.outcome_for("installed", async_scheduling=True)) == (None, None)
    assert [new.outcome_for(logic, mode) for logic in ("installed", "fixed") for mode in (False, True)] == [
        "reproduced", "untested", "not_reproduced", "untested"]
    assert new.outcome_for("unpatched") is None  # not a dimension the audit measures


def test_the_async_audit_lands_beside_the_sync_cells():
    """`matrix --audit --write-data` audits each release again under --async-scheduling: its outcomes join
    the sync cells' rows; a broken async audit leaves them unmeasured, the sync row intact."""
    from kvdoctor.matrix.app import MatrixReport, _add_async, data_rows
    from kvdoctor.matrix.runner import KVDOCTOR_FAILURE, Cell

    report = MatrixReport(releases=["0.26.0"], recipes=["a", "b"], audit=True, bisect=False)
    for name in ("a", "b"):
        report.cells[("0.26.0", name)] = Cell("0.26.0", name, "reproduced", bug="K1", failure_site="x",
                                              fixed_logic_outcome="not_reproduced", coverage="reached 1x: fired")
    _add_async(report, "0.26.0", [Cell("0.26.0", "a", "untested", fixed_logic_outcome="untested"),
                                  Cell("0.26.0", "b", KVDOCTOR_FAILURE)])
    rows = {row.recipe: row for row in data_rows(report)}
    assert (rows["a"].outcome, rows["a"].fixed_logic_outcome, rows["a"].async_outcome,
            rows["a"].async_fixed_logic_outcome) == ("reproduced", "not_reproduced", "untested", "untested")
    assert rows["b"].outcome == "reproduced" and rows["b"].async_outcome is None


def test_hint_names_the_release_after_the_last_reproducing_one(tmp_path):
    path = tmp_path / "outcomes.toml"
    path.write_text(data.render(_rows(("0.26.0", "a", "reproduced"), ("0.27.0", "a", "not_reproduced"),
                                      ("0.28.0", "a", "not_reproduced"), ("0.26.0", "b", "reproduced"),
                                      ("0.34.0", "b", "reproduced"), ("0.26.0", "c", "not_reproduced"),
                                      ("0.26.0", "d", "reproduced"), ("0.27.0", "d", "other_failure"))))
    assert known.fixed_in("a", path) == ("0.27.0", "0.26.0", "2026-12-02", "0.1.0")
    assert known.fixed_in("b", path) is None  # still reproduces on the newest measured
    assert known.fixed_in("c", path) is None  # never reproduced
    assert known.fixed_in("d", path) is None  # no honest answer after it
    assert known.fixed_in("never-measured", path) is None


def test_hint_only_where_the_next_release_reached_the_site_and_held(tmp_path):
    """"Fixed in" is earned: a not_reproduced whose run never reached the crash site (or measured no
    coverage) names no release; a site gone from the release's source does."""
    path = tmp_path / "outcomes.toml"
    rows = (_rows(("0.26.0", "a", "reproduced"))
            + _rows(("0.27.0", "a", "not_reproduced"), coverage={"not_reproduced": "not reached: x"})
            + _rows(("0.26.0", "b", "reproduced"))
            + _rows(("0.27.0", "b", "not_reproduced"), coverage={"not_reproduced": "site gone: f has no x"})
            + _rows(("0.26.0", "c", "reproduced"))
            + _rows(("0.27.0", "c", "not_reproduced"), coverage={}))
    path.write_text(data.render(rows))
    assert sorted(data.load(path), key=repr) == sorted(rows, key=repr)
    assert known.fixed_in("a", path) is None
    assert known.fixed_in("b", path).release == "0.27.0"
    assert known.fixed_in("c", path) is None


def test_the_shipped_data_file_loads_and_names_known_releases():
    rows = data.load()
    assert all(r.release in KNOWN_RELEASES for r in rows)
    assert len({(r.release, r.recipe) for r in rows}) == len(rows)


def test_shipped_data_hints_where_queued_abort_stops():
    """The measured 0.26.0 -> 0.27.0 fix of K1 (PR #49146) shows as the hint repro/audit print."""
    measured = {r.release for r in data.load() if r.recipe == "queued-abort"}
    if not {"0.26.0", "0.27.0"} <= measured:
        pytest.skip("queued-abort not measured on both 0.26.0 and 0.27.0")
    hint = known.fixed_in("queued-abort")
    assert (hint.release, hint.last_reproducing) == ("0.27.0", "0.26.0")
    from kvdoctor.report.next_steps import fixed_in_line

    assert fixed_in_line(hint).startswith("vLLM 0.27.0 and later (last reproducing: 0.26.0;")
