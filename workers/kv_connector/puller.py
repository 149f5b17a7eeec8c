"""A decode rank's puller: runs the loads the step diffs name, on its own thread, and reports
each one to the engine core (its own PUSH socket, so a report never waits for a step).

A load reads this rank's heads of the prompt's blocks from every prefill rank that holds some
of them (layout.py), through the transport chosen once per prefill rank at the first
connection: the configured one, or with "auto" shared memory on the same machine (CPU), else
NIXL when it imports, else the TCP pull. A cancelled load (the core gave it up or the request
was aborted) stops within one poll and is reported failed; the core frees its blocks only
after every rank reported it.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
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
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._by_id: dict[int, _Job] = {}
        self._lock = threading.Lock()
        self._peers: dict[tuple[str, int], Peer] = {}
        self._transport_of: dict[str, Transport] = {}  # peer address -> its transport
        self._transports: dict[str, Transport] = {}
        self._results_addr: str | None = None
        self._push: zmq.Socket[bytes] | None = None
        self._encoder = Encoder()
        self.thread = threading.Thread(target=self._run, name="tandem-kv-puller", daemon=True)

    def start(self, results_addr: str) -> None:
        self._results_addr = results_addr
        self.thread.start()

    # ------------------------------------------------------------------ the step's ops

    def submit(self, op: KVLoadOp) -> None:
        job = _Job(op, time.monotonic())
        with self._lock:
            self._by_id[op.load_id] = job
        self._jobs.put(job)

    def cancel(self, load_ids: list[int]) -> None:
        with self._lock:
            for i in load_ids:
                job = self._by_id.get(i)
                if job is not None:
                    job.cancelled.set()

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        assert self._results_addr is not None
        self._push = make_socket(self.ctx, zmq.PUSH, self._results_addr, bind=False,
                                 secret=self.secret, linger_ms=1000)
        try:
            while True:
                job = self._jobs.get()
                if job is None:
                    return
                self._run_job(job)
        finally:
            for peer in self._peers.values():
                peer.close()
            for t in self._transports.values():
                t.close()
            self._push.close(1000)

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
        peer = self._peers.get(key)
        if peer is None:
            peer = Peer(self.ctx, op.remote_host, op.remote_rank_ports[rank], self.secret)
            self._peers[key] = peer
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

    def _drop(self, peer: Peer) -> None:
        for key, p in list(self._peers.items()):
            if p is peer:
                del self._peers[key]
        t = self._transport_of.pop(peer.addr, None)
        if t is not None:
            t.forget(peer)
        peer.close()

    def close(self) -> None:
        if self.thread.is_alive():
            with self._lock:
                for job in self._by_id.values():
                    job.cancelled.set()
            self._jobs.put(None)
            self.thread.join(timeout=3.0)


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
