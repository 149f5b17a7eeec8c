"""Wire form of the KV offload tiers' block copies.

The scheduler owns the tier accounting and names every copy; the workers only execute them.
One step's copies travel as one ``KVTransfers`` (a field of the step plan), O(copies): a steady
step with no evictions or restores carries None there.

Each direction is a flat packed array (``protocol.packing.pack``) of ``(src, dst)`` pairs:

==================  ==========================  =============================================
field               src -> dst                  executed
==================  ==========================  =============================================
host_to_disk        host slot -> disk slot      1st: a snapshot of the slot, written later
disk_to_host        disk slot -> host slot      2nd: read in the background, reported back
device_to_host      device block -> host slot   3rd: before this step's forward writes any KV
host_to_device      host slot -> device block   4th: before this step's forward reads any KV
==================  ==========================  =============================================

That fixed order is part of the contract: the scheduler relies on it when one step both
evicts a block and reuses its slot (a host slot spilled to disk and then refilled from the
device; a device block offloaded and then the target of a restore).

Disk records carry a 64-bit tag derived from the block hash (``*_tags``: one little-endian
uint64 per pair), written into the record's header and checked on read, so a record found in
the wrong slot, left over from another block or torn by a crash is a miss, never data.

``KVLoadResult`` travels back (workers -> scheduler): which disk -> host reads finished, and
which failed (missing file, bad checksum, wrong tag or layout, I/O error).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Sequence

import msgspec

from protocol import packing

assert array("Q").itemsize == 8, "disk tags need an 8-byte unsigned C long long"
_NATIVE_LITTLE = sys.byteorder == "little"

Pair = tuple[int, int]


class KVTransfers(msgspec.Struct, array_like=True, kw_only=True):
    """One step's tier copies; every field a packed flat list of (src, dst) pairs."""

    host_to_disk: bytes = b""
    disk_to_host: bytes = b""
    device_to_host: bytes = b""
    host_to_device: bytes = b""
    host_to_disk_tags: bytes = b""  # one uint64 per host_to_disk pair
    disk_to_host_tags: bytes = b""  # one uint64 per disk_to_host pair


class KVLoadResult(msgspec.Struct, array_like=True, kw_only=True):
    """Disk -> host reads settled since the last report, by destination host slot."""

    done_host_slots: bytes = b""  # packed: verified and in place
    failed_host_slots: bytes = b""  # packed: unusable; the scheduler drops the block


def pack_pairs(pairs: Iterable[Pair]) -> bytes:
    flat: list[int] = []
    for src, dst in pairs:
        flat.append(src)
        flat.append(dst)
    return packing.pack(flat)


def unpack_pairs(data: bytes) -> list[Pair]:
    """Inverse of ``pack_pairs``; ProtocolError on an odd count or a negative id."""
    flat = packing.unpack(data)
    if len(flat) % 2:
        raise packing.ProtocolError(
            f"packed (src, dst) pairs hold an odd number of ids ({len(flat)})")
    if flat and min(flat) < 0:
        raise packing.ProtocolError("negative block or slot id in a KV transfer")
    return list(zip(flat[0::2], flat[1::2], strict=True))


def pack_tags(tags: Sequence[int]) -> bytes:
    a = array("Q", tags)
    if not _NATIVE_LITTLE:
        a.byteswap()
    return a.tobytes()


def unpack_tags(data: bytes) -> list[int]:
    if len(data) % 8:
        raise packing.ProtocolError(
            f"packed uint64 tags field has {len(data)} bytes, not a multiple of 8")
    a = array("Q")
    a.frombytes(data)
    if not _NATIVE_LITTLE:
        a.byteswap()
    return a.tolist()


class DecodedTransfers(msgspec.Struct, kw_only=True):
    """``KVTransfers`` unpacked and checked (what a worker executes)."""

    host_to_disk: list[Pair]
    disk_to_host: list[Pair]
    device_to_host: list[Pair]
    host_to_device: list[Pair]
    host_to_disk_tags: list[int]
    disk_to_host_tags: list[int]

    def __len__(self) -> int:
        return (len(self.host_to_disk) + len(self.disk_to_host) + len(self.device_to_host)
                + len(self.host_to_device))


def decode_transfers(t: KVTransfers) -> DecodedTransfers:
    """Unpack every direction; ProtocolError on malformed arrays or a tag count mismatch, so a
    worker never half-executes a bad plan."""
    out = DecodedTransfers(
        host_to_disk=unpack_pairs(t.host_to_disk),
        disk_to_host=unpack_pairs(t.disk_to_host),
        device_to_host=unpack_pairs(t.device_to_host),
        host_to_device=unpack_pairs(t.host_to_device),
        host_to_disk_tags=unpack_tags(t.host_to_disk_tags),
        disk_to_host_tags=unpack_tags(t.disk_to_host_tags),
    )
    if len(out.host_to_disk_tags) != len(out.host_to_disk):
        raise packing.ProtocolError(f"{len(out.host_to_disk)} host->disk copies but "
                            f"{len(out.host_to_disk_tags)} tags")
    if len(out.disk_to_host_tags) != len(out.disk_to_host):
        raise packing.ProtocolError(f"{len(out.disk_to_host)} disk->host copies but "
                            f"{len(out.disk_to_host_tags)} tags")
    # A destination named twice in one direction would make the result depend on copy order
    # (index_copy_ with repeated indices is undefined): the scheduler never plans it.
    for name in ("host_to_disk", "disk_to_host", "device_to_host", "host_to_device"):
        pairs: list[Pair] = getattr(out, name)
        if len({dst for _, dst in pairs}) != len(pairs):
            raise packing.ProtocolError(f"a destination appears twice in {name}")
    return out


def is_empty(t: KVTransfers) -> bool:
    return not (t.host_to_disk or t.disk_to_host or t.device_to_host or t.host_to_device)
