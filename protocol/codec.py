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
    AddRequest,
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
    "packed_layout", "request_id_of", "unpack", "unpack_f32", "unpack_np", "worker_decoder",
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


# The head of an AddRequest: its tag and request id, the rest ignored. When a frame fails to
# decode as a whole, this names the request it meant to send, so the sender is answered with
# an error rather than left waiting for a request the engine dropped.
class _AddHead(msgspec.Struct, array_like=True, tag=AddRequest.__struct_config__.tag):
    request_id: str


_HEADS = msgspec.msgpack.Decoder(_AddHead)


def request_id_of(frame: bytes | memoryview) -> str | None:
    """The request id of a frame that meant to carry an AddRequest (None when it did not, or
    when even that cannot be read). Call only for a frame the full decoder refused: this one
    checks the header but nothing past the id."""
    if len(frame) < 3 or frame[0] != MAGIC or frame[1] != PROTOCOL_VERSION:
        return None
    try:
        return _HEADS.decode(memoryview(frame)[2:]).request_id
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, RecursionError,
            MemoryError, OverflowError):
        return None
