"""kvdoctor's copy engine: an `OffloadingWorker` that moves real bytes between CPU tensors.

vLLM's `CPUOffloadingWorker` plans each transfer along the direct layout (one page per
GPU block per KV tensor, `blocks_per_chunk` pages per CPU slot) and hands the pointer
list to `swap_blocks_batch`, a batch of CUDA copies. This worker makes the same plan
with vLLM's own `compute_sub_block_ptrs` and copies with `ctypes.memmove` instead,
so it runs without a GPU. What kvdoctor adds is control: a job can be held, completed,
delayed or failed on command (`TransferControl`), and it copies as late as a real DMA
may (just before its completion is reported, or when `wait()` fences it): a GPU block
reused in between is read late, as a slow copy engine would read it.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvdoctor.engine import compat


@dataclass
class Transfer:
    job_id: int
    kind: str  # "store" | "load"
    copies: list[tuple[int, int, int, int, int]]  # (src_ptr, dst_ptr, size, gpu_block, cpu_slot)
    num_bytes: int
    gpu_blocks: tuple[int, ...]
    cpu_slots: tuple[int, ...]
    submitted_at: float = field(default_factory=time.monotonic)
    copied: bool = False


class TransferControl:
    """What the harness decides about each job; the copy engine asks it per job.

    `due[job]` is the completion call (count of `get_finished()` calls) at which a job is
    reported; a held job has none until released. `fail` reports success=False, which is
    how this release's connector learns of a failed transfer.
    """

    def __init__(self, latency_calls: int = 0) -> None:
        self.latency_calls = latency_calls
        self.held: set[int] = set()
        self.release_now: set[int] = set()
        self.failed: set[int] = set()
        # hooks the content model installs: store copy (job, gpu block -> bytes read) / load copy
        self.on_store_copy: Callable[[int, dict[int, Any]], None] | None = None
        self.on_load_mismatch: Callable[[int, int, int, str], None] | None = None
        self.engine: Any = None  # the CopyEngineWorker vLLM's spec built, once registered
        # CPU-tier slots as the scheduler's spec computed them from the model's real pages (the worker's spec
        # sees fingerprint pages, see workers/fingerprint.py); None: the worker spec's own count
        self.cpu_slots: int | None = None


# mypy cannot check a base class computed at import (vLLM's OffloadingWorker, found by the adapter)
class CopyEngineWorker(compat.load().offloading_worker_base()):  # type: ignore[misc]
    def __init__(self, kv_caches: Any, blocks_per_chunk: int, num_cpu_slots: int,
                 control: TransferControl) -> None:
        import torch

        self.api = compat.load()
        self.control = control
        self.blocks_per_chunk = blocks_per_chunk
        self.gpu_tensors = [t.tensor for t in kv_caches.tensors]
        for t in self.gpu_tensors:
            if t.dtype != torch.int8 or t.ndim != 2 or t.device.type != "cpu":
                raise RuntimeError(f"kvdoctor's copy engine needs int8 (blocks, page) CPU views, got "
                                   f"{t.dtype} {tuple(t.shape)} on {t.device}")
        # Uninitialised (lazily mapped: the tier costs only the pages stored into): a load of a slot
        # never stored is judged from `self.stored`, never from the tier's initial bytes.
        self.cpu_tensors = [torch.empty((num_cpu_slots, int(t.page_size_bytes) * blocks_per_chunk),
                                        dtype=torch.int8) for t in kv_caches.tensors]
        self.group_refs = kv_caches.group_data_refs
        self._sub_block_ptrs = self.api.compute_sub_block_ptrs()
        self._queue: list[Transfer] = []  # in submission order, like chained stream events
        self._due: dict[int, int] = {}
        self._calls = 0
        # (cpu tensor, slot, sub-block), packed in one int as the copies carry it -> bytes stored there: a load
        # is compared against it
        self.stored: dict[int, bytes] = {}
        self.submitted: list[tuple[str, int]] = []

    # -- the copy plan (vLLM's direct layout) --------------------------------
    def _plan(self, kind: str, src_spec: Any, dst_spec: Any) -> Transfer:
        to_cpu = kind == "store"
        gpu_spec = src_spec if to_cpu else dst_spec
        src_ids = np.asarray(self.api.block_ids_of(src_spec), dtype=np.int64)
        dst_ids = np.asarray(self.api.block_ids_of(dst_spec), dtype=np.int64)
        sizes, indices = self.api.gpu_spec_groups(gpu_spec, len(self.group_refs))
        bpc = self.blocks_per_chunk
        src_per, dst_per = (1, bpc) if to_cpu else (bpc, 1)
        src_tensors = self.gpu_tensors if to_cpu else self.cpu_tensors
        dst_tensors = self.cpu_tensors if to_cpu else self.gpu_tensors
        copies: list[tuple[int, int, int, int, int]] = []
        nbytes = 0
        src_off = dst_off = 0
        for group, (size, first) in enumerate(zip(sizes, indices, strict=False)):
            if size == 0:
                continue
            s_skip, d_skip = first % src_per, first % dst_per
            s_end = src_off + -(-(size + s_skip) // src_per)
            d_end = dst_off + -(-(size + d_skip) // dst_per)
            # which GPU block / CPU slot each sub-block belongs to (for the content checks)
            gpu_ids = (src_ids if to_cpu else dst_ids)[(src_off if to_cpu else dst_off):(s_end if to_cpu else d_end)]
            cpu_ids = (dst_ids if to_cpu else src_ids)[(dst_off if to_cpu else src_off):(d_end if to_cpu else s_end)]
            cpu_skip = d_skip if to_cpu else s_skip
            slots = [(int(cpu_ids[(cpu_skip + i) // bpc]), (cpu_skip + i) % bpc) for i in range(size)]
            for ref in self.group_refs[group]:
                sp = np.empty(size, dtype=np.int64)
                dp = np.empty(size, dtype=np.int64)
                self._sub_block_ptrs(src_ids[src_off:s_end], src_per, sp, src_tensors[ref.tensor_idx],
                                     skip_count=s_skip)
                self._sub_block_ptrs(dst_ids[dst_off:d_end], dst_per, dp, dst_tensors[ref.tensor_idx],
                                     skip_count=d_skip)
                page = int(ref.page_size_bytes)
                for i, (s, d) in enumerate(zip(sp.tolist(), dp.tolist(), strict=True)):
                    slot, sub = slots[i]
                    copies.append((s, d, page, int(gpu_ids[i]), ref.tensor_idx * (1 << 40) + slot * bpc + sub))
                nbytes += size * page
            src_off, dst_off = s_end, d_end
        if src_off != len(src_ids) or dst_off != len(dst_ids):
            raise RuntimeError(f"copy plan of job does not cover its spec ({src_off}/{len(src_ids)}, "
                               f"{dst_off}/{len(dst_ids)})")
        return Transfer(0, kind, copies, nbytes, tuple(int(b) for b in (src_ids if to_cpu else dst_ids)),
                        tuple(int(b) for b in (dst_ids if to_cpu else src_ids)))

    # -- OffloadingWorker ----------------------------------------------------
    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        return self._submit(job_id, "store", src_spec, dst_spec)

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False) -> bool:
        return self._submit(job_id, "load", src_spec, dst_spec)

    def _plan_from_pointers(self, kind: str, device_ptrs: Any, cpu_spec: Any) -> Transfer:
        """0.34+: the connector resolved the GPU side to `DevicePointers` (canonical order: group,
        data ref, block); the CPU side follows vLLM's direct layout as its CPU worker fills it."""
        to_cpu = kind == "store"
        bpc = self.blocks_per_chunk
        cpu_ids = np.asarray(self.api.block_ids_of(cpu_spec), dtype=np.int64)
        copies: list[tuple[int, int, int, int, int]] = []
        nbytes = dev_off = cpu_off = 0
        gpu_blocks: list[int] = []
        for group, (size, n_refs, first) in enumerate(zip(device_ptrs.group_block_counts,
                                                          device_ptrs.group_data_ref_counts,
                                                          device_ptrs.block_indices, strict=True)):
            size = int(size)
            if size == 0:
                continue
            skip = int(first) % bpc
            n_chunks = -(-(size + skip) // bpc)
            chunk_ids = cpu_ids[cpu_off:cpu_off + n_chunks]
            slots = [(int(chunk_ids[(skip + i) // bpc]), (skip + i) % bpc) for i in range(size)]
            for d, ref in enumerate(self.group_refs[group][:int(n_refs)]):
                gpu_t = self.gpu_tensors[ref.tensor_idx]
                gp = [int(x) for x in device_ptrs.ptrs[dev_off + d * size: dev_off + (d + 1) * size]]
                cp = np.empty(size, dtype=np.int64)
                self._sub_block_ptrs(chunk_ids, bpc, cp, self.cpu_tensors[ref.tensor_idx], skip_count=skip)
                page = int(ref.page_size_bytes)
                for i, (g, c) in enumerate(zip(gp, cp.tolist(), strict=True)):
                    block = (g - gpu_t.data_ptr()) // gpu_t.stride(0)
                    if d == 0:
                        gpu_blocks.append(block)
                    slot, sub = slots[i]
                    src, dst = (g, c) if to_cpu else (c, g)
                    copies.append((src, dst, page, block, ref.tensor_idx * (1 << 40) + slot * bpc + sub))
                nbytes += size * page
            dev_off += size * int(n_refs)
            cpu_off += n_chunks
        return Transfer(0, kind, copies, nbytes, tuple(gpu_blocks), tuple(int(b) for b in cpu_ids))

    def _submit(self, job_id: int, kind: str, src_spec: Any, dst_spec: Any) -> bool:
        pointers = src_spec if kind == "store" else dst_spec
        if self.api.is_device_pointers(pointers):
            transfer = self._plan_from_pointers(kind, pointers, dst_spec if kind == "store" else src_spec)
        else:
            transfer = self._plan(kind, src_spec, dst_spec)
        transfer.job_id = int(job_id)
        self._queue.append(transfer)
        self.submitted.append((kind, int(job_id)))
        self._due[transfer.job_id] = self._calls + 1 + self.control.latency_calls
        return True

    def _copy(self, transfer: Transfer) -> None:
        if transfer.copied:
            return
        transfer.copied = True
        if transfer.kind == "store":
            if self.control.on_store_copy is not None:
                self.control.on_store_copy(transfer.job_id, {c[3]: None for c in transfer.copies})
            for src, dst, size, _gpu, key in transfer.copies:
                ctypes.memmove(dst, src, size)
                self.stored[key] = ctypes.string_at(dst, size)
            return
        for src, dst, size, gpu, key in transfer.copies:
            ctypes.memmove(dst, src, size)
            expected = self.stored.get(key)
            if self.control.on_load_mismatch is not None and expected != ctypes.string_at(dst, size):
                found = "a CPU page never stored" if expected is None else "bytes that differ from the store"
                self.control.on_load_mismatch(transfer.job_id, gpu, key % (1 << 40), found)

    def get_finished(self) -> list[Any]:
        self._calls += 1
        control = self.control
        results = []
        remaining = []
        for transfer in self._queue:
            jid = transfer.job_id
            due = self._due.get(jid)
            ready = jid in control.release_now or jid in control.failed or (
                jid not in control.held and due is not None and due <= self._calls)
            if not ready:
                remaining.append(transfer)
                continue
            success = jid not in control.failed
            if success:
                self._copy(transfer)
            control.release_now.discard(jid)
            control.failed.discard(jid)
            self._due.pop(jid, None)
            results.append(self.api.transfer_result(jid, success, transfer.num_bytes,
                                                    time.monotonic() - transfer.submitted_at))
        self._queue = remaining
        return results

    def wait(self, job_ids: set[int]) -> None:
        """Like `event.synchronize()` on the job: its bytes (and, streams being chained, every
        earlier job's) are copied now, holds notwithstanding; reported by the next get_finished()."""
        wanted = {int(j) for j in job_ids}
        last = max((i for i, t in enumerate(self._queue) if t.job_id in wanted), default=-1)
        for transfer in self._queue[: last + 1]:
            self._copy(transfer)
            self.control.held.discard(transfer.job_id)
            self.control.release_now.add(transfer.job_id)

    def shutdown(self) -> None:
        self._queue.clear()
