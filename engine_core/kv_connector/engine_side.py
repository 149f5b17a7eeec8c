"""The engine core's part of the KV connector: its lease port, its links to prefill engines, and
what each turn of the core's loop settles (the ranks' reports, lease messages, deadlines).

A prefill engine binds a ROUTER on ``kv_ip:kv_port`` (the ``remote_port`` of its answers); a
decode engine keeps one DEALER per prefill engine it depends on and sends it KVLeaseControl
(renew, release). Those addresses come from clients' params, so the DEALERs are a pool: at
most MAX_PEERS (least recently used closed first), each closed once no lease is held through
it for PEER_IDLE_S, reconnecting with backoff meanwhile (a dead endpoint costs no CPU).
Only lease bookkeeping travels here; the KV goes rank to rank. tcp:// on a non-loopback
address needs TANDEM_SECRET and is CURVE-authenticated (protocol.transport).
"""

from __future__ import annotations

import logging
import socket
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

import zmq

from engine_core.kv_connector.loads import Address
from engine_core.kv_connector.scheduler_side import KVConnectorScheduler
from protocol.codec import Decoder, Encoder, ProtocolError
from protocol.kv_connector import KVConnectorReport, KVLeaseControl, KVTransferConfig
from protocol.transport import make_socket

if TYPE_CHECKING:
    from engine_core.sched.scheduler import Scheduler
    from protocol.messages import WorkerHello

logger = logging.getLogger("tandem.kv_connector")

# lease messages queued for one unreachable prefill engine before new ones are dropped (a
# dropped renewal costs at most that lease; the engine is likely gone anyway)
CONTROL_HWM = 1000
# the pool of DEALERs to prefill engines: its bound, how long one stays open with no lease held
# through it (long enough for a release to leave after its load ended), how often idle ones
# are looked for, and the reconnect backoff's ceiling for an endpoint that does not answer
MAX_PEERS = 64
PEER_IDLE_S = 30.0
SWEEP_EVERY_S = 1.0
RECONNECT_MAX_MS = 5000


def tcp_addr(host: str, port: int | str) -> str:
    h = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"tcp://{h}:{port}"


def advertised_host(kv_ip: str) -> str:
    """The address other engines reach this one at: kv_ip, or this host's for a wildcard."""
    if kv_ip in ("0.0.0.0", "*", "::"):
        return socket.gethostbyname(socket.gethostname())
    return kv_ip


class KVConnectorEngine:
    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], cfg: KVTransferConfig,
                 secret: bytes | None, clock: Callable[[], float] = time.monotonic) -> None:
        self.ctx = ctx
        self.clock = clock
        self.cfg = cfg
        self.secret = secret
        self.engine_id = cfg.engine_id or uuid.uuid4().hex
        self.host = advertised_host(cfg.kv_ip)
        port = str(cfg.kv_port) if cfg.kv_port else "*"
        self.router = make_socket(ctx, zmq.ROUTER, tcp_addr(cfg.kv_ip, port), bind=True,
                                  secret=secret)
        endpoint = self.router.getsockopt(zmq.LAST_ENDPOINT)
        assert isinstance(endpoint, bytes)
        self.port = int(endpoint.decode().rsplit(":", 1)[1])
        self.encoder = Encoder()
        self.decoder: Decoder[KVLeaseControl] = Decoder(KVLeaseControl, 1 << 20)
        # (host, port) -> (its DEALER, when last used); least recently used first
        self.dealers: OrderedDict[tuple[str, int], tuple[zmq.Socket[bytes], float]] = \
            OrderedDict()
        self._next_sweep = clock() + SWEEP_EVERY_S

    def attach(self, sched: Scheduler, rank_ports: list[int], world_size: int) -> None:
        """Give the scheduler its connector, now that the ranks' block servers are known."""
        sched.kv_connector = KVConnectorScheduler(
            self.cfg, sched.kv_cache_manager, engine_id=self.engine_id, host=self.host,
            port=self.port, rank_ports=rank_ports, world_size=world_size)

    def settle(self, sched: Scheduler, reports: list[KVConnectorReport]) -> None:
        """Apply what arrived (the ranks' ``reports``, consumed here, and lease messages) and
        what time decided; send the lease messages due. Once per turn of the core's loop."""
        conn = sched.kv_connector
        assert conn is not None
        for rep in reports:
            conn.on_report(rep)
        reports.clear()
        while True:
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                conn.on_control(self.decoder.decode(frames[-1]))
            except ProtocolError as e:
                logger.warning("dropped a bad lease message: %s", e)
        conn.tick()
        for addr, msg in conn.take_control():
            self._send(addr, msg)
        now = self.clock()
        if now >= self._next_sweep:
            self._next_sweep = now + SWEEP_EVERY_S
            self._close_idle(conn, now)

    def _send(self, addr: Address, msg: KVLeaseControl) -> None:
        host, port, _ = addr
        key = (host, port)
        entry = self.dealers.pop(key, None)
        if entry is None:
            try:
                sock = make_socket(self.ctx, zmq.DEALER, tcp_addr(host, port), bind=False,
                                   secret=self.secret, hwm=CONTROL_HWM,
                                   reconnect_max_ms=RECONNECT_MAX_MS)
            except (ValueError, zmq.ZMQError) as e:
                logger.warning("cannot reach the prefill engine at %s:%d: %s", host, port, e)
                return
            while len(self.dealers) >= MAX_PEERS:  # the least recently used goes
                _, (old, _) = self.dealers.popitem(last=False)
                old.close(0)
        else:
            sock = entry[0]
        self.dealers[key] = (sock, self.clock())  # most recently used last
        try:
            sock.send(self.encoder.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            pass  # its queue is full: the engine is gone or stuck; its leases run out

    def _close_idle(self, conn: KVConnectorScheduler, now: float) -> None:
        """Close the DEALERs no lease is held through and none was used for PEER_IDLE_S."""
        live = {ref.address[:2] for ref in conn.remote.refs.values()}
        for key, (sock, used) in list(self.dealers.items()):
            if now - used >= PEER_IDLE_S and key not in live:
                del self.dealers[key]
                sock.close(0)

    @property
    def sockets(self) -> list[zmq.Socket[bytes]]:
        """What an idle core waits on besides the frontend and the ranks."""
        return [self.router]

    def close(self) -> None:
        self.router.close(0)
        for sock, _ in self.dealers.values():
            sock.close(0)
        self.dealers.clear()


def attach_connector(kv: KVConnectorEngine, sched: Scheduler,
                     hellos: dict[int, WorkerHello]) -> None:
    """Start-up: the connector needs one KV cache group (a block id names the same tokens in
    every layer) and every rank's block server."""
    from engine_core.worker_link import EngineFatal

    if sched.kv_cache_manager.num_groups != 1:
        raise EngineFatal("--kv-transfer-config needs a model with one KV cache group (no "
                          "sliding-window or hybrid layers)")
    ports = [hellos[r].kv_connector_port for r in range(len(hellos))]
    if kv.cfg.is_producer and not all(ports):
        raise EngineFatal(f"ranks reported no KV block server: ports {ports}")
    kv.attach(sched, ports, len(hellos))
