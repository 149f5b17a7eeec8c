"""KVCacheManager: per-request block tables on top of the BlockPool, plus prefix caching.

The scheduler asks two questions: "what prefix of this request is already cached?"
(get_computed_blocks) and "can this request get room for N more tokens?" (allocate_slots,
all or nothing).
"""

from __future__ import annotations

from engine_core.block_pool import BlockPool
from engine_core.kv_cache_block import KVCacheBlock
from engine_core.kv_cache_hashing import BlockHasher, get_hash_fn
from engine_core.request import Request


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        hash_fn: str = "sha256",
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks  # including the null block
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.block_hasher = BlockHasher(block_size, get_hash_fn(hash_fn))
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # how many leading blocks of each request are registered in the prefix cache
        self.num_cached_block: dict[str, int] = {}
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found
        # sum of every block table's length (a block shared by two tables counts twice): what
        # the admission gate subtracts from the running requests' full-length needs
        self.num_held_blocks = 0

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.free_block_queue.num_free_blocks

    def attach_hasher(self, request: Request) -> None:
        """Give a new request its block-hash chain (only needed with prefix caching)."""
        if self.enable_caching:
            request.set_block_hasher(self.block_hasher, self.block_size)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of full blocks, capped so at least one token is computed
        (the model must run on something to sample the next token)."""
        if not self.enable_caching:
            return [], 0
        table = self.block_pool.cached_block_hash_to_block
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for h in request.block_hashes[:max_blocks]:
            block = table.get(h)
            if block is None:
                break
            hits.append(block)
        num_hit_tokens = len(hits) * self.block_size
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_hit_tokens
        return hits, num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Room for ``num_new_tokens`` (+ lookahead) after the computed ones.

        Returns the newly allocated blocks (maybe empty), or None when they do not fit, in
        which case nothing changed. Blocks are registered in the prefix cache only up to
        request.num_tokens, so speculative tokens never enter it.
        """
        rid = request.request_id
        blocks = self.req_to_blocks.get(rid)
        if blocks is None:  # first allocation: registered only if it succeeds
            blocks = []
            self.req_to_blocks[rid] = blocks
        bs = self.block_size
        end = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_hit = len(new_computed_blocks) if new_computed_blocks else 0
        num_new_blocks = (end + num_lookahead_tokens + bs - 1) // bs - len(blocks) - num_hit
        pool = self.block_pool
        new_blocks: list[KVCacheBlock] = []
        if num_new_blocks > 0 or num_hit:
            # hits on free blocks leave the free queue, so they compete with new blocks
            num_evictable_hits = (
                sum(1 for b in new_computed_blocks if b.ref_cnt == 0) if new_computed_blocks else 0
            )
            if num_new_blocks > pool.free_block_queue.num_free_blocks - num_evictable_hits:
                if not blocks:
                    del self.req_to_blocks[rid]
                return None
            if new_computed_blocks:
                pool.touch(new_computed_blocks)
                blocks.extend(new_computed_blocks)
                self.num_held_blocks += num_hit
            if num_new_blocks > 0:
                new_blocks = pool.get_new_blocks(num_new_blocks)
                blocks.extend(new_blocks)
                self.num_held_blocks += num_new_blocks
        limit = len(blocks) * bs
        if self.enable_caching:
            num_full = (end if end < request.num_tokens else request.num_tokens) // bs
            num_cached = self.num_cached_block.get(rid, 0)
            if num_full > num_cached:
                pool.cache_full_blocks(request, blocks, num_cached, num_full)
                self.num_cached_block[rid] = num_cached = num_full
            # the next call with an end past this fills a block that must be cached
            next_full = (num_cached + 1) * bs - 1
            if next_full < limit:
                limit = next_full
        request.kv_fast_limit = limit
        return new_blocks

    def num_blocks_to_hold(
        self,
        request: Request,
        num_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> int:
        """How many blocks ``request`` would still take from the free queue to hold
        ``num_tokens`` KV slots: new blocks past what it holds (and its prefix-cache hits
        cover), plus the hits that sit in the free queue (touching them takes them out)."""
        hits = new_computed_blocks or ()
        held = len(self.req_to_blocks.get(request.request_id, ())) + len(hits)
        need = -(-num_tokens // self.block_size) - held
        evictable_hits = sum(1 for b in hits if b.ref_cnt == 0)
        return (need if need > 0 else 0) + evictable_hits

    def free(self, request: Request) -> None:
        """Release a request's blocks tail first, so its shared prefix is evicted last."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        if blocks:
            self.num_held_blocks -= len(blocks)
        self.num_cached_block.pop(request.request_id, None)
        request.kv_fast_limit = 0
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def get_blocks(self, request: Request) -> list[KVCacheBlock]:
        return self.req_to_blocks.get(request.request_id, [])

    def get_block_ids(self, request: Request) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request.request_id, ())]

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()
