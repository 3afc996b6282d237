"""A fake NIXL agent with an in-memory object store, in place of vLLM's `nixl_agent` for its object-store tier.

vLLM's `ObjectStoreSecondaryTierManager` (0.34's `vllm/v1/kv_offload/tiering/obj/manager.py`) moves chunks between
its CPU tier's region and an S3 bucket through a NIXL agent with the OBJ backend. kvdoctor stands in ONLY for that
agent (and the bucket behind it): the manager's own code (key naming, job bookkeeping, polling, lookups, failure
handling) runs unchanged. Objects are bytes in a dict; a WRITE copies the region's chunk bytes into the bucket when
the transfer completes, a READ copies them back. Faults come from a script, "<stores>/<loads>", each a comma list
of outcomes cycled per transfer (`OUTCOMES`), so a run replays. Time is counted in polls, never in seconds.
This module imports nothing of vLLM (the probe imports it lazily).
"""

from __future__ import annotations

import ctypes
import itertools
from dataclasses import dataclass, field
from typing import Any

from kvdoctor.engine.compat.names import OBJ_MANAGER_MODULE

REPLACED = ("nixl_agent", "nixl_agent_config")  # the names vLLM's obj manager builds its agent with
# A transfer's scripted outcome:
OUTCOMES = {
    "ok": "done at its first poll",
    "late": "in progress for LATE_POLLS polls, then done",
    "fail": "check_xfer_state says ERR",
    "err": "transfer() says ERR at submission",
    "noreg": "register_memory(OBJ) returns None",
    "noprep": "prep_xfer_dlist(OBJ) returns no handle",
    "noxfer": "make_prepped_xfer returns no handle",
    "raise": "check_xfer_state raises",
    "notel": "done, but get_xfer_telemetry raises (a build without telemetry)",
    "norel": "done, but release_xfer_handle raises once (vLLM keeps the transfer until a release succeeds)",
    "leak": "done, but release_dlist_handle and deregister_memory raise (NIXL metadata leaks, the job completes)",
}
LATE_POLLS = 2


def check_objstore_script(script: str) -> str | None:
    """None if `script` is "<stores>/<loads>" of known outcomes (either side may be empty: all "ok"), else why not."""
    parts = script.split("/")
    if len(parts) > 2:
        return f"{script!r}: at most one '/' (store outcomes / load outcomes)"
    for part in parts:
        for word in (w.strip() for w in part.split(",") if w.strip()):
            if word not in OUTCOMES:
                return f"unknown outcome {word!r} (one of {', '.join(OUTCOMES)})"
    return None


