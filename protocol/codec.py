"""Frame encoding: a 2-byte header (magic, protocol version) + typed msgpack (msgspec).

No pickle: a decoder only ever builds the Structs of its own union. Anything else (garbage,
truncated, oversized, unknown tag, wrong version) raises ``ProtocolError``, which receivers
report and survive.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec

from protocol.messages import (
    PROTOCOL_VERSION,
    EngineMessage,
    FrontendMessage,
    WorkerBroadcast,
    WorkerMessage,
)
from protocol.packing import (  # re-exported: callers take the codec and its packing together
    ProtocolError,
    pack,
    pack_f32,
    packed_layout,
    unpack,
    unpack_f32,
    unpack_np,
)

MAGIC = 0xA7
HEADER = bytes([MAGIC, PROTOCOL_VERSION])
DEFAULT_MAX_FRAME_BYTES = 64 * 1024 * 1024

T = TypeVar("T")

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES", "HEADER", "MAGIC", "Decoder", "Encoder", "ProtocolError",
    "broadcast_decoder", "engine_decoder", "frontend_decoder", "pack", "pack_f32",
    "packed_layout", "unpack", "unpack_f32", "unpack_np", "worker_decoder",
]

class Encoder:
    """Encodes any message Struct into one frame (header + msgpack)."""

    def __init__(self) -> None:
        self._enc = msgspec.msgpack.Encoder()
        self._buf = bytearray()

    def encode(self, msg: msgspec.Struct) -> bytes:
        buf = self._buf
        buf[:] = HEADER
        self._enc.encode_into(msg, buf, 2)
        return bytes(buf)


class Decoder(Generic[T]):
    """Decodes frames into one union of message types; every failure is a ProtocolError."""

    def __init__(self, msg_type: Any, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self._dec = msgspec.msgpack.Decoder(msg_type)
        self.max_frame_bytes = max_frame_bytes

    def decode(self, frame: bytes | memoryview) -> T:
        n = len(frame)
        if n > self.max_frame_bytes:
            raise ProtocolError(f"frame of {n} bytes exceeds the limit of {self.max_frame_bytes}")
        if n < 3:
            raise ProtocolError(f"frame of {n} bytes is too short")
        if frame[0] != MAGIC:
            raise ProtocolError(f"bad magic byte 0x{frame[0]:02x} (not a Tandem frame)")
        if frame[1] != PROTOCOL_VERSION:
            raise ProtocolError(
                f"protocol version {frame[1]} is not supported "
                f"(this build speaks {PROTOCOL_VERSION})"
            )
        try:
            return self._dec.decode(memoryview(frame)[2:])  # type: ignore[no-any-return]
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as e:
            raise ProtocolError(f"undecodable frame: {e}") from None
        except (RecursionError, MemoryError, OverflowError) as e:
            raise ProtocolError(f"undecodable frame: {type(e).__name__}") from None


def frontend_decoder(max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Decoder[FrontendMessage]:
    return Decoder(FrontendMessage, max_frame_bytes)


def engine_decoder(max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Decoder[EngineMessage]:
    return Decoder(EngineMessage, max_frame_bytes)


def broadcast_decoder(max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Decoder[WorkerBroadcast]:
    return Decoder(WorkerBroadcast, max_frame_bytes)


def worker_decoder(max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Decoder[WorkerMessage]:
    return Decoder(WorkerMessage, max_frame_bytes)
