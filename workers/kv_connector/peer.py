"""A decode rank's connection to one prefill rank's block server: a DEALER plus a socket
monitor, so a prefill engine that died (connection refused or dropped) or refused our CURVE
handshake (another TANDEM_SECRET) fails the requests at once instead of leaving them to
wait out the lease.

Used only by the puller thread that created it (ZeroMQ sockets are not thread-safe).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from protocol.codec import Encoder, ProtocolError
from protocol.kv_peer import PeerHello, PeerInfo, PeerMessage, PeerReply, peer_decoder
from protocol.transport import make_socket

# keyed by the monitor event's number, as recv_monitor_message reports it
_BROKEN: dict[int, str] = {
    zmq.EVENT_DISCONNECTED: "the connection dropped (the prefill engine died?)",
    zmq.EVENT_CONNECT_RETRIED: "connection refused (no prefill engine listens there)",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "the handshake failed (CURVE keys differ: is "
                                          "TANDEM_SECRET the same on both engines?)",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "the CURVE handshake failed (TANDEM_SECRET differs?)",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "the CURVE handshake was refused (TANDEM_SECRET differs?)",
}
POLL_MS = 50


class PeerError(RuntimeError):
    """A load from this peer cannot finish (the message says why)."""


class Cancelled(PeerError):
    pass


class LeaseRefused(PeerError):
    """The prefill rank refused the lease the load presented: no such lease (a wrong or
    guessed key), one that ended, or blocks it does not hold. The core counts these apart."""


def tcp_addr(host: str, port: int) -> str:
    h = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"tcp://{h}:{port}"


class Peer:
    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], host: str, port: int,
                 secret: bytes | None) -> None:
        self.addr = tcp_addr(host, port)
        self.sock = make_socket(ctx, zmq.DEALER, self.addr, bind=False, secret=secret)
        self.monitor = self.sock.get_monitor_socket(sum(_BROKEN))
        self.encoder = Encoder()
        self.decoder = peer_decoder()
        self.info: PeerInfo | None = None
        self.broken: str | None = None
        self._seq = 0
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)

    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def send(self, msg: PeerMessage) -> None:
        self._check()
        self.sock.send(self.encoder.encode(msg))

    def recv(self, cancelled: Callable[[], bool]) -> tuple[PeerMessage, list[zmq.Frame]]:
        """The next message and the frames after it; waits until it comes, the connection
        breaks (PeerError) or ``cancelled()`` (Cancelled)."""
        while True:
            self._check()
            if cancelled():
                raise Cancelled("cancelled")
            events = dict(self.poller.poll(POLL_MS))
            if self.monitor in events:
                self._read_monitor()
            if self.sock in events:
                frames = self.sock.recv_multipart(copy=False)
                try:
                    msg = self.decoder.decode(frames[0].buffer)
                except ProtocolError as e:
                    self._break(f"undecodable answer: {e}")
                    continue
                return msg, frames[1:]

    def handshake(self, engine_id: str, cancelled: Callable[[], bool]) -> PeerInfo:
        if self.info is None:
            self.send(PeerHello(engine_id=engine_id))
            msg, _ = self.recv(cancelled)
            if not isinstance(msg, PeerInfo):
                raise PeerError(f"{self.addr} answered {type(msg).__name__} to a hello")
            if msg.error:
                raise PeerError(f"{self.addr}: {msg.error}")
            if engine_id and msg.engine_id and msg.engine_id != engine_id:
                raise PeerError(f"{self.addr} is engine {msg.engine_id!r}, not {engine_id!r} "
                                "(the prefill engine restarted?)")
            self.info = msg
        return self.info

    def reply(self, seq: int, cancelled: Callable[[], bool]) -> tuple[PeerReply, list[zmq.Frame]]:
        while True:
            msg, rest = self.recv(cancelled)
            if isinstance(msg, PeerReply) and msg.seq == seq:
                return msg, rest
            # an answer to a request given up earlier: skip it

    def _read_monitor(self) -> None:
        while self.monitor.poll(0):
            ev = recv_monitor_message(self.monitor)
            why = _BROKEN.get(ev["event"])
            if why is not None:
                self._break(why)

    def _break(self, why: str) -> None:
        if self.broken is None:
            self.broken = f"prefill rank at {self.addr}: {why}"

    def _check(self) -> None:
        if self.broken is not None:
            raise PeerError(self.broken)

    def close(self) -> None:
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(0)
        self.sock.close(0)


def wait_briefly(cancelled: Callable[[], bool], seconds: float) -> None:
    """Sleep in slices, so a cancel is seen within one."""
    end = time.monotonic() + seconds
    while time.monotonic() < end and not cancelled():
        time.sleep(min(0.005, max(0.0, end - time.monotonic())))
