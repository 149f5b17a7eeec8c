"""One offload tier (host memory or disk): a fixed set of slots, an LRU map block hash -> slot.

Pure bookkeeping: the bytes live in the workers (one shard per rank, same slot numbers on every
rank). Entries that a copy in flight still reads or writes are not evictable:
- ``step_pinned``: named by a copy of the step being planned (the pin ends when the step's
  copies are handed to the workers, after which the workers' fixed copy order keeps them safe);
- ``loading``: a host entry whose disk -> host read has not been confirmed by the workers;
- ``readers``: a disk entry that an unconfirmed disk -> host read is reading.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

from engine_core.request import BlockHash

_MASK64 = (1 << 64) - 1


def tier_capacity(nbytes: int, bytes_per_block: int) -> int:
    """Blocks that ``nbytes`` of a tier holds (per rank: every rank holds its own shard)."""
    if bytes_per_block <= 0:
        raise ValueError(f"bytes_per_block must be > 0, got {bytes_per_block}")
    return max(nbytes, 0) // bytes_per_block


def block_hash_tag(block_hash: BlockHash) -> int:
    """A 64-bit tag of a block hash (or of the block pool's per-group key), written into disk
    records and checked on read (a record found under the wrong slot is then a miss). sha256
    hashes are uniform bytes, so their first 8 bytes serve; the "fast" hashes are Python ints."""
    if isinstance(block_hash, bytes | bytearray):
        return int.from_bytes(bytes(block_hash[:8]).ljust(8, b"\0"), "little")
    if isinstance(block_hash, int):
        return block_hash & _MASK64
    if isinstance(block_hash, tuple) and len(block_hash) == 2:
        # the block pool's key for a block of KV cache group g > 0: (hash, g)
        inner, group = block_hash
        return (block_hash_tag(inner) ^ (group * 0x9E3779B97F4A7C15)) & _MASK64
    raise TypeError(f"unsupported block hash type {type(block_hash).__name__}")


@dataclass(slots=True, eq=False)
class TierEntry:
    block_hash: BlockHash
    slot: int
    # which offloaded instance of the bytes this copy holds: a new one per device -> host copy,
    # kept by spills and promotions, so "same version" means "byte-identical copies"
    version: int
    loading: bool = False
    step_pinned: bool = False
    readers: int = 0

    @property
    def evictable(self) -> bool:
        return not (self.step_pinned or self.loading or self.readers)


class OffloadTier:
    def __init__(self, name: str, num_slots: int) -> None:
        if num_slots < 0:
            raise ValueError(f"{name} tier: num_slots must be >= 0, got {num_slots}")
        self.name = name
        self.num_slots = num_slots
        # least recently used first
        self.entries: OrderedDict[BlockHash, TierEntry] = OrderedDict()
        # popped from the end: slot 0 first, so a lightly used tier touches few pages
        self._free_slots: list[int] = list(range(num_slots - 1, -1, -1))

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[TierEntry]:
        return iter(self.entries.values())

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def get(self, block_hash: BlockHash) -> TierEntry | None:
        return self.entries.get(block_hash)

    def touch(self, entry: TierEntry) -> None:
        self.entries.move_to_end(entry.block_hash)

    def insert(self, block_hash: BlockHash, version: int) -> TierEntry:
        """A new most-recently-used entry in a free slot (the caller made room)."""
        if block_hash in self.entries:
            raise ValueError(f"{self.name} tier already holds {block_hash!r}")
        if not self._free_slots:
            raise RuntimeError(f"{self.name} tier has no free slot")
        entry = TierEntry(block_hash, self._free_slots.pop(), version)
        self.entries[block_hash] = entry
        return entry

    def remove(self, entry: TierEntry) -> None:
        """Forget ``entry``; its slot is free for the next insert."""
        del self.entries[entry.block_hash]
        self._free_slots.append(entry.slot)

    def lru_victim(self) -> TierEntry | None:
        """The least recently used evictable entry; None when every entry is in use. Pinned
        entries are few (one step's copies), so the walk is short."""
        for entry in self.entries.values():
            if entry.evictable:
                return entry
        return None

    def clear(self) -> None:
        self.entries.clear()
        self._free_slots = list(range(self.num_slots - 1, -1, -1))

    def check(self) -> None:
        """Slot accounting: every slot is either free or held by exactly one entry."""
        held = [e.slot for e in self.entries.values()]
        free = self._free_slots
        assert len(set(held)) == len(held), f"{self.name}: a slot is held twice"
        assert len(set(free)) == len(free), f"{self.name}: a slot is free twice"
        assert not set(held) & set(free), f"{self.name}: a slot is both free and held"
        assert sorted(held + free) == list(range(self.num_slots)), f"{self.name}: slot leak"
        for h, e in self.entries.items():
            assert e.block_hash == h, f"{self.name}: entry filed under the wrong hash"
