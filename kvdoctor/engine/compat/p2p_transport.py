"""In-memory stand-ins for the P2P tier's two transports (NIXL data plane, ZMQ control plane), issue 36.

vLLM's P2P secondary tier (`vllm/v1/kv_offload/tiering/p2p/`, 0.34) builds a `NixlTransport` (RDMA writes into
a peer's CPU tier) and a `ZmqTransport` (ROUTER/DEALER sockets carrying msgpack dicts) in its manager's
constructor. Neither runs here (no NIXL, and two engines in one process), so kvdoctor stands in for those two
classes ONLY: its `InMemoryDataTransport` and `InMemoryControlTransport` subclass vLLM's own abstract
`DataTransport` / `ControlTransport` (whose contracts they follow) and meet in one `Fabric`. vLLM's P2P manager,
sessions, client/server roles, protocol, tiering manager and scheduler all run unchanged.

What the stand-ins model: messages cross as msgpack bytes (vLLM's own encoder, so a tuple arrives as a list as
it would over ZMQ); an inbound peer's first messages arrive with its connection; a write copies the producer's
blocks into the consumer's primary region when the transfer completes (so bytes can be compared); a killed
peer's connections read dead at the other side's next poll, as ZMQ's monitor reports a disconnect. Faults the
fabric injects: dropping control messages by type, delaying messages and transfers by polls, failing
transfers, and a peer's death. What they do not model: heartbeats and timeouts of the sockets themselves,
partial writes, NIXL's retired-transfer release beyond the default (`poll_retired` reports nothing).

`p2p_transports(fabric)` swaps the two class names in vLLM's P2P manager module for the scope of a build and
restores them even when the build raises (the manager reads them only in its constructor).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

P2P_MANAGER_MODULE = "vllm.v1.kv_offload.tiering.p2p.manager"
P2P_TIER = "p2p_tier"  # feature: the installed vLLM ships the P2P tier with replaceable transports


def p2p_probe() -> str | None:
    """None where the installed vLLM has the P2P tier whose manager builds its transports by these two names
    (so kvdoctor can stand in for them); else why not, in one line."""
    try:
        import importlib

        manager = importlib.import_module(P2P_MANAGER_MODULE)
        importlib.import_module("vllm.v1.kv_offload.tiering.p2p.control.base")
        importlib.import_module("vllm.v1.kv_offload.tiering.p2p.data.base")
    except ImportError as exc:
        return f"the installed vLLM has no P2P secondary tier ({exc.name or exc})"
    for name in ("NixlTransport", "ZmqTransport", "P2PSecondaryTierManager"):
        if not hasattr(manager, name):
            return f"vLLM's P2P manager has no {name}: its transports cannot be stood in for"
    import inspect

    factory = getattr(importlib.import_module("vllm.v1.kv_offload.tiering.factory"), "SecondaryTierFactory", None)
    get_class = getattr(factory, "get_tier_class", None)
    if get_class is None or "module_path" not in inspect.getsource(get_class):
        # measured on 0.26.0: its P2P tier exists, its factory knows only its own tier types
        return ("vLLM's secondary tier factory does not load a tier from `module_path`: kvdoctor's recording "
                "P2P tier (compat/p2p_tier.py) cannot be loaded")
    import dataclasses

    result_cls = getattr(importlib.import_module("vllm.v1.kv_offload.tiering.base"), "JobResult", None)
    if result_cls is None or "deferred_release" not in {f.name for f in dataclasses.fields(result_cls)}:
        # measured on 0.33.0: the pair runs there, but its tier reports has_pending_work() always (so nothing
        # says when it is at rest) and its results carry no deferred release to check
        return ("vLLM's secondary tier results carry no `deferred_release`: kvdoctor's P2P invariants check "
                "that promise and an idle tier's has_pending_work(), which such a release does not make")
    return None


@dataclass
class Faults:
    """What the fabric does to traffic. `drop_types`: control message types (vLLM's protocol `type` field,
    e.g. "fetch", "transfer_done") dropped every time they are sent; `delay_polls`: how many receiver polls a
    control message or a data transfer waits before it arrives / completes; `fail_transfers`: every write
    fails (reported failed by the data transport's poll)."""

    drop_types: frozenset[str] = frozenset()
    delay_polls: int = 0
    fail_transfers: bool = False


@dataclass
class Fabric:
    """The network between in-process peers: control transports by `host:port`, data transports by agent
    name. Counts what crossed it (for reports and invariants)."""

    faults: Faults = field(default_factory=Faults)
    control: dict[str, Any] = field(default_factory=dict)  # local id -> in-memory control transport
    data: dict[str, Any] = field(default_factory=dict)  # agent name -> in-memory data transport
    dead: set[str] = field(default_factory=set)
    sent: list[tuple[str, str, str]] = field(default_factory=list)  # (sender, receiver, type)
    dropped: list[tuple[str, str, str]] = field(default_factory=list)
    writes: list[tuple[str, str, tuple[int, ...], tuple[int, ...], bool]] = field(default_factory=list)
    journals: dict[str, Any] = field(default_factory=dict)  # local id -> its tier's P2PJournal (compat/p2p_tier.py)
    _transfer_ids: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    def kill(self, local_id: str) -> None:
        """The peer at `local_id` dies: nothing reaches it or leaves it from now on; the others' connections
        to it read dead at their next poll."""
        self.dead.add(local_id)
        transport = self.control.get(local_id)
        if transport is not None:
            for agent in transport.agents:
                self.data.pop(agent, None)

    def quiet(self) -> bool:
        """Nothing in flight: no control message waiting for delivery, no data transfer unfinished."""
        return (not any(t.pending() for t in self.control.values())
                and not any(d.pending() for d in self.data.values()))

    def next_transfer_id(self) -> int:
        return next(self._transfer_ids)


def _classes() -> tuple[type, type, type, type]:
    """vLLM's abstract transport classes and PollResult (imported where a P2P build needs them)."""
    from vllm.v1.kv_offload.tiering.p2p.control.base import ControlConnection, ControlTransport
    from vllm.v1.kv_offload.tiering.p2p.data.base import DataTransport, PollResult

    return ControlConnection, ControlTransport, DataTransport, PollResult


_STANDINS: dict[str, type] = {}


def _standin_classes() -> tuple[type, type, type]:
    """(connection, control transport, data transport) classes built once on vLLM's abstract bases."""
    if _STANDINS:
        return _STANDINS["conn"], _STANDINS["control"], _STANDINS["data"]
    ControlConnection, ControlTransport, DataTransport, PollResult = _classes()
    import msgspec
    import numpy as np

    class InMemoryConnection(ControlConnection):  # type: ignore[misc, valid-type]
        """One peer's end of a connection: sends go to the peer's inbound queue as msgpack bytes."""

        def __init__(self, owner: Any, peer_id: str) -> None:
            super().__init__(peer_id)
            self._owner = owner
            self._inbox: list[dict] = []
            self._dead = False
            self._closed = False

        @property
        def alive(self) -> bool:
            return not (self._dead or self._closed)

        def send(self, msg: dict) -> None:
            if not self.alive:
                raise RuntimeError(f"InMemoryConnection: send on closed connection to {self.peer_id}")
            self._owner.deliver(self.peer_id, msgspec.msgpack.encode(msg), str(msg.get("type", "")))

        def recv(self) -> Sequence[dict]:
            msgs, self._inbox = self._inbox, []
            return msgs

        def enqueue(self, msg: dict) -> None:
            self._inbox.append(msg)

        def mark_dead(self) -> None:
            self._dead = True

        def close(self) -> None:
            self._closed = self._dead = True

    class InMemoryControlTransport(ControlTransport):  # type: ignore[misc, valid-type]
        """ZmqTransport's stand-in: one inbound queue (the ROUTER), one connection per peer."""

        def __init__(self, local_id: str, host: str, port: int) -> None:
            self.local_id = local_id
            self.fabric: Fabric = _ACTIVE[-1]
            self.fabric.control[local_id] = self
            # the data transport its manager built just before it (NixlTransport first, then ZmqTransport)
            self.agents: list[str] = list(self.fabric.data)[-1:]
            self._connections: dict[str, Any] = {}
            self._router: list[list[Any]] = []  # [polls left, sender, bytes]
            self._closed = False

        def deliver(self, peer_id: str, data: bytes, msg_type: str) -> None:
            fabric = self.fabric
            hop = (self.local_id, peer_id, msg_type)
            target = fabric.control.get(peer_id)
            if (msg_type in fabric.faults.drop_types or target is None or target._closed
                    or peer_id in fabric.dead or self.local_id in fabric.dead):
                fabric.dropped.append(hop)
                return
            fabric.sent.append(hop)
            target._router.append([fabric.faults.delay_polls, self.local_id, data])

        def connect(self, peer_id: str) -> Any:
            existing = self._connections.get(peer_id)
            if existing is not None:
                assert not existing.alive, f"InMemoryConnection to {peer_id} already exists"
                self._connections.pop(peer_id).close()
            conn = InMemoryConnection(self, peer_id)
            self._connections[peer_id] = conn
            return conn

        def poll(self) -> Sequence[Any]:
            self._sweep()
            for peer_id, conn in self._connections.items():  # ZMQ's monitor: the peer's socket went away
                target = self.fabric.control.get(peer_id)
                if peer_id in self.fabric.dead or target is None or target._closed:
                    conn.mark_dead()
            if self.local_id in self.fabric.dead:
                self._router.clear()
                return []
            new: list[Any] = []
            waiting: list[list[Any]] = []
            for entry in self._router:
                if entry[0] > 0:
                    entry[0] -= 1
                    waiting.append(entry)
                    continue
                sender, msg = entry[1], msgspec.msgpack.decode(entry[2])
                conn = self._connections.get(sender)
                if conn is None:
                    conn = InMemoryConnection(self, sender)
                    self._connections[sender] = conn
                    new.append(conn)
                conn.enqueue(msg)
            self._router = waiting
            return new

        def pending(self) -> int:
            return 0 if self.local_id in self.fabric.dead else len(self._router)

        def _sweep(self) -> None:
            for pid in [p for p, c in self._connections.items() if not c.alive]:
                self._connections.pop(pid).close()

        def close(self) -> None:
            if self._closed:
                return
            self._closed = True
            for conn in self._connections.values():
                conn.close()
            self._connections.clear()

    class InMemoryDataTransport(DataTransport):  # type: ignore[misc, valid-type]
        """NixlTransport's stand-in: a write copies local blocks into the peer's region when it completes."""

        def __init__(self, agent_name: str, view: memoryview, config_fields: dict | None = None,
                     backends: list[str] | None = None, num_threads: int = 4) -> None:
            super().__init__(view, config_fields=config_fields)
            self.agent_name = agent_name
            self.region = np.asarray(view)  # (num_chunks, bytes per chunk): vLLM's primary region
            self.fabric: Fabric = _ACTIVE[-1]
            self.fabric.data[agent_name] = self
            self._peers: dict[str, str] = {}  # peer_id -> agent name
            self._inflight: dict[int, list[Any]] = {}  # id -> [polls left, peer_id, local, remote]

        def pending(self) -> int:
            return len(self._inflight)

        def get_agent_metadata(self) -> bytes:
            return self.agent_name.encode()

        def add_remote_peer(self, peer_id: str, agent_metadata: bytes, base_addr: int, num_blocks: int,
                            block_len: int) -> None:
            if block_len != self.block_len:
                raise ValueError(f"block_len mismatch with {peer_id}: {block_len} != {self.block_len}")
            self._peers[peer_id] = agent_metadata.decode()

        def remove_remote_peer(self, peer_id: str) -> None:
            self._peers.pop(peer_id, None)
            for tid in [t for t, e in self._inflight.items() if e[1] == peer_id]:
                del self._inflight[tid]

        def write_blocks(self, peer_id: str, local_idxs: list[int], remote_idxs: list[int]) -> int | None:
            if peer_id not in self._peers or len(local_idxs) != len(remote_idxs):
                return None
            tid = self.fabric.next_transfer_id()
            self._inflight[tid] = [self.fabric.faults.delay_polls, peer_id, list(local_idxs), list(remote_idxs)]
            return tid

        def poll(self, peer_id: str | None = None) -> Any:
            done: list[int] = []
            failed: list[int] = []
            for tid, entry in list(self._inflight.items()):
                if peer_id is not None and entry[1] != peer_id:
                    continue
                if entry[0] > 0:
                    entry[0] -= 1
                    continue
                del self._inflight[tid]
                ok = self._copy(entry[1], entry[2], entry[3])
                (done if ok else failed).append(tid)
            return PollResult(done=done, failed=failed)

        def _copy(self, peer_id: str, local: list[int], remote: list[int]) -> bool:
            fabric = self.fabric
            target = fabric.data.get(self._peers.get(peer_id, ""))
            ok = target is not None and not fabric.faults.fail_transfers
            fabric.writes.append((self.agent_name, peer_id, tuple(local), tuple(remote), ok))
            if ok and target is not None:
                target.region[remote] = self.region[local]
            return ok

        def cancel(self, transfer_ids: Iterable[int], mode: str = "immediate") -> list[int]:
            for tid in transfer_ids:
                self._inflight.pop(tid, None)
            return []

        def close(self) -> None:
            self._inflight.clear()
            self._peers.clear()

    _STANDINS.update(conn=InMemoryConnection, control=InMemoryControlTransport, data=InMemoryDataTransport)
    return InMemoryConnection, InMemoryControlTransport, InMemoryDataTransport


# fabrics by name: a P2P tier's config names its fabric (`fabric = NAME`), vLLM's factory passes it through
FABRICS: dict[str, Fabric] = {}

# the fabric the transports built inside `p2p_transports` join (a stack: scopes may nest)
_ACTIVE: list[Fabric] = []

_REPLACED = ("NixlTransport", "ZmqTransport")  # the names vLLM's P2P manager builds its transports by


@contextlib.contextmanager
def p2p_transports(fabric: Fabric) -> Iterator[None]:
    """vLLM's P2P manager builds kvdoctor's in-memory transports (joining `fabric`) inside this scope; its
    NixlTransport / ZmqTransport names are restored on exit, even when the build raises."""
    import importlib

    manager = importlib.import_module(P2P_MANAGER_MODULE)
    _conn, control_cls, data_cls = _standin_classes()
    saved = {name: getattr(manager, name) for name in _REPLACED}
    _ACTIVE.append(fabric)
    for name, cls in zip(_REPLACED, (data_cls, control_cls), strict=True):
        setattr(manager, name, cls)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(manager, name, value)
        _ACTIVE.pop()

