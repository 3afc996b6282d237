"""What is installed here, read from distribution metadata without importing anything: the one
"installed version or None", and the environment a bug report names (no paths, no secrets)."""

from __future__ import annotations

import platform
from importlib import metadata

from kvdoctor import __version__


def distribution_version(name: str) -> str | None:
    """The installed distribution's version from its metadata (nothing imported); None when absent."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def vllm_version() -> str | None:
    """The installed vLLM's version from its metadata, without importing it."""
    return distribution_version("vllm")


def environment() -> dict[str, str | None]:
    """What a bug report needs about this machine: no paths, no secrets."""
    return {
        "kvdoctor": __version__,
        "vllm": distribution_version("vllm"),
        "torch": distribution_version("torch"),
        "python": platform.python_version(),
        "os": f"{platform.system()} {platform.release()} ({platform.machine()})",
    }
