"""BlockPool: owns every KVCacheBlock, the free queue and the prefix-cache hash map.

A free block may still hold a cached prefix (it keeps its hash until reused), so "free" means
"evictable": the free queue doubles as the LRU list of cache candidates. Block 0 is the null
block: a placeholder id that is never handed out (sliding-window groups put it where their
blocks fell out of the window).

KV cache groups (protocol.kv_cache_spec) share this one pool; a block belongs to one group at a
time. The same token prefix has one cached block per group, so the hash map's key is the block
hash for group 0 (a single-group model pays nothing) and (hash, group) for the others.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from engine_core.kv_cache.block import KVCacheBlock
from engine_core.kv_cache.free_block_queue import FreeKVCacheBlockQueue
from engine_core.request import BlockHash, Request

if TYPE_CHECKING:
    from engine_core.kv_offload import KVOffloadManager


def group_key(block_hash: BlockHash, group_id: int) -> BlockHash:
    """The hash-map key of a block of ``group_id`` holding the prefix ``block_hash``."""
    return block_hash if group_id == 0 else (block_hash, group_id)


def key_group(key: BlockHash) -> int:
    """The group a hash-map key belongs to (hashes are bytes or ints, never tuples)."""
    return key[1] if type(key) is tuple else 0


class KVEventSink:
    """Where the pool reports what enters and leaves the prefix cache (KV cache events for a
    router's index: engine_core/kv_cache/events.py). This default does nothing, so the pool
    calls it unconditionally and the base path carries no feature branch."""

    def stored(self, request: Request, blocks: list[KVCacheBlock], start: int, end: int,
               group_id: int) -> None:
        """blocks[start:end] of ``request`` were just offered to the prefix cache."""

    def removed(self, key: BlockHash) -> None:
        """The cached block under hash-map key ``key`` was dropped (uncached)."""

    def evicting(self, blocks: list[KVCacheBlock]) -> None:
        """``blocks`` are about to be reused: those still holding a hash leave the prefix
        cache. One call per batch, not per block: this runs on every allocation, and a no-op
        call per evicted block cost the scheduler's step a measurable share."""

    def cleared(self) -> None:
        """Every cached prefix was forgotten."""


NO_EVENTS = KVEventSink()


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True, num_groups: int = 1,
                 offload: KVOffloadManager | None = None) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.is_null = True
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[1:])
        # one block per hash: a second block computing the same content simply stays uncached
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        # registered blocks per group (the trace's "cached"), kept exact on register / evict
        self.num_cached_blocks = [0] * num_groups
        # the KV offload tiers: a cached block that is reused for another one is
        # offered to the host tier first, so its prefix can come back without a prefill
        self.offload = offload
        self.events: KVEventSink = NO_EVENTS

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def cache_full_blocks(
        self,
        request: Request,
        blocks: list[KVCacheBlock],
        num_cached: int,
        num_full: int,
        group_id: int = 0,
    ) -> None:
        """Register blocks[num_cached:num_full] of ``request`` (all full) in the hash map."""
        table = self.cached_block_hash_to_block
        hashes = request.block_hashes
        added = 0
        for i in range(num_cached, num_full):
            block = blocks[i]
            # a prefix-cache hit is already registered; the null block (a window group's
            # freed position) never is
            if block.block_hash is not None or block.is_null:
                continue
            h = hashes[i] if group_id == 0 else (hashes[i], group_id)
            if h not in table:
                block.block_hash = h
                table[h] = block
                added += 1
        self.num_cached_blocks[group_id] += added
        self.events.stored(request, blocks, num_cached, num_full, group_id)

    def uncache_blocks(self, blocks: Iterable[KVCacheBlock], group_id: int = 0) -> None:
        """Forget the hashes of blocks whose KV will never be written (registered when their
        tokens were scheduled, then the step dropped the request), so no prefix lookup can
        find them."""
        table = self.cached_block_hash_to_block
        for block in blocks:
            key = block.block_hash
            if key is not None and table.get(key) is block:
                del table[key]
                self.num_cached_blocks[group_id] -= 1
                self.events.removed(key)
            block.block_hash = None

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take blocks from the LRU end; a reused cache candidate loses its hash entry."""
        blocks = self.free_block_queue.popleft_n(num_blocks)
        table = self.cached_block_hash_to_block
        num_cached = self.num_cached_blocks
        offload = self.offload
        self.events.evicting(blocks)
        for block in blocks:
            key = block.block_hash
            if key is not None:
                # full-attention group 0 only (keys of other groups are tuples): the tiers
                # are keyed by the plain block hash, and restores fill group 0's table
                if offload is not None and type(key) is not tuple:
                    offload.on_device_evict(key, block.block_id)
                del table[key]
                num_cached[key[1] if type(key) is tuple else 0] -= 1  # key_group, inlined
                block.block_hash = None
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """A prefix-cache hit: one more holder; a free block leaves the free queue."""
        queue = self.free_block_queue
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one holder each; blocks reaching 0 join the MRU end in the given order."""
        freed = []
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0 and not block.is_null:
                freed.append(block)
        self.free_block_queue.append_n(freed)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; refused (False) while any block is in use."""
        if self.free_block_queue.num_free_blocks != self.num_blocks - 1:
            return False
        if self.offload is not None and not self.offload.reset():
            return False  # copies planned or disk reads in flight: try again later
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        self.num_cached_blocks = [0] * len(self.num_cached_blocks)
        self.events.cleared()
        return True

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        return 1.0 - self.free_block_queue.num_free_blocks / (self.num_blocks - 1)
