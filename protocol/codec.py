"""Frame encoding: a 2-byte header (magic, protocol version) + typed msgpack (msgspec).

No pickle: a decoder only ever builds the Structs of its own union. Anything else (garbage,
truncated, oversized, unknown tag, wrong version) raises ``ProtocolError``, which receivers
report and survive.
"""

from __future__ import annotations

import sys
from array import array
from typing import Any, Generic, TypeVar

import msgspec

from protocol.messages import (
    PROTOCOL_VERSION,
    EngineMessage,
    FrontendMessage,
    WorkerBroadcast,
    WorkerMessage,
)

MAGIC = 0xA7
HEADER = bytes([MAGIC, PROTOCOL_VERSION])
DEFAULT_MAX_FRAME_BYTES = 64 * 1024 * 1024

T = TypeVar("T")

assert array("i").itemsize == 4, "packed int32 arrays need a 4-byte C int"
_NATIVE_LITTLE = sys.byteorder == "little"


class ProtocolError(ValueError):
    """A frame that cannot be decoded into a message of the expected kind."""


def pack(values: Any) -> bytes:
    """Pack a sequence of ints (list, tuple, array or numpy array) as little-endian int32."""
    if hasattr(values, "astype"):  # numpy, without importing numpy here
        return values.astype("<i4", copy=False).tobytes()
    a = array("i", values)
    if not _NATIVE_LITTLE:
        a.byteswap()
    return a.tobytes()


def unpack(data: bytes) -> list[int]:
    """Inverse of ``pack`` into a Python list (workers use numpy.frombuffer instead)."""
    if len(data) % 4:
        raise ProtocolError(f"packed int32 field has {len(data)} bytes, not a multiple of 4")
    a = array("i")
    a.frombytes(data)
    if not _NATIVE_LITTLE:
        a.byteswap()
    return a.tolist()


def pack_f32(values: Any) -> bytes:
    if hasattr(values, "astype"):
        return values.astype("<f4", copy=False).tobytes()
    a = array("f", values)
    if not _NATIVE_LITTLE:
        a.byteswap()
    return a.tobytes()


def unpack_f32(data: bytes) -> list[float]:
    if len(data) % 4:
        raise ProtocolError(f"packed float32 field has {len(data)} bytes, not a multiple of 4")
    a = array("f")
    a.frombytes(data)
    if not _NATIVE_LITTLE:
        a.byteswap()
    return a.tolist()


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
                f"protocol version {frame[1]} is not supported (this build speaks {PROTOCOL_VERSION})"
            )
        try:
            return self._dec.decode(memoryview(frame)[2:])  # type: ignore[no-any-return]
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
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
