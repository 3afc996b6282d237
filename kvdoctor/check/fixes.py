"""The flag change that avoids a start-up refusal: candidates per refusal site, each run through the same
start-up path, and the first that starts is offered (checked, not guessed)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from kvdoctor.check.flags import CheckFlags
from kvdoctor.check.result import Refusal

Candidate = tuple[str, CheckFlags]  # (the change as the user types it, the flags with it)


def _with_extra(flags: CheckFlags, **changes: Any) -> CheckFlags:
    transfer = dict(flags.kv_transfer_config or {})
    transfer["kv_connector_extra_config"] = {**flags.extra_config, **changes}
    return dataclasses.replace(flags, kv_transfer_config=transfer)


def candidates(flags: CheckFlags, refusal: Refusal) -> list[Candidate]:
    text = f"{refusal.message} {refusal.site or ''}"
    block = flags.planned_block_size()
    chunk = flags.extra_config.get("block_size")
    found: list[Candidate] = []
    if "tokens_per_hash" in text:  # a group's block not a multiple of the hash block (offloading/config.py)
        if flags.enable_prefix_caching is False:
            found.append(("--enable-prefix-caching", dataclasses.replace(flags, enable_prefix_caching=True)))
        for size in (16, 32, 64, 128, 256):
            if size != block:
                found.append((f"--block-size {size}", dataclasses.replace(flags, block_size=size)))
    if isinstance(chunk, int) and chunk > 0 and ("tokens_per_chunk" in text or "multiple of the GPU KV cache block"
                                                 in text):
        rounded = math.ceil(chunk / block) * block
        found.append((f"kv_connector_extra_config.block_size {rounded} (a multiple of --block-size {block})",
                      _with_extra(flags, block_size=rounded)))
        divisor = math.gcd(chunk, block)
        if divisor != block:
            found.append((f"--block-size {divisor} (divides the offloaded block of {chunk} tokens)",
                          dataclasses.replace(flags, block_size=divisor)))
    if refusal.stage == "host":
        cpu = flags.extra_config.get("cpu_bytes_to_use")
        host = _host_bytes(flags)
        if isinstance(cpu, int) and host:
            fits = int(host * 0.8 / flags.data_parallel_size)
            gib = max(fits >> 30, 1)
            found.append((f"--kv-offloading-size {gib} (at most {fits / 2**30:.1f} GiB per engine leaves 20% of "
                          f"the host's memory to the rest)", _with_extra(flags, cpu_bytes_to_use=gib << 30)))
    return found


def _host_bytes(flags: CheckFlags) -> int | None:
    from kvdoctor.engine.memory import physical_memory_bytes

    return flags.host_memory or physical_memory_bytes()


def find_fix(flags: CheckFlags, refusal: Refusal, starts: Callable[[CheckFlags], bool]) -> tuple[str | None, bool]:
    """(the first candidate change that starts, True), else (the first candidate, False), else (None, False)."""
    found = candidates(flags, refusal)
    for change, changed in found:
        if starts(changed):
            return change, True
    return (found[0][0], False) if found else (None, False)
