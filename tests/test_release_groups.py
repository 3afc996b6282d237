"""The supported range and release list have one definition (kvdoctor.releases); the
files that cannot import it (pyproject, README, CI) must say the same. No vLLM needed."""

from __future__ import annotations

import re
import tomllib

from kvdoctor import releases
from tests.conftest import ROOT

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_vllm_extra_states_the_supported_range():
    assert PYPROJECT["project"]["optional-dependencies"]["vllm"] == [f"vllm{releases.SUPPORTED_RANGE_TEXT}"]


def test_one_conflicting_dependency_group_per_known_release():
    groups = {name: deps for name, deps in PYPROJECT["dependency-groups"].items() if name.startswith("vllm-")}
    assert groups == {releases.dependency_group(r): [f"vllm=={r}"] for r in releases.KNOWN_RELEASES}
    (conflict,) = PYPROJECT["tool"]["uv"]["conflicts"]
    assert sorted(item["group"] for item in conflict) == sorted(groups)
    assert PYPROJECT["tool"]["uv"]["default-groups"] == ["dev", releases.dependency_group(releases.KNOWN_RELEASES[0])]


def test_known_releases_are_ordered_and_in_range():
    versions = [releases.release_tuple(r) for r in releases.KNOWN_RELEASES]
    assert versions == sorted(set(versions))
    assert all(releases.in_supported_range(v) for v in versions)
    assert versions[0] == releases.SUPPORTED_MIN
    assert releases.KNOWN_RELEASES[-1] == releases.NEWEST_MEASURED


def test_readme_and_help_state_the_same_range():
    readme = (ROOT / "README.md").read_text()
    stated = set(re.findall(r">=\d+\.\d+\.\d+(?:,<\d+\.\d+(?:\.\d+)?)?", readme))
    assert stated == {releases.SUPPORTED_RANGE_TEXT}
    from kvdoctor.cli.app import EXIT_CODES_HELP

    assert releases.SUPPORTED_RANGE_TEXT in EXIT_CODES_HELP


def test_ci_runs_every_known_release():
    """.ci/run loops over kvdoctor.releases.KNOWN_RELEASES and runs the full suite on the oldest,
    the newest and at least one release between them (issue 9)."""
    ci = (ROOT / ".ci" / "run").read_text()
    assert "from kvdoctor.releases import KNOWN_RELEASES" in ci
    (full,) = re.findall(r'^FULL_SUITE="([^"]+)"', ci, flags=re.M)
    full = full.split()
    assert set(full) <= set(releases.KNOWN_RELEASES)
    assert releases.KNOWN_RELEASES[0] in full and releases.KNOWN_RELEASES[-1] in full
    assert set(full) & set(releases.KNOWN_RELEASES[1:-1]), "no middle release runs the full suite"
