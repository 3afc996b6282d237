"""The vLLM releases kvdoctor supports and was measured on: the one definition of both.

Supported is everything from `SUPPORTED_MIN` on: a release newer than the newest measured one
runs with a one-line note, and the adapter's feature probes (not this number) decide whether it
works (`kvdoctor.engine.compat.probes`). `compat`, `--help`, `kvdoctor matrix` and the
release-outcomes data read these from here; README and pyproject (which cannot import it) are
checked against it by tests/test_release_groups.py. Importing this module is free (no vLLM).
"""

from __future__ import annotations

SUPPORTED_MIN = (0, 26, 0)

# Every vLLM release kvdoctor was measured on, oldest first. `kvdoctor matrix` and CI run these;
# pyproject has one dependency group per entry.
KNOWN_RELEASES = (
    "0.26.0", "0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0",
)


def _text(version: tuple[int, int, int], drop_zero_patch: bool) -> str:
    major, minor, patch = version
    return f"{major}.{minor}" if drop_zero_patch and patch == 0 else f"{major}.{minor}.{patch}"


NEWEST_MEASURED = KNOWN_RELEASES[-1]
SUPPORTED_RANGE_TEXT = f">={_text(SUPPORTED_MIN, False)}"


def release_tuple(release: str) -> tuple[int, int, int]:
    """'0.27.1' -> (0, 27, 1); only plain X.Y.Z release names."""
    major, minor, patch = (int(part) for part in release.split("."))
    return major, minor, patch


def in_supported_range(version: tuple[int, int, int]) -> bool:
    return tuple(version) >= SUPPORTED_MIN


def short_name(release: str) -> str:
    """'0.27.0' -> '0.27', '0.27.1' -> '0.27.1': how the repository names a release's environment."""
    return _text(release_tuple(release), True)


def dependency_group(release: str) -> str:
    """pyproject's dependency group for a release: 'vllm-0-27', 'vllm-0-27-1'."""
    return "vllm-" + short_name(release).replace(".", "-")


def project_env_name(release: str) -> str:
    """The repository's environment folder for a release (CI and the README use these)."""
    return ".venv-vllm-" + short_name(release)
