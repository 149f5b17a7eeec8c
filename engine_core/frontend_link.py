"""The engine core's two sockets to the frontend: requests in (PULL), outputs out (PUSH).

It also keeps the ids of the requests in flight, so a finished request's id is free again the
moment its last output is sent, and a duplicate id can be refused without touching the first.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import msgspec
import zmq

from protocol.codec import Encoder, frontend_decoder
from protocol.config import EngineConfig
from protocol.messages import EngineOutputs, FrontendMessage, RequestOutput
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

    def frames(self, timeout_ms: int) -> Iterator[bytes]:
        """Every frame waiting now, the first one waited for up to ``timeout_ms``."""
        frame = recv_frame(self.req_sock, timeout_ms)
        while frame is not None:
            yield frame
            frame = recv_frame(self.req_sock, 0)

    def decode(self, frame: bytes) -> FrontendMessage:
        """Raises ProtocolError on a bad frame."""
        return self.decoder.decode(frame)

    def send(self, msg: msgspec.Struct) -> None:
        self.out_sock.send(self.encoder.encode(msg))

    def flush(self, outputs: list[RequestOutput]) -> None:
        """Send outputs; the ids of finished requests leave the in-flight set."""
        if not outputs:
            return
        for o in outputs:
            if o.finish_reason is not None:
                self.inflight.discard(o.request_id)
        self.send(EngineOutputs(outputs, time.time()))

    def reject(self, request_id: str, reason: str) -> None:
        """Finish a request the engine never took, with finish_reason 'error'."""
        out = RequestOutput(
            request_id=request_id, new_token_ids=[], finish_reason="error", error=reason
        )
        self.send(EngineOutputs([out], time.time()))

    def close(self) -> None:
        self.req_sock.close(0)
        self.out_sock.close(1000)
