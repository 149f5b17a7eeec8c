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


# Packed integer arrays are self-describing: one width byte, then the little-endian values.
# Width 2 (uint16) whenever every value fits, else 4 (int32). Token ids of vocabularies up to
# 65,536 and block ids of caches up to 65,536 blocks thus cost two bytes each on the wire.
# An empty sequence packs to b"" (no width byte).
_W16, _W32 = 2, 4


def pack(values: Any) -> bytes:
    """Pack a sequence of ints (list, tuple, array or numpy array)."""
    if hasattr(values, "astype"):  # numpy, without importing numpy here
        if values.size == 0:
            return b""
        if values.min() >= 0 and values.max() <= 0xFFFF:
            return b"\x02" + values.astype("<u2", copy=False).tobytes()
        return b"\x04" + values.astype("<i4", copy=False).tobytes()
    if not values:
        return b""
    try:
        a = array("H", values)
        width = b"\x02"
    except OverflowError:
        a = array("i", values)
        width = b"\x04"
    if not _NATIVE_LITTLE:
        a.byteswap()
    return width + a.tobytes()


def packed_layout(data: bytes) -> tuple[str, int]:
    """(numpy dtype, byte offset) of a packed array; ProtocolError if malformed."""
    if not data:
        return "<i4", 0
    width = data[0]
    if width not in (_W16, _W32) or (len(data) - 1) % width:
        raise ProtocolError(f"malformed packed int array (width byte {width}, {len(data)} bytes)")
    return ("<u2" if width == _W16 else "<i4"), 1


def unpack(data: bytes) -> list[int]:
    """Inverse of ``pack`` into a Python list (workers use ``unpack_np``)."""
    if not data:
        return []
    dtype, off = packed_layout(data)
    a = array("H" if dtype == "<u2" else "i")
    a.frombytes(data[off:])
    if not _NATIVE_LITTLE:
        a.byteswap()
    return a.tolist()


def unpack_np(data: bytes) -> Any:
    """Inverse of ``pack`` as a read-only numpy array (uint16 or int32)."""
    import numpy as np

    dtype, off = packed_layout(data)
    return np.frombuffer(data, dtype=dtype, offset=off)


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
