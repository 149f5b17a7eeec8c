"""A decode rank's puller: runs the loads the step diffs name, on its own threads, and reports
each one to the engine core (its own PUSH socket, so a report never waits for a step).

Loads from different prefill engines run side by side: up to MAX_THREADS threads take the
oldest load whose prefill ranks no other thread is talking to, so a slow or silent peer (one
a client named) holds only its own loads, never another engine's. A peer's connection is used
by one thread at a time (ZeroMQ sockets are not thread-safe; the lock hands them over). The
connections are a pool of at most MAX_PEERS, least recently used closed first.

A load reads this rank's heads of the prompt's blocks from every prefill rank that holds some
of them (layout.py), through the transport chosen once per prefill rank at the first
connection: the configured one, or with "auto" shared memory on the same machine (CPU), else
NIXL when it imports, else the TCP pull. A cancelled load (the core gave it up or the request
was aborted) stops within one poll and is reported failed; the core frees its blocks only
after every rank reported it.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import zmq

from protocol.codec import Encoder, pack, unpack
from protocol.kv_connector import KVConnectorReport, KVLoadOp
from protocol.kv_peer import PeerInfo
from protocol.transport import make_socket
from workers.kv_connector.layout import head_slices
from workers.kv_connector.peer import Cancelled, LeaseRefused, Peer, PeerError
from workers.kv_connector.transports import (
    ShmTransport,
    ShmUnavailable,
    TcpTransport,
    Transport,
)

logger = logging.getLogger("tandem.kv_connector")

# loads in flight at once on a rank (each from prefill ranks no other in flight uses), and the
# connections to prefill ranks kept open (clients name them: bounded)
MAX_THREADS = 4
MAX_PEERS = 64

Endpoint = tuple[str, int]


def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return ""


@dataclass
class LocalLayout:
    rank: int
    num_caches: int
    block_size: int
    kv_heads: int
    total_kv_heads: int
    head_dim: int
    dtype: str


@dataclass
class _Job:
    op: KVLoadOp
    arrived: float
    cancelled: threading.Event = field(default_factory=threading.Event)
    held: set[Endpoint] = field(default_factory=set)  # the endpoints it marked busy

    @property
    def endpoints(self) -> set[Endpoint]:
        return {(self.op.remote_host, port) for port in self.op.remote_rank_ports}


class Puller:
    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], connector: str, secret: bytes | None,
                 layout: LocalLayout, caches: Sequence[torch.Tensor]) -> None:
        self.ctx = ctx
        self.connector = connector  # auto | tcp | shm | nixl
        self.secret = secret
        self.layout = layout
        self.caches = list(caches)
        self.device = caches[0].device
        self.hostname = socket.gethostname()
        self.boot_id = boot_id()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._pending: deque[_Job] = deque()  # submitted, not yet taken by a thread
        self._by_id: dict[int, _Job] = {}  # submitted, not yet reported
        self._busy: set[Endpoint] = set()  # the prefill ranks a thread is talking to
        self._threads: list[threading.Thread] = []
        self._idle = 0  # threads waiting for a load
        self._stopping = False
        # the connections, least recently used first; a busy endpoint's is used only by the
        # thread that marked it busy
        self._peers: OrderedDict[Endpoint, Peer] = OrderedDict()
        self._transport_of: dict[str, Transport] = {}  # peer address -> its transport
        self._transports: dict[str, Transport] = {}
        # NIXL's agent is one per rank and not known to be thread-safe: its pulls take turns
        self._nixl_lock = threading.Lock()
        self._push: zmq.Socket[bytes] | None = None
        self._push_lock = threading.Lock()
        self._encoder = Encoder()

    def start(self, results_addr: str) -> None:
        self._push = make_socket(self.ctx, zmq.PUSH, results_addr, bind=False,
                                 secret=self.secret, linger_ms=1000)

    @property
    def num_peers(self) -> int:
        return len(self._peers)

    @property
    def num_loads(self) -> int:
        return len(self._by_id)

    # ------------------------------------------------------------------ the step's ops

    def submit(self, op: KVLoadOp) -> None:
        job = _Job(op, time.monotonic())
        with self._wake:
            self._by_id[op.load_id] = job
            self._pending.append(job)
            if self._idle == 0 and len(self._threads) < MAX_THREADS:
                t = threading.Thread(target=self._run, name="tandem-kv-puller", daemon=True)
                self._threads.append(t)
                t.start()
            self._wake.notify()

    def cancel(self, load_ids: list[int]) -> None:
        with self._wake:
            for i in load_ids:
                job = self._by_id.get(i)
                if job is not None:
                    job.cancelled.set()
            self._wake.notify_all()  # a cancelled load waiting for a busy peer goes now

    # ------------------------------------------------------------------ the thread

    def _take(self) -> _Job | None:
        """The oldest pending load that is cancelled (it touches no peer) or whose prefill
        ranks no other thread is talking to; those ranks become this thread's. Under the lock."""
        for i, job in enumerate(self._pending):
            if job.cancelled.is_set() or not (job.endpoints & self._busy):
                del self._pending[i]
                if not job.cancelled.is_set():
                    job.held = job.endpoints
                    self._busy |= job.held
                return job
        return None

    def _run(self) -> None:
        while True:
            with self._wake:
                while True:
                    if self._stopping:
                        return
                    job = self._take()
                    if job is not None:
                        break
                    self._idle += 1
                    self._wake.wait()
                    self._idle -= 1
            try:
                self._run_job(job)
            finally:
                with self._wake:
                    self._busy -= job.held
                    self._wake.notify_all()

    def _run_job(self, job: _Job) -> None:
        op = job.op
        try:
            if job.cancelled.is_set():
                raise Cancelled("cancelled")
            nbytes, transport = self._load(job)
            rep = KVConnectorReport(rank=self.layout.rank, done=pack([op.load_id]),
                                    nbytes=nbytes, seconds=[time.monotonic() - job.arrived],
                                    transport=transport)
        except PeerError as e:
            rep = KVConnectorReport(rank=self.layout.rank, failed=pack([op.load_id]),
                                    reasons=[str(e)],
                                    refused=pack([op.load_id]) if isinstance(
                                        e, LeaseRefused) else b"")
        except Exception as e:  # a bug in a transport fails this load, not the rank
            logger.exception("KV load %d failed", op.load_id)
            rep = KVConnectorReport(rank=self.layout.rank, failed=pack([op.load_id]),
                                    reasons=[f"{type(e).__name__}: {e}"])
        with self._lock:
            self._by_id.pop(op.load_id, None)
        assert self._push is not None
        with self._push_lock:
            self._push.send(self._encoder.encode(rep))

    def _load(self, job: _Job) -> tuple[int, str]:
        op, lay = job.op, self.layout
        cancelled = job.cancelled.is_set
        remote = unpack(op.remote_block_ids)
        local = unpack(op.block_ids)
        first = self._peer(op, 0, cancelled)
        slices = head_slices(lay.total_kv_heads, lay.rank, lay.kv_heads,
                             len(op.remote_rank_ports), first[1].kv_heads)
        total = 0
        name = ""
        for sl in slices:
            peer, info = self._peer(op, sl.remote_rank, cancelled)
            transport = self._transport(peer, info)
            try:
                try:
                    if transport.name == "nixl":
                        with self._nixl_lock:
                            total += transport.pull(peer, info, op.remote_key, remote, local,
                                                    sl, self.caches, cancelled)
                    else:
                        total += transport.pull(peer, info, op.remote_key, remote, local, sl,
                                                self.caches, cancelled)
                except ShmUnavailable:
                    if self.connector != "auto":
                        raise
                    logger.warning("shared memory with %s is unavailable: TCP pull instead",
                                   peer.addr, exc_info=True)
                    transport = self._transports.setdefault("tcp", TcpTransport())
                    self._transport_of[peer.addr] = transport
                    total += transport.pull(peer, info, op.remote_key, remote, local, sl,
                                            self.caches, cancelled)
                name = transport.name
            except PeerError:
                if peer.broken is not None:  # the connection is gone: start over next time
                    self._drop(peer)
                raise
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # in place before the core may schedule it
        return total, name

    def _peer(self, op: KVLoadOp, rank: int, cancelled: object) -> tuple[Peer, PeerInfo]:
        if not 0 <= rank < len(op.remote_rank_ports):
            raise PeerError(f"no remote rank {rank}")
        key = (op.remote_host, op.remote_rank_ports[rank])
        with self._lock:
            peer = self._peers.pop(key, None)
            if peer is not None:
                self._peers[key] = peer  # most recently used last
        if peer is None:
            peer = Peer(self.ctx, op.remote_host, op.remote_rank_ports[rank], self.secret)
            with self._lock:
                self._peers[key] = peer
                evict = self._evictable()
            for old in evict:
                self._close_peer(old)
        try:
            info = peer.handshake(op.remote_engine_id, cancelled)  # type: ignore[arg-type]
        except PeerError:
            self._drop(peer)
            raise
        self._check_layout(info, len(op.remote_rank_ports), rank)
        return peer, info

    def _check_layout(self, info: PeerInfo, tp: int, rank: int) -> None:
        lay = self.layout
        ours = (lay.num_caches, lay.block_size, lay.total_kv_heads, lay.head_dim, lay.dtype)
        theirs = (info.num_caches, info.block_size, info.total_kv_heads, info.head_dim,
                  info.dtype)
        if ours != theirs:
            raise PeerError(
                "the prefill engine's KV layout (caches, block size, KV heads, head dim, dtype) "
                f"is {theirs}, this engine's is {ours}: not the same model and options")
        if info.tp_size != tp or info.rank != rank:
            raise PeerError(f"the prefill rank at that port is rank {info.rank} of "
                            f"{info.tp_size}, expected rank {rank} of {tp}")

    def _transport(self, peer: Peer, info: PeerInfo) -> Transport:
        with self._lock:  # threads share the transports: one of each kind per rank
            return self._transport_locked(peer, info)

    def _transport_locked(self, peer: Peer, info: PeerInfo) -> Transport:
        t = self._transport_of.get(peer.addr)
        if t is not None:
            return t
        name = self.connector
        shm_ok = ShmTransport.usable(info, self.hostname, self.boot_id, self.device)
        if name == "shm" and not shm_ok:
            raise PeerError("the shm transport needs both engines on this machine, on CPU")
        if name == "auto":
            name = "shm" if shm_ok else ("nixl" if info.nixl_metadata and _nixl_ok() else "tcp")
        if name not in self._transports:
            self._transports[name] = _make_transport(name, self.caches)
        t = self._transports[name]
        self._transport_of[peer.addr] = t
        return t

    def _evictable(self) -> list[Peer]:
        """Over MAX_PEERS: the least recently used connections no thread is using, out of
        the pool. Under the lock."""
        out = []
        for key in list(self._peers):
            if len(self._peers) <= MAX_PEERS:
                break
            if key not in self._busy:
                out.append(self._peers.pop(key))
        return out

    def _close_peer(self, peer: Peer) -> None:
        t = self._transport_of.pop(peer.addr, None)
        if t is not None:
            t.forget(peer)
        peer.close()

    def _drop(self, peer: Peer) -> None:
        with self._lock:
            for key, p in list(self._peers.items()):
                if p is peer:
                    del self._peers[key]
        self._close_peer(peer)

    def close(self) -> None:
        with self._wake:
            self._stopping = True
            for job in self._by_id.values():
                job.cancelled.set()
            self._wake.notify_all()
            threads = list(self._threads)
        for t in threads:
            t.join(timeout=3.0)
        for peer in self._peers.values():
            peer.close()
        self._peers.clear()
        for tr in self._transports.values():
            tr.close()
        if self._push is not None:
            self._push.close(1000)
            self._push = None


def _nixl_ok() -> bool:
    from workers.kv_connector.nixl import nixl_available

    return nixl_available()


def _make_transport(name: str, caches: Sequence[torch.Tensor]) -> Transport:
    if name == "tcp":
        return TcpTransport()
    if name == "shm":
        return ShmTransport()
    from workers.kv_connector.nixl import NixlTransport

    return NixlTransport(caches)
