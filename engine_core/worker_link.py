"""The engine core's side of the worker link: the broadcast and results sockets, reading and
decoding what the ranks send, health pings, and naming a rank that died, hung or failed.

EngineCore owns one WorkerLink; the scheduler never sees the sockets.
"""

from __future__ import annotations

import os
import time

import msgspec
import zmq

from protocol.codec import Encoder, ProtocolError, worker_decoder
from protocol.config import EngineConfig
from protocol.liveness import process_running
from protocol.messages import HealthPing, HealthPong, WorkerError
from protocol.transport import Endpoints, make_socket, recv_frame

PING_INTERVAL_S = 0.5  # workers exit after ~1.5 s without hearing from us
# How long a worker error waits to see whether a peer rank died (the usual cause of a broken
# collective): a SIGKILLed rank closes its sockets a moment before it becomes a zombie.
PEER_DEATH_GRACE_S = 0.5
# Substrings of gloo/NCCL errors that mean the other end of a collective went away.
BROKEN_COLLECTIVE_MARKERS = ("by peer", "Connection reset", "Connection closed", "remote process")


class EngineFatal(RuntimeError):
    """The engine cannot go on (a rank died, hung, raised or disagreed)."""


class WorkerLink:
    """PUB to every rank (steps, pings, control), PULL from every rank (results, pongs,
    errors), and what the engine knows of each rank's liveness."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], endpoints: Endpoints,
                 secret: bytes | None, config: EngineConfig, world_size: int) -> None:
        self.config = config
        self.world_size = world_size
        # worker sockets may be tcp across nodes
        self.pub = make_socket(ctx, zmq.PUB, endpoints.broadcast, bind=True, secret=secret)
        self.results = make_socket(ctx, zmq.PULL, endpoints.results, bind=True, secret=secret)
        self.encoder = Encoder()
        self.worker_dec = worker_decoder(config.max_frame_bytes)
        self.last_seen = [time.monotonic()] * world_size
        self.last_ping = 0.0
        self.ping_nonce = 0
        self.parent_pid = os.getppid()
        self.local_pids: dict[int, int] = {}  # rank -> pid, for ranks on this host
        # the ranks' messages for the core's holding pens (engine_core.pens), whichever read
        # found them (mid-step or idle), in arrival order; the core routes them between steps.
        # ``reply_types`` (set by the core from its pens) says which messages are kept.
        self.reply_types: frozenset[type[msgspec.Struct]] = frozenset()
        self.replies: list[msgspec.Struct] = []
        # each rank's map sizes from its latest pong (workers/census.py), for the census
        self.rank_census: dict[int, dict[str, int]] = {}

    def close(self) -> None:
        self.pub.close(0)
        self.results.close(0)

    def recv(self, deadline: float) -> msgspec.Struct | None:
        """One worker message, or None after 200 ms without one."""
        if time.monotonic() > deadline:
            raise EngineFatal("timed out waiting for the workers to start")
        if os.getppid() != self.parent_pid:
            raise EngineFatal("the frontend process died")
        frame = recv_frame(self.results, 200)
        return None if frame is None else self.decode(frame)

    def decode(self, frame: bytes) -> msgspec.Struct:
        try:
            msg = self.worker_dec.decode(frame)
        except ProtocolError as e:
            raise EngineFatal(f"undecodable message from a worker: {e}") from None
        rank = getattr(msg, "rank", None)
        if isinstance(rank, int) and 0 <= rank < self.world_size:
            self.last_seen[rank] = time.monotonic()
        if type(msg) in self.reply_types:
            self.replies.append(msg)
        elif isinstance(msg, HealthPong) and 0 <= msg.rank < self.world_size:
            self.rank_census[msg.rank] = msg.census
        return msg

    def drain(self) -> None:
        """Read what the workers sent while no step was in flight (health pongs) so that
        last_seen stays fresh: without it an idle engine declared its ranks hung after
        worker_timeout_s. A rank's error report ends the engine as it does during a step."""
        while (frame := recv_frame(self.results, 0)) is not None:
            msg = self.decode(frame)
            if isinstance(msg, WorkerError):
                raise EngineFatal(self.describe_error(msg))

    def maybe_ping(self) -> None:
        now = time.monotonic()
        if now - self.last_ping >= PING_INTERVAL_S:
            self.last_ping = now
            self.ping_nonce += 1
            self.pub.send(self.encoder.encode(HealthPing(self.ping_nonce)))

    def check_alive(self) -> None:
        if os.getppid() != self.parent_pid:
            raise EngineFatal("the frontend process died")
        now = time.monotonic()
        silent = [r for r, t in enumerate(self.last_seen) if now - t > self.config.worker_timeout_s]
        if silent:
            # Name every silent rank: under TP one hung rank stalls the others in a collective,
            # so "rank 0" alone would point at the wrong process.
            worst = max(now - self.last_seen[r] for r in silent)
            raise EngineFatal(
                f"rank {', '.join(map(str, silent))} has not responded for {worst:.1f} s "
                f"(worker_timeout_s={self.config.worker_timeout_s}); a rank hung in a "
                "collective stalls its peers too"
            )

    def describe_error(self, msg: WorkerError) -> str:
        text = f"worker rank {msg.rank} failed: {msg.message}"
        if msg.traceback:
            text += "\n" + msg.traceback
        # A rank killed mid-collective shows up first as its peer's "connection closed" error;
        # name the rank that died, since that is the root cause.
        broken = any(m in msg.message for m in BROKEN_COLLECTIVE_MARKERS)
        gone = self._gone_peers(msg.rank) if broken else ""
        if gone:
            text = f"{gone}; {text}"
        return text

    def _gone_peers(self, reporter: int) -> str:
        """'worker rank R (pid P) died' for local ranks that are gone, polled briefly."""
        deadline = time.monotonic() + PEER_DEATH_GRACE_S
        while True:
            dead = [
                f"worker rank {r} (pid {pid}) died"
                for r, pid in sorted(self.local_pids.items())
                if r != reporter and not process_running(pid)
            ]
            if dead or time.monotonic() >= deadline:
                return ", ".join(dead)
            time.sleep(0.02)
