"""Importing vLLM's modules: quietly, and failing in one line (exit 3) rather than a traceback."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kvdoctor.errors import IncompatibleVllmError, VllmUnavailableError
from kvdoctor.releases import SUPPORTED_RANGE_TEXT
from kvdoctor.user_cache import keep_vllm_cache


def _quiet_environment() -> None:
    """Keep vLLM offline and quiet: no hub look-ups, no usage stats, no INFO spam; its model-info cache
    in kvdoctor's cache directory, never the user's ~/.cache/vllm (`kvdoctor.user_cache`)."""
    keep_vllm_cache()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


@contextmanager
def _silenced_stderr() -> Iterator[None]:
    """vLLM and torch print import-time chatter (no CUDA, no Triton, no vllm._C) on fd 2.

    On a CPU-only machine all of it is expected; kvdoctor reports real import
    failures itself, in one line.
    """
    if os.environ.get("KVDOCTOR_VERBOSE_IMPORT"):
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _import(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and (exc.name == "vllm" or (module.startswith(exc.name + ".") and exc.name == "vllm")):
            raise VllmUnavailableError(
                f"vLLM is not installed in this Python environment (kvdoctor needs vllm{SUPPORTED_RANGE_TEXT})"
            ) from None
        raise VllmUnavailableError(
            f"importing {module} failed: {type(exc).__name__}: {_one_line(exc)}"
        ) from None
    except Exception as exc:  # a broken environment: torchvision ops, CUDA libs, ...
        raise VllmUnavailableError(
            f"importing {module} failed: {type(exc).__name__}: {_one_line(exc)}"
        ) from None


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else ""


class AdapterBase:
    """What every part of the adapter (`VllmApi` and the glue mixed into it) reads: vLLM's imported modules,
    by key (`compat._MODULES`, worker-side ones added on first use), and their classes."""

    mods: dict[str, Any]

    def cls(self, module_key: str, name: str) -> Any:
        return _require(self.mods[module_key], name, self.mods[module_key].__name__)


def _require(obj: Any, name: str, where: str) -> Any:
    try:
        return getattr(obj, name)
    except AttributeError:
        raise IncompatibleVllmError(
            f"this vLLM has no {where}.{name}; kvdoctor's adapter needs an update"
        ) from None
