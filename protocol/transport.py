"""ZeroMQ endpoints and sockets between frontend, engine core and workers.

Socket map (the engine core binds everything, so it is the only fixed point):
- requests:  frontend PUSH  -> core PULL
- outputs:   core PUSH      -> frontend PULL
- broadcast: core PUB       -> every worker SUB (one encode, same bytes to all ranks)
- results:   every worker PUSH -> core PULL

High-water marks default to 0 (unlimited): a step plan or a sampled token must never be
silently dropped; backpressure comes from the engine's own step loop instead. LINGER defaults
to 0 so that closing never hangs on a dead peer.
"""

from __future__ import annotations

import ipaddress
import os
import random
import shutil
import tempfile
import time
from collections.abc import Mapping

import msgspec
import zmq

from protocol.auth import apply_curve, secret_from_env
from protocol.codec import Decoder, Encoder, ProtocolError, broadcast_decoder, worker_decoder
from protocol.messages import HealthPing, WorkerMessage, WorkerReady

__all__ = [
    "ENDPOINTS_ENV",
    "Endpoints",
    "answer_sync",
    "ipc_endpoints",
    "is_loopback_addr",
    "make_socket",
    "recv_frame",
    "remove_ipc_dir",
    "secret_from_env",
    "tcp_endpoints",
    "wait_subscribers",
]

ENDPOINTS_ENV = "TANDEM_ENDPOINTS"
SYNC_PING_INTERVAL_S = 0.02


class Endpoints(msgspec.Struct, frozen=True):
    requests: str  # frontend -> engine core   (core binds PULL, frontend connects PUSH)
    outputs: str  # engine core -> frontend   (core binds PUSH, frontend connects PULL)
    broadcast: str  # engine core -> workers    (core binds PUB, workers connect SUB)
    results: str  # workers -> engine core    (core binds PULL, workers connect PUSH)

    def to_env(self) -> dict[str, str]:
        return {ENDPOINTS_ENV: msgspec.json.encode(self).decode()}

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Endpoints | None:
        """The endpoints a parent process passed down, or None when not set."""
        raw = env.get(ENDPOINTS_ENV)
        if not raw:
            return None
        try:
            return msgspec.json.decode(raw, type=cls)
        except msgspec.DecodeError as e:
            raise ValueError(f"malformed {ENDPOINTS_ENV}: {e}") from None


def ipc_endpoints() -> tuple[Endpoints, str]:
    """Four ipc:// endpoints in a fresh private directory; returns (endpoints, directory).

    mkdtemp creates the directory with mode 0700, so only this user can connect. The paths
    are kept short because a unix socket path is limited to ~107 bytes.
    """
    path = tempfile.mkdtemp(prefix="tandem-")
    os.chmod(path, 0o700)  # explicit: mkdtemp already does it, but the umask must not matter
    eps = Endpoints(
        requests=f"ipc://{path}/req",
        outputs=f"ipc://{path}/out",
        broadcast=f"ipc://{path}/bc",
        results=f"ipc://{path}/res",
    )
    return eps, path


def tcp_endpoints(host: str, base_port: int) -> Endpoints:
    """tcp://host:base_port+0..3 (requests, outputs, broadcast, results)."""
    h = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return Endpoints(
        requests=f"tcp://{h}:{base_port}",
        outputs=f"tcp://{h}:{base_port + 1}",
        broadcast=f"tcp://{h}:{base_port + 2}",
        results=f"tcp://{h}:{base_port + 3}",
    )


def remove_ipc_dir(path: str) -> None:
    """Remove an ipc_endpoints() directory; safe to call twice or on a missing path."""
    shutil.rmtree(path, ignore_errors=True)


def _tcp_host(addr: str) -> str:
    rest = addr[len("tcp://") :]
    if rest.startswith("["):
        return rest[1 : rest.index("]")]
    host = rest.rsplit(":", 1)[0]
    return host.split(";")[-1]  # "src;dst" connect syntax: the destination matters


def is_loopback_addr(addr: str) -> bool:
    """True for tcp:// addresses that can only be reached from this machine."""
    host = _tcp_host(addr)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # "*", an interface name or a DNS name: reachable from outside
        return False


