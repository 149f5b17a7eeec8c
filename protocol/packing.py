"""Packed integer and float arrays: the compact form of token ids, block ids and logprobs inside
messages, and the error every decoder raises.

Kept apart from the frame codec (codec.py) because message types (kv_transfer.py) use these
primitives while the codec needs every message type: both sides import this module.
"""

from __future__ import annotations

import sys
from array import array
from typing import Any

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
