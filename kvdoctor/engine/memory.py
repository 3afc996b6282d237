"""What this machine's memory allows, from /proc/meminfo (read when asked; nothing imported): the
refusals of setups and workers that would not fit are judged from it before vLLM is imported."""

from __future__ import annotations


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where it cannot be read)."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def total_memory_bytes() -> int | None:
    """MemTotal + SwapTotal from /proc/meminfo: the most one mapping may reserve (None where unreadable)."""
    total = 0
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith(("MemTotal:", "SwapTotal:")):
                    total += int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return total or None


def physical_memory_bytes() -> int | None:
    """MemTotal from /proc/meminfo: the host's memory, without swap (None where unreadable)."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def shm_bytes(path: str = "/dev/shm") -> tuple[int, int] | None:
    """(size, free) of the shared-memory file system vLLM maps a shared CPU tier from (None: none here)."""
    import os

    try:
        stat = os.statvfs(path)
    except OSError:
        return None
    return stat.f_blocks * stat.f_frsize, stat.f_bavail * stat.f_frsize