def make_socket(
    ctx: zmq.Context,
    kind: int,
    addr: str,
    *,
    bind: bool,
    secret: bytes | None = None,
    hwm: int = 0,
    linger_ms: int = 0,
    reconnect_max_ms: int = 0,
) -> zmq.Socket:
    """Create, configure, then bind or connect one socket.

    tcp:// with a ``secret`` uses CURVE (server = the binding side). tcp:// on a host other
    than loopback without a secret is refused: anyone on the network could inject requests
    or read step plans. ``reconnect_max_ms``: back off reconnecting up to this (0: ZeroMQ's
    fixed 100 ms), for connections to endpoints a client named, which may never answer.
    """
    is_tcp = addr.startswith("tcp://")
    if is_tcp and not secret and not is_loopback_addr(addr):
        raise ValueError(
            f"refusing unauthenticated tcp endpoint {addr}: set TANDEM_SECRET "
            "(the same value on every node) or use a loopback address"
        )
    sock = ctx.socket(kind)
    try:
        sock.setsockopt(zmq.LINGER, linger_ms)
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.setsockopt(zmq.RCVHWM, hwm)
        if reconnect_max_ms:
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, reconnect_max_ms)
        if is_tcp:
            if ":" in _tcp_host(addr):
                sock.setsockopt(zmq.IPV6, 1)
            # a silently dead node (cable, kernel panic) must surface as a timeout, not a hang
            sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
            sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, 30)
            if secret:
                apply_curve(sock, secret, server=bind)
        if kind == zmq.SUB:
            sock.setsockopt(zmq.SUBSCRIBE, b"")
        if bind:
            sock.bind(addr)
        else:
            sock.connect(addr)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


def recv_frame(sock: zmq.Socket, timeout_ms: int) -> bytes | None:
    """One frame, or None if none arrives within ``timeout_ms`` (-1 waits forever).

    Blocks inside zmq_recv with RCVTIMEO rather than zmq_poll + a non-blocking recv: the
    poll path costs one more wake-up and round of Python per frame, which measured about
    25 us more step-broadcast latency to 4 workers on a 2-core machine. Either way nothing
    busy-waits, so a waiting process leaves its core to the workers.
    """
    if timeout_ms == 0:
        try:
            return sock.recv(zmq.NOBLOCK, copy=False).bytes
        except zmq.Again:
            return None
    if sock.rcvtimeo != timeout_ms:
        sock.rcvtimeo = timeout_ms
    try:
        return sock.recv(copy=False).bytes
    except zmq.Again:
        return None


def wait_subscribers(
    pub: zmq.Socket,
    pull: zmq.Socket,
    n: int,
    timeout_s: float,
    *,
    encoder: Encoder | None = None,
    decoder: Decoder[WorkerMessage] | None = None,
) -> list[WorkerMessage]:
    """Publish HealthPing(nonce) every 20 ms until ``n`` distinct ranks answered WorkerReady.

    PUB drops everything sent before a subscriber's connection is complete (slow joiner), so
    the core must not send step 0 before this returns. Other worker messages received in the
    meantime (e.g. WorkerHello, WorkerError) are returned in arrival order so the caller does
    not lose them; undecodable frames are skipped. Raises TimeoutError naming missing ranks.
    """
    enc = encoder or Encoder()
    dec = decoder or worker_decoder()
    nonce = random.getrandbits(62)
    ping = enc.encode(HealthPing(nonce=nonce))
    ready: set[int] = set()
    others: list[WorkerMessage] = []
    deadline = time.monotonic() + timeout_s
    next_ping = 0.0
    while len(ready) < n:
        now = time.monotonic()
        if now >= deadline:
            missing = sorted(set(range(n)) - ready)
            raise TimeoutError(
                f"{len(ready)}/{n} workers subscribed after {timeout_s:.1f}s; "
                f"missing ranks {missing}"
            )
        if now >= next_ping:
            pub.send(ping)
            next_ping = now + SYNC_PING_INTERVAL_S
        wait_ms = max(1, int(1000 * (min(next_ping, deadline) - now)))
        frame = recv_frame(pull, wait_ms)
        if frame is None:
            continue
        try:
            msg = dec.decode(frame)
        except ProtocolError:
            continue
        if isinstance(msg, WorkerReady):
            if msg.nonce == nonce:
                ready.add(msg.rank)
        else:
            others.append(msg)
    return others


def answer_sync(
    sub: zmq.Socket,
    push: zmq.Socket,
    rank: int,
    timeout_s: float,
    *,
    encoder: Encoder | None = None,
) -> int:
    """Worker side of wait_subscribers: wait for the first sync HealthPing, answer WorkerReady.

    Returns the sync nonce: more pings with the same nonce may still be queued on ``sub``
    (the core pings until the slowest rank is in) and the worker loop should ignore them.
    Anything else seen before the ping cannot belong to this run and is dropped.
    """
    enc = encoder or Encoder()
    dec = broadcast_decoder()
    deadline = time.monotonic() + timeout_s
    while True:
        left_ms = int(1000 * (deadline - time.monotonic()))
        if left_ms <= 0:
            raise TimeoutError(f"rank {rank}: no sync ping from the engine core in {timeout_s}s")
        frame = recv_frame(sub, left_ms)
        if frame is None:
            continue
        try:
            msg = dec.decode(frame)
        except ProtocolError:
            continue
        if isinstance(msg, HealthPing):
            push.send(enc.encode(WorkerReady(rank=rank, nonce=msg.nonce)))
            return msg.nonce
