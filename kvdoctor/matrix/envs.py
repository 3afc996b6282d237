"""One Python environment per vLLM release, made and kept by uv.

`kvdoctor matrix` needs a vLLM of each release it asks. It builds them with the `uv`
binary that the `uv` package on PyPI ships (a dependency of kvdoctor), caches them under
`$KVDOCTOR_CACHE_DIR/envs` (default `~/.cache/kvdoctor/envs`), and reuses them across
runs. An environment holds vLLM (FlashInfer overridden away: vLLM 0.34.0 pins a
`flashinfer-python` the scheduler side never imports and some indexes do not serve),
typer and rich; kvdoctor itself comes from its own source through PYTHONPATH (see
`runner`), so the environment never goes stale when kvdoctor changes.

Existing environments can be lent with `--env-dir DIR`: any folder directly under DIR
that is a virtual environment with the wanted vLLM release installed (the repository's
`.venv`, `.venv-vllm-0.27`, ...) is used as is, and never modified.

An environment is built in a scratch folder and renamed into place only when the
install succeeded, so an interrupted or failed build leaves nothing half-made behind.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from kvdoctor.errors import VllmUnavailableError

MARKER = ".kvdoctor-env.json"
# Packages kvdoctor needs next to vLLM (kvdoctor's own dependencies, from pyproject).
RUNTIME_REQUIREMENTS = ("typer>=0.12", "rich>=13.7")
OVERRIDES = ("flashinfer-python; sys_platform == 'never'",)
_NETWORK_WORDS = ("failed to fetch", "not found in the cache", "dns error", "connection refused", "connect error",
                  "network", "timed out", "offline", "error sending request", "tcp connect", "could not connect")


class EnvironmentBuildError(VllmUnavailableError):
    """An environment for a release could not be made (no registry, a failed install)."""

    kind = "environment_error"


@dataclass(frozen=True)
class ReleaseEnv:
    release: str
    path: Path
    lent: bool  # from --env-dir: used as found, never rebuilt

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"


def cache_root() -> Path:
    base = os.environ.get("KVDOCTOR_CACHE_DIR")
    root = Path(base).expanduser() if base else Path.home() / ".cache" / "kvdoctor"
    return root / "envs"


def installed_vllm_release(env: Path) -> str | None:
    """The vLLM release a virtual environment holds, read from its dist-info (no import)."""
    if not (env / "pyvenv.cfg").is_file() or not (env / "bin" / "python").exists():
        return None
    for info in env.glob("lib/python*/site-packages/vllm-*.dist-info"):
        return info.name[len("vllm-"):-len(".dist-info")]
    return None


def lent_environments(env_dir: Path) -> dict[str, Path]:
    """Release -> environment folder, for the virtual environments directly under `env_dir`."""
    found: dict[str, Path] = {}
    if not env_dir.is_dir():
        return found
    for child in sorted(env_dir.iterdir()):
        release = installed_vllm_release(child) if child.is_dir() else None
        if release is not None:
            found.setdefault(release, child)
    return found


class EnvStore:
    """Finds or builds the environment of each release."""

    def __init__(self, root: Path | None = None, env_dir: Path | None = None) -> None:
        self.root = root or cache_root()
        # absolute, not resolved: a venv's bin/python is a link that must stay the venv's
        self.lent = lent_environments(env_dir.absolute()) if env_dir is not None else {}

    def cached_path(self, release: str) -> Path:
        return self.root / f"vllm-{release}"

    def ready(self, release: str) -> ReleaseEnv | None:
        if release in self.lent:
            return ReleaseEnv(release, self.lent[release], lent=True)
        path = self.cached_path(release)
        if (path / MARKER).is_file() and installed_vllm_release(path) == release:
            return ReleaseEnv(release, path, lent=False)
        return None

    def missing(self, releases: list[str]) -> list[str]:
        return [r for r in releases if self.ready(r) is None]

    def get(self, release: str) -> ReleaseEnv:
        env = self.ready(release)
        return env if env is not None else self.build(release)

    def build(self, release: str) -> ReleaseEnv:
        final = self.cached_path(release)
        scratch = self.root / f".building-vllm-{release}-{os.getpid()}"
        self.root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(scratch, ignore_errors=True)
        started = time.monotonic()
        try:
            uv = _uv_binary()
            _uv(uv, release, ["venv", "--quiet", "--relocatable", "--python", sys.executable, str(scratch)])
            overrides = scratch / "kvdoctor-overrides.txt"
            overrides.write_text("\n".join(OVERRIDES) + "\n")
            _uv(uv, release, ["pip", "install", "--quiet", "--python", str(scratch / "bin" / "python"),
                              "--overrides", str(overrides), f"vllm=={release}", *RUNTIME_REQUIREMENTS])
            (scratch / MARKER).write_text(json.dumps({
                "release": release, "built_seconds": round(time.monotonic() - started, 1),
                "uv": uv, "python": sys.version.split()[0]}) + "\n")
            if final.exists():  # stale (no marker) or built meanwhile by another kvdoctor
                if self.ready(release) is not None:
                    shutil.rmtree(scratch, ignore_errors=True)
                    return ReleaseEnv(release, final, lent=False)
                shutil.rmtree(final)
            scratch.rename(final)
        except BaseException:
            shutil.rmtree(scratch, ignore_errors=True)
            raise
        return ReleaseEnv(release, final, lent=False)


def _uv_binary() -> str:
    try:
        from uv import find_uv_bin
    except ImportError:
        found = shutil.which("uv")
        if found:
            return found
        raise EnvironmentBuildError("kvdoctor matrix needs uv (pip install uv) to build vLLM environments") from None
    return find_uv_bin()


def _uv(uv: str, release: str, args: list[str]) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "UV_PROJECT_ENVIRONMENT")}
    proc = subprocess.run([uv, *args], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise EnvironmentBuildError(f"cannot build the vLLM {release} environment: {_why(proc.stderr)}")


def _why(stderr: str) -> str:
    lines = [line.strip().lstrip("×╰─▶│ ").strip() for line in stderr.splitlines() if line.strip()]
    lines = [line for line in lines if line and not line.startswith("hint:")] or ["uv failed"]
    text = " ".join(lines).lower()
    if any(word in text for word in _NETWORK_WORDS):
        detail = next((line for line in reversed(lines) if any(w in line.lower() for w in _NETWORK_WORDS)), lines[-1])
        return f"the package registry cannot be reached ({detail[:200]})"
    return lines[-1][:300]
