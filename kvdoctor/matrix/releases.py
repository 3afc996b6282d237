"""Which vLLM releases a `--vllm` spec names: a list (`0.26.0,0.30.0`) or an inclusive range
(`0.26.0..0.34.0`) over the known releases in kvdoctor's supported range."""

from __future__ import annotations

import re

from kvdoctor.errors import UsageError
from kvdoctor.releases import KNOWN_RELEASES, SUPPORTED_RANGE_TEXT, in_supported_range, release_tuple

_RELEASE = re.compile(r"^\d+\.\d+\.\d+$")


def check_release(name: str) -> str:
    """A release name kvdoctor can build an environment for, or a one-line UsageError."""
    name = name.strip()
    if not _RELEASE.match(name):
        raise UsageError(f"--vllm: {name!r} is not a release name like 0.27.1")
    if not in_supported_range(release_tuple(name)):
        raise UsageError(f"--vllm: vLLM {name} is outside kvdoctor's supported range {SUPPORTED_RANGE_TEXT}")
    if name not in KNOWN_RELEASES:
        raise UsageError(f"--vllm: {name} is not a vLLM release in range; known: {', '.join(KNOWN_RELEASES)}")
    return name


def parse_spec(spec: str | None) -> list[str]:
    """Releases named by `spec`, oldest first, without repeats; every known release when None."""
    if spec is None or not spec.strip():
        return list(KNOWN_RELEASES)
    spec = spec.strip()
    if ".." in spec:
        if "," in spec:
            raise UsageError("--vllm: give either a list (0.26.0,0.30.0) or a range (0.26.0..0.34.0), not both")
        first, _, last = spec.partition("..")
        first, last = check_release(first), check_release(last)
        lo, hi = KNOWN_RELEASES.index(first), KNOWN_RELEASES.index(last)
        if lo > hi:
            raise UsageError(f"--vllm: the range {spec} is empty (write the older release first)")
        return list(KNOWN_RELEASES[lo:hi + 1])
    names = [part for part in spec.split(",")]
    if any(not part.strip() for part in names):
        raise UsageError(f"--vllm: {spec!r} has an empty release name")
    chosen = {check_release(part) for part in names}
    return [r for r in KNOWN_RELEASES if r in chosen]
