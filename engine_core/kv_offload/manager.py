"""KVOffloadManager: the scheduler's accounting of the host and disk KV tiers.

Keyed by the prefix cache's chained block hash (cache_salt is folded into the first block's
hash, so salted requests never share tier entries either). Blocks enter the host tier when the
device pool evicts a cached block (or eagerly from a preempted request), the host tier's LRU
victims spill to disk, and lookups find the longest run of leading blocks held in either tier.

Policy on copies in two tiers: tiers are exclusive, with one exception. A disk -> host
promotion keeps the disk record, so the block is in both tiers with the SAME version (the host
bytes were read from that record, checksum verified), and evicting it from the host later needs
no disk write. Any other overlap is refused: a device eviction of a block held only on disk
writes a new host copy (a new version: the device's bytes need not be bit-identical to the
older copy) and drops the disk record. ``check_invariants`` enforces it.

Restores read only host entries that are ready: a disk hit is first promoted (``prefetch``),
the workers read it in the background and confirm (``complete_loads``), so a step never waits
on the disk and a corrupt record is dropped before anything reads it.

Copies of one step accumulate here and leave as one ``KVTransfers`` (``take_transfers``);
the workers execute them in a fixed order (protocol/kv_transfer.py), which together with the
pins (tier.py) makes reusing a slot or a device block within the same step safe.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

from engine_core.kv_offload.tier import OffloadTier, TierEntry, block_hash_tag
from engine_core.request import BlockHash
from protocol.kv_transfer import KVTransfers, pack_pairs, pack_tags


class SpillCopy(NamedTuple):
    host_slot: int
    disk_slot: int


class OffloadCopy(NamedTuple):
    device_block_id: int
    host_slot: int


class RestoreCopy(NamedTuple):
    host_slot: int
    device_block_id: int


class TierLookup(NamedTuple):
    num_blocks: int  # leading blocks held in the host or disk tier
    num_ready: int  # leading blocks restorable now (ready in the host tier)
    num_on_disk: int  # among num_blocks: only on disk or still loading from it


class KVOffloadManager:
    def __init__(self, num_host_blocks: int, num_disk_blocks: int = 0,
                 bytes_per_block: int = 0) -> None:
        self.host = OffloadTier("host", num_host_blocks)
        self.disk = OffloadTier("disk", num_disk_blocks)
        self.bytes_per_block = bytes_per_block  # per rank; only for the byte counters
        self._next_version = 0
        # this step's copies, in planning order
        self._to_disk: list[tuple[int, int]] = []
        self._to_disk_tags: list[int] = []
        self._from_disk: list[tuple[int, int]] = []
        self._from_disk_tags: list[int] = []
        self._to_host: list[tuple[int, int]] = []
        self._to_device: dict[int, int] = {}  # device block -> host slot (last plan wins)
        self._pinned: list[TierEntry] = []
        # device blocks whose KV this step's forward (or restore) writes: their current bytes
        # are not the bytes their hash names yet, so they must not be offloaded this step
        self._uncomputed: set[int] = set()
        # unconfirmed disk -> host reads: host slot -> (host entry, disk entry)
        self._loads: dict[int, tuple[TierEntry, TierEntry]] = {}
        self.counters: dict[str, int] = dict.fromkeys(
            ("host_hits", "disk_hits", "offloaded", "spilled", "dropped", "declined",
             "load_failures", "lookups", "lookup_hits"), 0)

    @property
    def enabled(self) -> bool:
        return self.host.num_slots > 0

    # ---------------------------------------------------------------- device pool -> host

    def mark_uncomputed(self, device_block_ids: Iterable[int]) -> None:
        """Blocks (newly allocated or restored) that this step writes; see _uncomputed."""
        self._uncomputed.update(device_block_ids)

    def on_device_evict(self, block_hash: BlockHash, device_block_id: int) -> OffloadCopy | None:
        """The device pool drops cached block ``block_hash`` (to reuse ``device_block_id``):
        plan its copy into the host tier, or decline (None) when the tier already holds the
        hash, the block's bytes are not final yet, or no host slot can be freed."""
        if not self.enabled or device_block_id in self._uncomputed:
            self.counters["declined"] += 1
            return None
        held = self.host.get(block_hash)
        if held is not None:  # any copy under the hash is that prefix's KV: keep the old one
            self.host.touch(held)
            self.counters["declined"] += 1
            return None
        if not self._disk_copy_replaceable(block_hash) or not self._make_host_room():
            self.counters["declined"] += 1
            return None
        return self._store(block_hash, device_block_id)

    def offload_request(self, block_hashes: Sequence[BlockHash],
                        device_block_ids: Sequence[int]) -> list[OffloadCopy]:
        """A preempted request's full blocks, copied while free host slots last (nothing else
        is evicted for them); blocks the tiers already hold are skipped."""
        copies: list[OffloadCopy] = []
        if not self.enabled:
            return copies
        for h, d in zip(block_hashes, device_block_ids, strict=False):
            if d in self._uncomputed:
                break  # later blocks of the request are not computed either
            if h in self.host or not self._disk_copy_replaceable(h):
                continue
            if self.host.num_free_slots == 0:
                break
            copies.append(self._store(h, d))
        return copies

    def _disk_copy_replaceable(self, block_hash: BlockHash) -> bool:
        # a disk record written by this step's spill cannot be dropped within the step (its
        # slot would be written twice); keep it, the block is not lost
        record = self.disk.get(block_hash)
        return record is None or record.evictable

    def _store(self, block_hash: BlockHash, device_block_id: int) -> OffloadCopy:
        on_disk = self.disk.get(block_hash)
        if on_disk is not None:  # an older instance: exclusive tiers, the fresh copy wins
            self.disk.remove(on_disk)
        entry = self.host.insert(block_hash, self._new_version())
        self._pin(entry)
        self._to_host.append((device_block_id, entry.slot))
        self.counters["offloaded"] += 1
        return OffloadCopy(device_block_id, entry.slot)

    def _new_version(self) -> int:
        self._next_version += 1
        return self._next_version

    def _pin(self, entry: TierEntry) -> None:
        if not entry.step_pinned:
            entry.step_pinned = True
            self._pinned.append(entry)

    def _make_host_room(self) -> bool:
        if self.host.num_free_slots:
            return True
        victim = self.host.lru_victim()
        if victim is None:
            return False
        self._evict_host(victim)
        return True

    def _evict_host(self, entry: TierEntry) -> SpillCopy | None:
        """Move a host entry to disk (or drop it); its slot is free for this step's copies,
        which is safe because the workers snapshot spilled slots before anything else."""
        self.host.remove(entry)
        on_disk = self.disk.get(entry.block_hash)
        if on_disk is not None:
            # only a promoted copy shares a hash with disk, and it is the same bytes
            assert on_disk.version == entry.version
            self.disk.touch(on_disk)
            return None
        if not self._make_disk_room():
            self.counters["dropped"] += 1
            return None
        record = self.disk.insert(entry.block_hash, entry.version)
        self._pin(record)
        self._to_disk.append((entry.slot, record.slot))
        self._to_disk_tags.append(block_hash_tag(entry.block_hash))
        self.counters["spilled"] += 1
        return SpillCopy(entry.slot, record.slot)

    def _make_disk_room(self) -> bool:
        if self.disk.num_free_slots:
            return True
        victim = self.disk.lru_victim()
        if victim is None:
            return False
        self.disk.remove(victim)
        self.counters["dropped"] += 1
        return True

    # ---------------------------------------------------------------- lookups and restores

    def lookup(self, block_hashes: Sequence[BlockHash]) -> TierLookup:
        """How many leading blocks of ``block_hashes`` (those past the device prefix-cache hit)
        the tiers hold; changes nothing."""
        n = ready = on_disk = 0
        ready_run = True
        host, disk = self.host, self.disk
        for h in block_hashes:
            e = host.get(h)
            if e is not None and not e.loading:
                if ready_run:
                    ready += 1
            elif e is not None or h in disk:
                ready_run = False
                on_disk += 1
            else:
                break
            n += 1
        self.counters["lookups"] += 1
        self.counters["lookup_hits"] += n > 0
        return TierLookup(n, ready, on_disk)

    def prefetch(self, block_hashes: Sequence[BlockHash]) -> int:
        """Start disk -> host reads for the disk-only blocks among the leading tier hits.
        Returns how many were started; the workers confirm each with ``complete_loads``."""
        started = 0
        for h in block_hashes:  # protect the run from the room we make below
            e = self.host.get(h)
            if e is None:
                e = self.disk.get(h)
                if e is None:
                    break
            else:
                self.host.touch(e)
            self._pin(e)
        for h in block_hashes:
            if h in self.host:
                continue
            record = self.disk.get(h)
            if record is None:
                break
            record.readers += 1  # so that making room cannot evict the record we read
            if not self._make_host_room():
                record.readers -= 1
                break
            self.disk.touch(record)
            entry = self.host.insert(h, record.version)
            entry.loading = True
            self._loads[entry.slot] = (entry, record)
            self._from_disk.append((record.slot, entry.slot))
            self._from_disk_tags.append(block_hash_tag(h))
            self.counters["disk_hits"] += 1
            started += 1
        return started

    def complete_loads(self, done_host_slots: Iterable[int],
                       failed_host_slots: Iterable[int]) -> None:
        """The workers' report on disk -> host reads (every rank's: a read failed on any rank
        is failed). A failed record is dropped from both tiers; it is never read as data."""
        for slot in done_host_slots:
            entry, record = self._take_load(slot)
            entry.loading = False
        for slot in failed_host_slots:
            entry, record = self._take_load(slot)
            self.host.remove(entry)
            if self.disk.get(record.block_hash) is record:
                self.disk.remove(record)
            self.counters["load_failures"] += 1

    def _take_load(self, slot: int) -> tuple[TierEntry, TierEntry]:
        try:
            entry, record = self._loads.pop(slot)
        except KeyError:
            raise ValueError(f"host slot {slot} has no disk read in flight") from None
        record.readers -= 1
        return entry, record

    @property
    def num_loads_in_flight(self) -> int:
        return len(self._loads)

    def reserve_restore(self, block_hashes: Sequence[BlockHash]) -> int:
        """Pin the leading ready host blocks for this step and return how many; call before
        allocating their device blocks, whose evictions would otherwise be free to push exactly
        these blocks out of the host tier. Unused pins end with the step."""
        n = 0
        for h in block_hashes:
            e = self.host.get(h)
            if e is None or e.loading:
                break
            self.host.touch(e)
            self._pin(e)
            n += 1
        return n

    def plan_restore(self, block_hashes: Sequence[BlockHash],
                     new_device_block_ids: Sequence[int]) -> list[RestoreCopy]:
        """Copy host blocks into freshly allocated device blocks, before the step's forward.
        Every hash must be ready in the host tier: reserved by ``reserve_restore`` this step."""
        if len(block_hashes) != len(new_device_block_ids):
            raise ValueError("one device block per restored hash")
        entries = []
        for h in block_hashes:
            e = self.host.get(h)
            if e is None or e.loading:
                raise ValueError(f"block {h!r} is not ready in the host tier")
            entries.append(e)
        copies = []
        for e, d in zip(entries, new_device_block_ids, strict=True):
            self.host.touch(e)
            self._pin(e)
            self._to_device[d] = e.slot
            self._uncomputed.add(d)
            copies.append(RestoreCopy(e.slot, d))
        self.counters["host_hits"] += len(copies)
        return copies

    # ---------------------------------------------------------------- per step

    def has_transfers(self) -> bool:
        return bool(self._to_disk or self._from_disk or self._to_host or self._to_device)

    def take_transfers(self) -> KVTransfers | None:
        """This step's copies for the step plan (None when there are none); ends the step's
        pins. Call once per step, after scheduling."""
        for e in self._pinned:
            e.step_pinned = False
        self._pinned.clear()
        self._uncomputed.clear()
        if not self.has_transfers():
            return None
        out = KVTransfers(
            host_to_disk=pack_pairs(self._to_disk),
            disk_to_host=pack_pairs(self._from_disk),
            device_to_host=pack_pairs(self._to_host),
            host_to_device=pack_pairs([(s, d) for d, s in self._to_device.items()]),
            host_to_disk_tags=pack_tags(self._to_disk_tags),
            disk_to_host_tags=pack_tags(self._from_disk_tags),
        )
        self._byte_counts()
        self._to_disk, self._to_disk_tags = [], []
        self._from_disk, self._from_disk_tags = [], []
        self._to_host, self._to_device = [], {}
        return out

    def _byte_counts(self) -> None:
        c = self.counters
        for key, n in (("device_to_host", len(self._to_host)),
                       ("host_to_device", len(self._to_device)),
                       ("host_to_disk", len(self._to_disk)),
                       ("disk_to_host", len(self._from_disk))):
            c[f"{key}_blocks"] = c.get(f"{key}_blocks", 0) + n

    def reset(self) -> bool:
        """Forget both tiers (with reset_prefix_cache); refused while copies are planned or
        disk reads are in flight."""
        if self.has_transfers() or self._loads:
            return False
        for e in self._pinned:
            e.step_pinned = False
        self._pinned.clear()
        self.host.clear()
        self.disk.clear()
        return True

    def stats(self) -> dict[str, float]:
        """Counters for get_stats(), the benchmark JSON and the scheduler trace."""
        c = self.counters
        out: dict[str, float] = {
            "kv_offload_host_blocks": len(self.host),
            "kv_offload_host_capacity": self.host.num_slots,
            "kv_offload_disk_blocks": len(self.disk),
            "kv_offload_disk_capacity": self.disk.num_slots,
            "kv_offload_loads_in_flight": len(self._loads),
        }
        for key in ("host_hits", "disk_hits", "offloaded", "spilled", "dropped", "declined",
                    "load_failures", "lookups", "lookup_hits"):
            out[f"kv_offload_{key}"] = c[key]
        for key in ("device_to_host", "host_to_device", "host_to_disk", "disk_to_host"):
            out[f"kv_offload_bytes_{key}"] = c.get(f"{key}_blocks", 0) * self.bytes_per_block
        return out

    def check_invariants(self) -> None:
        """Slot accounting of both tiers and the two-tier policy (see the module docstring)."""
        self.host.check()
        self.disk.check()
        for e in self.host:
            record = self.disk.get(e.block_hash)
            if record is not None:
                assert record.version == e.version, (
                    f"{e.block_hash!r} is in both tiers with different bytes")
            if e.loading:
                assert self._loads.get(e.slot, (None,))[0] is e, "a loading entry has no read"
        for slot, (e, record) in self._loads.items():
            assert e.slot == slot and e.loading and self.host.get(e.block_hash) is e
            assert self.disk.get(record.block_hash) is record and record.readers > 0
        assert sum(r.readers for r in self.disk) == len(self._loads), "disk readers drifted"
        assert all(e.step_pinned for e in self._pinned)
        pinned = {id(e) for e in self._pinned}
        assert all(id(e) in pinned for e in (*self.host, *self.disk) if e.step_pinned)