def parse_objstore_script(script: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(store outcomes, load outcomes) of a checked script, each at least ("ok",)."""
    stores, loads = [*script.split("/"), ""][:2]
    return (tuple(w.strip() for w in stores.split(",") if w.strip()) or ("ok",),
            tuple(w.strip() for w in loads.split(",") if w.strip()) or ("ok",))


@dataclass
class ObjectStore:
    """The bucket: object key -> bytes; what every agent of this process reads and writes."""

    objects: dict[str, bytes] = field(default_factory=dict)
    puts: int = 0
    failed_puts: int = 0


STORES: dict[str, ObjectStore] = {}


def object_store(bucket: str) -> ObjectStore:
    return STORES.setdefault(bucket, ObjectStore())


@dataclass
class _Descs:
    """A registration or a prepared descriptor list: (addr, len, dev, key) tuples."""

    descs: list[tuple[Any, ...]]
    kind: str

    def trim(self) -> _Descs:
        return self


@dataclass
class _Xfer:
    op: str
    pairs: list[tuple[tuple[Any, ...], str]]  # (DRAM desc, object key)
    outcome: str
    polls: int = 0
    state: str = "PROC"
    release_refusals: int = 0


@dataclass
class _Telemetry:
    xferDuration: float = 1000.0  # NIXL's field name (microseconds)


class FakeObjAgent:
    """NIXL's agent API as vLLM's object-store tier calls it, over `ObjectStore` (see the module's docstring)."""

    def __init__(self, name: str, config: Any = None, *, script: str = "", bucket: str = "kvdoctor") -> None:
        self.name = name
        stores, loads = parse_objstore_script(script)
        self._outcomes = {"WRITE": itertools.cycle(stores), "READ": itertools.cycle(loads)}
        self.store = object_store(bucket)
        self.backend_params: dict[str, str] | None = None
        self.live_regs: list[_Descs] = []
        self.live_dlists: list[_Descs] = []
        self.live_xfers: list[_Xfer] = []
        self.leaked = 0  # registrations / descriptor lists whose release the script refused
        self.submitted = {"WRITE": 0, "READ": 0}
        self._outcome = "ok"  # the current transfer's outcome (`begin`)
        self._leaky = False

    # -- set-up -----------------------------------------------------------------------------------------------
    def create_backend(self, backend: str, params: dict[str, str]) -> None:
        self.backend_params = dict(params)

    def query_memory(self, descs: list[tuple[Any, ...]], backend: str, mem_type: str) -> list[dict[str, Any] | None]:
        return [({"size": len(self.store.objects[d[3]])} if d[3] in self.store.objects else None) for d in descs]

    def begin(self, op: str) -> None:
        """The next transfer is a WRITE or a READ (kvdoctor's tier says so before vLLM submits it): its outcome is
        drawn now, since its first call (register_memory) does not name the op."""
        self._outcome = next(self._outcomes[op])
        self.submitted[op] += 1

    def register_memory(self, descs: list[tuple[Any, ...]], mem_type: str) -> _Descs | None:
        if mem_type == "OBJ" and self._outcome == "noreg":
            return None
        reg = _Descs(list(descs), mem_type)
        self.live_regs.append(reg)
        return reg

    def prep_xfer_dlist(self, agent: str, descs: Any, mem_type: str | None = None) -> _Descs | None:
        dlist = descs if isinstance(descs, _Descs) else _Descs(list(descs), mem_type or "DRAM")
        if dlist.kind == "OBJ" and self._outcome == "noprep":
            return None
        self.live_dlists.append(dlist)
        return dlist

    def make_prepped_xfer(self, op: str, local: _Descs, local_ids: Any, remote: _Descs, remote_ids: Any) -> Any:
        if self._outcome == "noxfer":
            return None
        pairs = [(local.descs[int(i)], remote.descs[int(j)][3])
                 for i, j in zip(list(local_ids), list(remote_ids), strict=True)]
        xfer = _Xfer(op, pairs, self._outcome, release_refusals=1 if self._outcome == "norel" else 0)
        self.live_xfers.append(xfer)
        return xfer

    # -- a transfer -------------------------------------------------------------------------------------------
    def transfer(self, xfer: _Xfer) -> str:
        if xfer.outcome == "err":
            xfer.state = "ERR"
            return "ERR"
        return "PROC"

    def check_xfer_state(self, xfer: _Xfer) -> str:
        if xfer.outcome == "raise":
            raise RuntimeError("kvdoctor's object store: scripted check_xfer_state failure")
        if xfer.state != "PROC":
            return xfer.state
        xfer.polls += 1
        if xfer.outcome == "late" and xfer.polls <= LATE_POLLS:
            return "PROC"
        if xfer.outcome == "fail":
            xfer.state = "ERR"
            if xfer.op == "WRITE":
                self.store.failed_puts += 1
            return "ERR"
        for (addr, length, *_), key in xfer.pairs:
            if xfer.op == "WRITE":
                self.store.objects[key] = ctypes.string_at(addr, length)
                self.store.puts += 1
            else:
                data = self.store.objects.get(key)
                if data is None:  # a READ of an absent object fails (S3's NoSuchKey), whatever the script says
                    xfer.state = "ERR"
                    return "ERR"
                ctypes.memmove(addr, data, min(length, len(data)))
        xfer.state = "DONE"
        return "DONE"

    def get_xfer_telemetry(self, xfer: _Xfer) -> _Telemetry:
        if xfer.outcome == "notel":
            raise RuntimeError("kvdoctor's object store: built without telemetry")
        return _Telemetry()

    # -- releases ---------------------------------------------------------------------------------------------
    def release_xfer_handle(self, xfer: _Xfer) -> None:
        if xfer.release_refusals:
            xfer.release_refusals -= 1
            raise RuntimeError("kvdoctor's object store: scripted release_xfer_handle failure")
        self.live_xfers.remove(xfer)
        self._leaky = xfer.outcome == "leak"  # vLLM releases its lists next

    def release_dlist_handle(self, dlist: _Descs) -> None:
        if dlist.kind == "OBJ" and self._leaky:
            self.leaked += 1
            raise RuntimeError("kvdoctor's object store: scripted release_dlist_handle failure")
        self.live_dlists.remove(dlist)

    def deregister_memory(self, reg: _Descs) -> None:
        if reg.kind == "OBJ" and self._leaky:
            self._leaky = False
            self.leaked += 1
            raise RuntimeError("kvdoctor's object store: scripted deregister_memory failure")
        self.live_regs.remove(reg)

    def live_obj_handles(self) -> int:
        """OBJ registrations and descriptor lists not released (beyond those the script made leak)."""
        return sum(d.kind == "OBJ" for d in self.live_regs + self.live_dlists) - self.leaked


def objstore_probe() -> str | None:
    """None where the installed vLLM has the object-store tier, building its agent by the names kvdoctor stands in
    for, loadable by kvdoctor through `module_path`; else why not, in one line."""
    import importlib

    try:
        manager = importlib.import_module(OBJ_MANAGER_MODULE)
    except ImportError as exc:
        return f"the installed vLLM has no object-store secondary tier ({exc.name or exc})"
    for name in (*REPLACED, "ObjectStoreSecondaryTierManager"):
        if name not in vars(manager):
            return f"vLLM's object-store manager has no {name}: its NIXL agent cannot be stood in for"
    import inspect

    factory = getattr(importlib.import_module("vllm.v1.kv_offload.tiering.factory"), "SecondaryTierFactory", None)
    get_class = getattr(factory, "get_tier_class", None)
    if get_class is None or "module_path" not in inspect.getsource(get_class):
        return "vLLM's secondary tier factory does not load a tier from `module_path`"
    return None
