"""kvdoctor's own cache directory: what is worth keeping between runs, and nothing of the user's.

vLLM inspects a model class (`LlamaForCausalLM` for kvdoctor's tiny model) in a subprocess that
imports vLLM a second time (6+ s) unless `$VLLM_CACHE_ROOT/modelinfos/` holds the answer, keyed
by the model file's hash. kvdoctor keeps that cache here, one folder per installed vLLM (so
`matrix`'s releases do not overwrite each other's entries), and never in the user's
`~/.cache/vllm`. A `VLLM_CACHE_ROOT` the user set stays theirs.

Where the interpreter is told not to write bytecode (`PYTHONDONTWRITEBYTECODE`, set on this project's
machines) and vLLM's package has none beside it, every process compiles torch and vLLM from source
again: `import vllm` took 12.8 s cold and 6.6 s from kept bytecode (0.26.0, 2 cores, measured
2026-12-06), and a `vllm serve` child imports it twice. kvdoctor keeps that bytecode here too,
under `pycache/` (Python's `PYTHONPYCACHEPREFIX`: never beside the user's sources, never in
site-packages), for its own process and its children (`KVDOCTOR_BYTECODE_CACHE=0` leaves the
interpreter's setting alone; `keep_bytecode`).

Where: `$KVDOCTOR_CACHE_DIR`, else `$XDG_CACHE_HOME/kvdoctor`, else `~/.cache/kvdoctor`.
`kvdoctor cache` says where and how big; `kvdoctor cache --clear` removes it. Nothing else of
kvdoctor's is kept: temp files go into a scratch folder removed at exit (`cli/teardown.py`).

Stdlib only and cheap (no import of vLLM): the console script reads it before anything else.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

CACHE_DIR_ENV = "KVDOCTOR_CACHE_DIR"
BYTECODE_ENV = "KVDOCTOR_BYTECODE_CACHE"  # "0": leave the interpreter's bytecode setting alone
BYTECODE_DIR = "pycache"


def cache_dir() -> Path:
    """kvdoctor's cache directory (not created here)."""
    chosen = os.environ.get(CACHE_DIR_ENV)
    if chosen:
        return Path(chosen).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvdoctor"


def _installed_vllm_key() -> str:
    """A folder name for the vLLM this interpreter would import: `vllm-0.26.0` from its `.dist-info`
    beside the package, else a hash of where the package is (an editable or unusual install)."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.origin:
        return "vllm-none"
    package = Path(spec.origin).parent
    try:
        infos = [n for n in os.listdir(package.parent) if n.startswith("vllm-") and n.endswith(".dist-info")]
    except OSError:
        infos = []
    if len(infos) == 1:
        return infos[0].removesuffix(".dist-info")
    import hashlib  # only here: loading OpenSSL costs ~10 ms of every start

    return "vllm-" + hashlib.sha256(str(package).encode()).hexdigest()[:12]


def vllm_cache_root() -> Path:
    """Where vLLM's own cache (`VLLM_CACHE_ROOT`: its model-info cache) lives for the installed vLLM."""
    return cache_dir() / _installed_vllm_key()


def keep_vllm_cache() -> None:
    """Point vLLM's cache at kvdoctor's (before vLLM is imported), unless the user placed it. One
    inherited from a kvdoctor parent (`matrix` runs each release in its own environment) is replaced
    by this environment's folder."""
    placed = os.environ.get("VLLM_CACHE_ROOT")
    if not placed or Path(placed).parent == cache_dir():
        os.environ["VLLM_CACHE_ROOT"] = str(vllm_cache_root())


def vllm_compiled_beside() -> bool:
    """Whether vLLM's package holds its own compiled `__init__` (in the `__pycache__` beside it)."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.origin:
        return False
    origin = Path(spec.origin)
    return (origin.parent / "__pycache__" / f"{origin.stem}.{sys.implementation.cache_tag}.pyc").exists()


def keep_bytecode() -> bool:
    """Keep compiled bytecode in kvdoctor's cache directory (see the module's docstring), for this process from
    now on and, through the environment, for every child it starts; True where it did. Left alone: a user's own
    prefix, an interpreter that writes bytecode, a vLLM whose package holds its compiled `__init__` (a prefix
    would make Python ignore that bytecode), and `KVDOCTOR_BYTECODE_CACHE=0`."""
    if os.environ.get(BYTECODE_ENV) == "0" or sys.pycache_prefix or not sys.dont_write_bytecode:
        return False
    if vllm_compiled_beside():
        return False
    prefix = str(cache_dir() / BYTECODE_DIR)
    sys.pycache_prefix, sys.dont_write_bytecode = prefix, False
    os.environ["PYTHONPYCACHEPREFIX"] = prefix
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    return True


@dataclass(frozen=True)
class CacheUsage:
    """What `kvdoctor cache` reports: the directory, and what it holds (before a `--clear`)."""

    path: Path
    files: int
    size_bytes: int
    cleared: bool = False

    def as_dict(self) -> dict[str, object]:
        return {"path": str(self.path), "files": self.files, "size_bytes": self.size_bytes, "cleared": self.cleared,
                "env": CACHE_DIR_ENV}


def _entries(path: Path) -> list[Path]:
    """The folders kvdoctor wrote in its cache directory (one per vLLM, and the kept bytecode): only these are
    counted or removed, so a KVDOCTOR_CACHE_DIR pointed at a shared folder never loses anything else."""
    try:
        return sorted(p for p in path.iterdir() if (p.name.startswith("vllm-") or p.name == BYTECODE_DIR)
                      and p.is_dir() and not p.is_symlink())
    except OSError:
        return []


def cache_usage(clear: bool = False) -> CacheUsage:
    """How many files and bytes kvdoctor's cache holds; with `clear`, remove them afterwards (and the
    directory, once empty)."""
    path = cache_dir()
    files = size = 0
    entries = _entries(path)
    for entry in entries:
        for root, _, names in os.walk(entry):
            for name in names:
                try:
                    size += os.lstat(os.path.join(root, name)).st_size
                except OSError:
                    continue
                files += 1
    if clear:
        for entry in entries:
            shutil.rmtree(entry)
        with contextlib.suppress(OSError):  # absent, or holding something that is not kvdoctor's
            path.rmdir()
    return CacheUsage(path, files, size, cleared=clear)
