"""What this machine offers: memory from /proc/meminfo, the size of /dev/shm.

The one place kvdoctor reads the host's capacity; every resource a user asks for is
judged against it before it is started (`kvdoctor.resolution`, `kvdoctor.check`).
"""

from __future__ import annotations

import os


def _meminfo(*keys: str) -> int | None:
    """The sum of these /proc/meminfo lines, in bytes (None where none can be read)."""
    total, seen = 0, False
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith(keys):
                    total += int(line.split()[1]) * 1024
                    seen = True
    except (OSError, ValueError, IndexError):
        return None
    return total if seen else None


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where it cannot be read)."""
    return _meminfo("MemAvailable:")


def total_memory_bytes() -> int | None:
    """MemTotal + SwapTotal from /proc/meminfo: the most one mapping may reserve (None where unreadable)."""
    return _meminfo("MemTotal:", "SwapTotal:") or None


def physical_memory_bytes() -> int | None:
    """MemTotal from /proc/meminfo (None where unreadable)."""
    return _meminfo("MemTotal:")


def shm_bytes(path: str = "/dev/shm") -> tuple[int, int] | None:
    """(size, free) of the shared-memory file system vLLM maps its CPU tier from (None: none here)."""
    try:
        stat = os.statvfs(path)
    except OSError:
        return None
    return stat.f_blocks * stat.f_frsize, stat.f_bavail * stat.f_frsize
