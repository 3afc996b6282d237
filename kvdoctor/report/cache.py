"""`kvdoctor cache` as plain text: where kvdoctor's cache is, what it holds, how to clear it."""

from __future__ import annotations

from kvdoctor.user_cache import CacheUsage


def _size(size_bytes: int) -> str:
    value = float(size_bytes)
    for unit in ("bytes", "KiB", "MiB"):
        if value < 1024 or unit == "MiB":
            return f"{size_bytes} bytes" if unit == "bytes" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"  # pragma: no cover - unreachable (MiB is the last unit shown)


def cache_text(usage: CacheUsage) -> str:
    held = f"{usage.files} file{'s' if usage.files != 1 else ''}, {_size(usage.size_bytes)}"
    if usage.cleared:
        return f"kvdoctor's cache: {usage.path}: removed ({held})"
    return (f"kvdoctor's cache: {usage.path} ({held})\n"
            f"  vLLM's model-info cache, one folder per vLLM release: a run imports vLLM once\n"
            f"  pycache/: compiled bytecode of torch and vLLM where Python writes none (PYTHONDONTWRITEBYTECODE)\n"
            f"  clear it: kvdoctor cache --clear; move it: {usage.as_dict()['env']}=DIR")
