"""The bytes kvdoctor's recording tiers (P2P, object store) stamp into the chunks vLLM stores, and the check
that a load vLLM reports successful brought them back: one definition for every tier that moves bytes."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import numpy as np


def job_chunk_ids(job: Any) -> tuple[int, ...]:
    """A tier job's primary chunk ids (`TransferJob.chunk_ids`; `JobMetadata.block_ids` before 0.34)."""
    ids = job.chunk_ids if hasattr(job, "chunk_ids") else job.block_ids
    return tuple(int(c) for c in np.asarray(ids).tolist())


def key_stamp(key: Any, size: int, dtype: Any = np.uint8) -> np.ndarray:
    """The bytes a chunk holding `key` carries here: sha256 of the key, repeated to the chunk's size (as the
    region's dtype: vLLM's shared region is int8)."""
    digest = hashlib.sha256(bytes(key) if isinstance(key, (bytes, bytearray)) else repr(key).encode()).digest()
    reps = -(-size // len(digest))
    return np.frombuffer((digest * reps)[:size], dtype=np.uint8).view(dtype)


def stamp_chunks(region: Any, keys: Iterable[Any], chunks: Iterable[int]) -> None:
    """Each stored chunk's bytes, stamped with its key."""
    for key, chunk in zip(keys, chunks, strict=True):
        region[chunk] = key_stamp(key, region.shape[1], region.dtype)


def unstamped_chunks(region: Any, keys: Iterable[Any], chunks: Iterable[int]) -> list[tuple[Any, int]]:
    """(key, chunk) of each loaded chunk that does not hold its key's stamp."""
    return [(key, chunk) for key, chunk in zip(keys, chunks, strict=True)
            if not np.array_equal(region[chunk], key_stamp(key, region.shape[1], region.dtype))]
