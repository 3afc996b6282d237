"""What this machine's memory allows, from /proc/meminfo (read when asked; nothing imported): the
refusals of setups and workers that would not fit are judged from it before vLLM is imported."""

from __future__ import annotations


def _meminfo(*fields: str) -> int | None:
    """The sum of `fields` of /proc/meminfo, in bytes (None where it cannot be read or none is there)."""
    found, total = False, 0
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                name = line.split(":", 1)[0]
                if name in fields:
                    total += int(line.split()[1]) * 1024
                    found = True
    except (OSError, ValueError, IndexError):
        return None
    return total if found else None


def available_memory_bytes() -> int | None:
    """MemAvailable: what a new process can take without swapping."""
    return _meminfo("MemAvailable")


def total_memory_bytes() -> int | None:
    """MemTotal + SwapTotal: the most one mapping may reserve."""
    return _meminfo("MemTotal", "SwapTotal") or None


def physical_memory_bytes() -> int | None:
    """MemTotal: the host's memory, without swap."""
    return _meminfo("MemTotal")


def shm_bytes(path: str = "/dev/shm") -> tuple[int, int] | None:
    """(size, free) of the shared-memory file system vLLM maps a shared CPU tier from (None: none here)."""
    import os

    try:
        stat = os.statvfs(path)
    except OSError:
        return None
    return stat.f_blocks * stat.f_frsize, stat.f_bavail * stat.f_frsize
