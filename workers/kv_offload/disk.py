"""Disk tier of the KV offload: one file per disk slot, read and written by a small
thread pool so the engine step never blocks on the disk.

Each rank keeps its own shard of every block under ``DIR/rank<R>/slot-<N>.kvb``. A record is

    header: magic b"TKVB", format (u16), reserved (u16), block-hash tag (u64),
            layout id (u64), payload length (u64), blake2b-128 digest (16 bytes)
    payload: the block's bytes for this rank (every layer's K and V)

The digest covers the header fields and the payload. A read checks all of it (magic, format,
the tag the scheduler expects for that slot, the pool's layout, the length, the digest):
anything wrong (a missing, truncated or corrupt file, a record of another block or of another
model or dtype) is a miss, reported as failed, and its bytes are never handed on as KV.

Writes go to a temporary name and are renamed into place, so a crash leaves the old record
or none. Operations on one slot run in submission order (a read of a slot waits for the write
planned before it); different slots run in parallel.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

MAGIC = b"TKVB"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<4sHHQQQ16s")
_DIGEST_SIZE = 16
HEADER_BYTES = _HEADER.size
# a read's state; ordered so that the minimum over ranks is the verdict for the block
READ_FAILED, READ_PENDING, READ_OK = 0, 1, 2


class RecordError(ValueError):
    """A disk record that must not be used (the reason is in the message)."""


def layout_id(layout: str) -> int:
    """64-bit id of a pool layout description (dtype and block shape of this rank's shard)."""
    return int.from_bytes(hashlib.blake2b(layout.encode(), digest_size=8).digest(), "little")


def _digest(tag: int, layout: int, payload: memoryview | bytes) -> bytes:
    h = hashlib.blake2b(digest_size=_DIGEST_SIZE)
    h.update(struct.pack("<4sHQQQ", MAGIC, FORMAT_VERSION, tag, layout, len(payload)))
    h.update(payload)
    return h.digest()


def encode_record(tag: int, layout: int, payload: bytes) -> bytes:
    header = _HEADER.pack(MAGIC, FORMAT_VERSION, 0, tag, layout, len(payload),
                          _digest(tag, layout, payload))
    return header + payload


def decode_record(data: bytes | memoryview, tag: int, layout: int, nbytes: int) -> memoryview:
    """The payload of a record that passes every check, else RecordError."""
    view = memoryview(data)
    if len(view) < HEADER_BYTES:
        raise RecordError(f"truncated header ({len(view)} bytes)")
    magic, fmt, _, got_tag, got_layout, length, digest = _HEADER.unpack_from(view)
    if magic != MAGIC:
        raise RecordError("bad magic")
    if fmt != FORMAT_VERSION:
        raise RecordError(f"format {fmt}, expected {FORMAT_VERSION}")
    if got_layout != layout:
        raise RecordError("written for another pool layout (model, dtype or TP size)")
    if got_tag != tag:
        raise RecordError("holds another block")
    if length != nbytes or len(view) != HEADER_BYTES + nbytes:
        raise RecordError(f"length {len(view) - HEADER_BYTES}, header says {length}, "
                          f"expected {nbytes}")
    payload = view[HEADER_BYTES:]
    if _digest(tag, layout, payload) != digest:
        raise RecordError("checksum mismatch")
    return payload


class DiskKVStore:
    def __init__(self, directory: str | os.PathLike[str], rank: int, num_slots: int,
                 layout: str, block_nbytes: int, max_workers: int = 2) -> None:
        self.dir = Path(directory) / f"rank{rank}"
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.num_slots = num_slots
        self.layout = layout_id(layout)
        self.block_nbytes = block_nbytes
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix=f"kv-disk-{rank}")
        self._last_op: dict[int, Future[object]] = {}  # per disk slot: the newest operation
        self._reads: dict[int, Future[bool]] = {}  # per destination host slot

    @staticmethod
    def slots_for(nbytes: int, block_nbytes: int) -> int:
        """Disk slots that ``nbytes`` hold (a record is the header plus one block)."""
        return max(nbytes, 0) // (HEADER_BYTES + block_nbytes)

    def path(self, slot: int) -> Path:
        return self.dir / f"slot-{slot:08d}.kvb"

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"disk slot {slot} outside [0, {self.num_slots})")

    def _submit(self, slot: int, fn: object, *args: object) -> Future[object]:
        # The previous operation on this slot was submitted earlier, so the FIFO pool has
        # started it before this one: waiting on it cannot deadlock.
        prev = self._last_op.get(slot)
        fut = self._pool.submit(self._after, prev, fn, *args)
        self._last_op[slot] = fut
        return fut

    @staticmethod
    def _after(prev: Future[object] | None, fn, *args):  # type: ignore[no-untyped-def]
        if prev is not None:
            prev.exception()  # wait; its failure is its own (a later read finds no record)
        return fn(*args)

    def write(self, slot: int, tag: int, payload: bytes) -> None:
        """Store ``payload`` (a snapshot the caller no longer touches) in the background."""
        self._check_slot(slot)
        if len(payload) != self.block_nbytes:
            raise ValueError(f"payload of {len(payload)} bytes, blocks have {self.block_nbytes}")
        self._submit(slot, self._write, slot, tag, payload)

    def _write(self, slot: int, tag: int, payload: bytes) -> None:
        path = self.path(slot)
        tmp = path.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(encode_record(tag, self.layout, payload))
            os.replace(tmp, path)
        except OSError as e:
            # the slot's next read reports a miss; a full disk must not stop the engine
            log.warning("KV disk tier: writing %s failed: %s", path, e)
            path.unlink(missing_ok=True)

    def read_into(self, slot: int, tag: int, dst: np.ndarray, host_slot: int) -> None:
        """Read the record of ``slot`` into ``dst`` (uint8, the host slot's bytes) in the
        background; ``poll`` reports it under ``host_slot``."""
        self._check_slot(slot)
        if host_slot in self._reads:
            raise RuntimeError(f"host slot {host_slot} already has a disk read in flight")
        fut = self._submit(slot, self._read, slot, tag, dst)
        self._reads[host_slot] = fut  # type: ignore[assignment]

    def _read(self, slot: int, tag: int, dst: np.ndarray) -> bool:
        path = self.path(slot)
        try:
            size = path.stat().st_size
            if size != HEADER_BYTES + self.block_nbytes:  # don't read a wrong-sized file
                raise RecordError(f"file of {size} bytes, expected "
                                  f"{HEADER_BYTES + self.block_nbytes}")
            data = path.read_bytes()
            payload = decode_record(data, tag, self.layout, self.block_nbytes)
            np.copyto(dst, np.frombuffer(payload, dtype=np.uint8))
            return True
        except (OSError, RecordError) as e:
            log.warning("KV disk tier: %s is a miss: %s", path, e)
            return False

    def read_state(self, host_slot: int) -> int:
        """READ_OK, READ_PENDING or READ_FAILED for the read into ``host_slot`` (unchanged by
        asking: the ranks agree on a verdict before anyone acts on it)."""
        fut = self._reads[host_slot]
        if not fut.done():
            return READ_PENDING
        return READ_OK if fut.exception() is None and fut.result() else READ_FAILED

    def forget(self, host_slot: int) -> None:
        """The read into ``host_slot`` has been settled (it is finished)."""
        del self._reads[host_slot]

    @property
    def reads_in_flight(self) -> list[int]:
        return sorted(self._reads)

    def poll(self) -> tuple[list[int], list[int]]:
        """Host slots whose reads finished since the last poll: (verified, failed)."""
        done: list[int] = []
        failed: list[int] = []
        for host_slot in self.reads_in_flight:
            state = self.read_state(host_slot)
            if state != READ_PENDING:
                self.forget(host_slot)
                (done if state == READ_OK else failed).append(host_slot)
        return done, failed

    def wait(self) -> None:
        """Block until every submitted operation has finished (tests, shutdown)."""
        for fut in list(self._last_op.values()):
            fut.exception()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
