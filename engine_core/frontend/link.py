"""The engine core's two sockets to the frontend: requests in (PULL), outputs out (PUSH).

It also keeps the ids of the requests in flight, so a finished request's id is free again the
moment its last output is sent, and a duplicate id can be refused without touching the first.

Every EngineOutputs carries the queue as the frontend needs it to bound its waiting requests
(launch/admission.py): how many frames this link has read (every frame counts, a bad one too,
so a request the frontend sent is never owed forever) and how many requests wait.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import msgspec
import zmq

from protocol.codec import Encoder, frontend_decoder
from protocol.config import EngineConfig
from protocol.messages import EngineCoreOutput, EngineOutputs, FrontendMessage
from protocol.transport import Endpoints, make_socket, recv_frame


class FrontendLink:
    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        endpoints: Endpoints,
        secret: bytes | None,
        config: EngineConfig,
        encoder: Encoder,
    ) -> None:
        # Frontend sockets stay local (ipc or loopback).
        self.req_sock = make_socket(ctx, zmq.PULL, endpoints.requests, bind=True, secret=secret)
        self.out_sock = make_socket(
            ctx, zmq.PUSH, endpoints.outputs, bind=True, secret=secret, linger_ms=1000
        )
        self.encoder = encoder
        self.decoder = frontend_decoder(config.max_frame_bytes)
        self.inflight: set[str] = set()
        self.frames_seen = 0
        self.frames_reported = 0  # frames_seen of the last EngineOutputs sent
        # requests admitted but not running; the core sets it once its scheduler exists
        self.num_waiting: Callable[[], int] = lambda: 0

    def frames(self, timeout_ms: int) -> Iterator[bytes]:
        """Every frame waiting now, the first one waited for up to ``timeout_ms``."""
        frame = recv_frame(self.req_sock, timeout_ms)
        while frame is not None:
            self.frames_seen += 1
            yield frame
            frame = recv_frame(self.req_sock, 0)

    def decode(self, frame: bytes) -> FrontendMessage:
        """Raises ProtocolError on a bad frame."""
        return self.decoder.decode(frame)

    def send(self, msg: msgspec.Struct) -> None:
        self.out_sock.send(self.encoder.encode(msg))

    def flush(self, outputs: list[EngineCoreOutput]) -> None:
        """Send outputs; the ids of finished requests leave the in-flight set."""
        if not outputs:
            return
        for o in outputs:
            if o.finish_reason is not None:
                self.inflight.discard(o.request_id)
        self.send(self._outputs(outputs))

    def _outputs(self, outputs: list[EngineCoreOutput]) -> EngineOutputs:
        self.frames_reported = self.frames_seen
        return EngineOutputs(outputs, time.time(), self.frames_seen, self.num_waiting())

    def report_seen(self) -> None:
        """Tell the frontend how many frames were read when no output has said so since: its
        admission counts a request in transit until a report covers its frame, and a frame
        that yields no output of its own (an abort, a request that waits) would otherwise be
        counted until the next output, which an idle engine never sends."""
        if self.frames_seen > self.frames_reported:
            self.send(self._outputs([]))

    def reject(self, request_id: str, reason: str) -> None:
        """Finish a request the engine never took, with finish_reason 'error'."""
        out = EngineCoreOutput(
            request_id=request_id, new_token_ids=[], finish_reason="error", error=reason
        )
        self.send(self._outputs([out]))

    def close(self) -> None:
        self.req_sock.close(0)
        self.out_sock.close(1000)
