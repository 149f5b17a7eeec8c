"""Block tables of one KV cache group (vLLM's SingleTypeKVCacheManager).

Every group of a request holds a table of the same length (each covers the same tokens). What
differs per attention type:

- which cached blocks make a prefix-cache hit of a given length (find_longest_cache_hit):
  full attention needs every block of the prefix; a sliding window of W tokens only the blocks
  that the first new query can still see (keys in (L - W, L] for a hit of length L), so the
  blocks before them are the null block;
- which blocks can be given back as the request advances (remove_skipped_blocks): none for
  full attention; for a window, every block that lies entirely before the window of the next
  query, replaced by the null block in the table;
- how many blocks a request can hold at once (max_blocks): all of them for full attention,
  about a window plus one step's chunk for a sliding window.

The pool and the tables' common length are the KVCacheManager's (manager.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from engine_core.kv_cache.block import KVCacheBlock
from engine_core.kv_cache.block_pool import BlockPool
from engine_core.request import BlockHash

# a block table's key: a request id, or (holder kind, name) for a table an internal holder keeps
# after its request finished (the KV connector's leases and loads). A tuple is a key no request
# id (a str) can ever equal, whatever a client names its request.
TableKey = str | tuple[str, str]


class SingleTypeKVCacheManager:
    """Full attention (sliding_window 0); SlidingWindowManager overrides what differs."""

    sliding_window = 0

    def __init__(self, pool: BlockPool, block_size: int, group_id: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.group_id = group_id
        self.req_to_blocks: dict[TableKey, list[KVCacheBlock]] = {}
        # how many leading blocks of each request are registered in the prefix cache
        self.num_cached_block: dict[TableKey, int] = {}

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_num_blocks: int
    ) -> list[KVCacheBlock]:
        """The cached blocks of the longest prefix of at most max_num_blocks blocks."""
        table = self.pool.cached_block_hash_to_block
        gid = self.group_id
        hits: list[KVCacheBlock] = []
        for h in block_hashes[:max_num_blocks]:
            block = table.get(h if gid == 0 else (h, gid))
            if block is None:
                break
            hits.append(block)
        return hits

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> int:
        """Give back the blocks no future query can see; returns how many were freed."""
        return 0

    def next_removal(self, request_id: str) -> int:
        """The smallest num_computed_tokens at which remove_skipped_blocks frees something."""
        return 1 << 62

    def num_live_blocks(self, request_id: str) -> int:
        """Blocks of the request's table that are not the null block."""
        return len(self.req_to_blocks.get(request_id, ()))

    def max_blocks(self, num_tokens: int) -> int:
        """The most blocks a request of num_tokens KV slots holds at one time."""
        return -(-num_tokens // self.block_size)

    def add_hits(self, request_id: str, blocks: list[KVCacheBlock], hits: list[KVCacheBlock]
                 ) -> int:
        """Append prefix-cache hits to a table (one more holder each); returns the number of
        real (non-null) blocks added."""
        self.pool.touch(hits)
        blocks.extend(hits)
        return len(hits)

    def free(self, request_id: TableKey) -> int:
        """Release a request's table, tail first, so its shared prefix is evicted last;
        returns the number of real blocks released."""
        self.num_cached_block.pop(request_id, None)
        blocks = self.req_to_blocks.pop(request_id, None)
        if not blocks:
            return 0
        self.pool.free_blocks(reversed(blocks))
        return len(blocks)


class FullAttentionManager(SingleTypeKVCacheManager):
    pass


class SlidingWindowManager(SingleTypeKVCacheManager):
    def __init__(self, pool: BlockPool, block_size: int, group_id: int, sliding_window: int,
                 max_chunk: int) -> None:
        super().__init__(pool, block_size, group_id)
        self.sliding_window = sliding_window
        # a hit of length L must hold the blocks of keys L - W + 1 .. L - 1
        self.num_window_blocks = -(-(sliding_window - 1) // block_size)
        # tokens one allocation covers at most (a step's chunk plus drafts), for max_blocks
        self.max_chunk = max_chunk
        # index of the first block that is not the null block, per request
        self.first_live: dict[TableKey, int] = {}

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_num_blocks: int
    ) -> list[KVCacheBlock]:
        """The longest L <= max_num_blocks whose last num_window_blocks blocks are all cached
        (or, shorter than that, a fully cached prefix); the earlier blocks are null."""
        null = self.pool.null_block
        hits = [null] * max_num_blocks
        need = self.num_window_blocks
        if need == 0:
            return hits
        table = self.pool.cached_block_hash_to_block
        gid = self.group_id
        end = max_num_blocks  # the candidate hit length: a run of cached blocks ends here
        run = 0
        for i in range(max_num_blocks - 1, -1, -1):
            block = table.get(block_hashes[i] if gid == 0 else (block_hashes[i], gid))
            if block is None:
                end, run = i, 0
                continue
            hits[i] = block
            run += 1
            if run >= need:
                break
        # (a scan that reaches block 0 without a full window ends on a cached prefix: all
        # of blocks 0 .. end - 1 are hits, or end is 0)
        del hits[end:]
        return hits

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> int:
        # the next query sits at num_computed_tokens and sees keys from there - W + 1 on
        first = num_computed_tokens - self.sliding_window + 1
        if first < self.block_size:
            return 0
        skip = first // self.block_size
        start = self.first_live.get(request_id, 0)
        if skip <= start:
            return 0
        blocks = self.req_to_blocks[request_id]
        if skip > len(blocks) - 1:  # keep at least the last block (the next KV goes there)
            skip = len(blocks) - 1
            if skip <= start:
                return 0
        removed = blocks[start:skip]
        blocks[start:skip] = [self.pool.null_block] * (skip - start)
        self.first_live[request_id] = skip
        self.pool.free_blocks(reversed(removed))
        return skip - start

    def next_removal(self, request_id: str) -> int:
        return (self.first_live.get(request_id, 0) + 1) * self.block_size \
            + self.sliding_window - 1

    def num_live_blocks(self, request_id: str) -> int:
        blocks = self.req_to_blocks.get(request_id)
        return len(blocks) - self.first_live.get(request_id, 0) if blocks else 0

    def max_blocks(self, num_tokens: int) -> int:
        # an allocation starting at c and ending at e holds the blocks of keys c - W + 1 ..
        # e - 1: at most ceil((e - c + W - 1) / bs) + 1 of them
        full = -(-num_tokens // self.block_size)
        bound = -(-(self.max_chunk + self.sliding_window - 1) // self.block_size) + 1
        return full if full < bound else bound

    def add_hits(self, request_id: str, blocks: list[KVCacheBlock], hits: list[KVCacheBlock]
                 ) -> int:
        first = 0
        while first < len(hits) and hits[first].is_null:
            first += 1
        real = hits[first:]
        self.pool.touch(real)
        if not blocks:
            self.first_live[request_id] = first
        blocks.extend(hits)
        return len(real)

    def free(self, request_id: TableKey) -> int:
        self.num_cached_block.pop(request_id, None)
        first = self.first_live.pop(request_id, 0)
        blocks = self.req_to_blocks.pop(request_id, None)
        if not blocks:
            return 0
        real = blocks[first:]
        self.pool.free_blocks(reversed(real))
        return len(real)


def make_manager(pool: BlockPool, block_size: int, group_id: int, sliding_window: int,
                 max_chunk: int) -> SingleTypeKVCacheManager:
    if sliding_window:
        return SlidingWindowManager(pool, block_size, group_id, sliding_window, max_chunk)
    return FullAttentionManager(pool, block_size, group_id)
