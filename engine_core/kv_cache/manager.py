"""KVCacheManager: per-request block tables on top of the BlockPool, plus prefix caching.

The scheduler asks two questions: "what prefix of this request is already cached?"
(get_computed_blocks) and "can this request get room for N more tokens?" (allocate_slots,
all or nothing).

A model has one KV cache group per attention type (protocol.kv_cache_spec): one block table
per group and request, all of the same length, in one shared BlockPool. The group managers
(single_type_manager.py) know what differs per type; the coordinator
(coordinator.py) finds the prefix-cache hit every group accepts. A single
full-attention group (every Llama) takes the same steps as before groups existed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from engine_core.kv_cache.block import KVCacheBlock
from engine_core.kv_cache.block_pool import BlockPool
from engine_core.kv_cache.coordinator import KVCacheBlocks, make_coordinator
from engine_core.kv_cache.hashing import BlockHasher, get_hash_fn
from engine_core.kv_cache.single_type_manager import TableKey, make_manager
from engine_core.request import Request
from protocol.kv_cache_spec import KVCacheGroupSpec

if TYPE_CHECKING:
    from engine_core.kv_offload import KVOffloadManager, TierLookup

_NO_LIMIT = 1 << 62


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        hash_fn: str = "sha256",
        kv_cache_groups: Sequence[KVCacheGroupSpec] | None = None,
        max_chunk: int = 8192,
        offload: KVOffloadManager | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        groups = list(kv_cache_groups) if kv_cache_groups else [KVCacheGroupSpec(0, ())]
        self.kv_cache_groups = groups
        self.num_groups = len(groups)
        self.num_blocks = num_blocks  # including the null block
        self.block_size = block_size
        self.enable_caching = enable_caching
        # the KV offload tiers behind the device pool; None: evicted prefixes are
        # gone, as without --kv-offload-memory
        self.offload = offload
        self.block_pool = BlockPool(num_blocks, enable_caching, self.num_groups, offload)
        self.block_hasher = BlockHasher(block_size, get_hash_fn(hash_fn))
        # max_chunk: the most tokens one allocation covers (token budget + drafts), which
        # bounds what a sliding-window group holds at once
        self.managers = [
            make_manager(self.block_pool, block_size, g, spec.sliding_window, max_chunk)
            for g, spec in enumerate(groups)
        ]
        self.window_managers = [m for m in self.managers if m.sliding_window]
        self.coordinator = make_coordinator(self.managers, enable_caching)
        # group 0's tables: every group's table of a request has this length
        self.req_to_blocks = self.managers[0].req_to_blocks
        self.num_cached_block = self.managers[0].num_cached_block
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found
        # real (non-null) blocks in every table (a block shared by two tables counts twice):
        # what the admission gate subtracts from the running requests' full-length needs
        self.num_held_blocks = 0
        # blocks that sliding-window groups gave back as requests advanced, per group
        self.num_freed_by_window = [0] * self.num_groups

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

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """Longest cached prefix of full blocks that every group accepts, capped so at least
        one token is computed (the model must run on something to sample the next token).
        Returns (hit blocks per group, or [] for none; hit length in tokens)."""
        if not self.enable_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits, num_hit_blocks = self.coordinator.find_longest_cache_hit(
            request.block_hashes, max_blocks
        )
        num_hit_tokens = num_hit_blocks * self.block_size
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_hit_tokens
        return hits, num_hit_tokens

    def get_offloaded_prefix(self, request: Request, num_device_hit_blocks: int) -> TierLookup:
        """How many blocks right after the device prefix-cache hit the offload tiers hold,
        under get_computed_blocks' cap (at least one token is always computed)."""
        assert self.offload is not None
        max_blocks = (request.num_tokens - 1) // self.block_size
        return self.offload.lookup(request.block_hashes[num_device_hit_blocks:max_blocks])

    def remove_skipped_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Sliding-window groups give back the blocks no later query of ``request`` can see
        (every query from num_computed_tokens on); the null block takes their place."""
        rid = request.request_id
        for m in self.window_managers:
            if rid in m.req_to_blocks:
                freed = m.remove_skipped_blocks(rid, num_computed_tokens)
                if freed:
                    self.num_held_blocks -= freed
                    self.num_freed_by_window[m.group_id] += freed

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_restored_blocks: int = 0,
        delay_cache_blocks: bool = False,
    ) -> list[KVCacheBlock] | None:
        """Room for ``num_new_tokens`` (+ lookahead) after the computed ones.

        Returns the newly allocated blocks, group 0's then group 1's ... (the same number per
        group, maybe none), or None when they do not fit, in which case nothing changed
        except that window groups may have given back blocks no query can see any more.
        Blocks are registered in the prefix cache only up to request.num_tokens, so
        speculative tokens never enter it.

        ``num_restored_blocks``: that many blocks right after the prefix-cache hit come back
        from the host tier (reserved by the caller: KVOffloadManager.reserve_restore); they
        are counted in ``num_new_computed_tokens`` and get the first new blocks, which this
        step's copies fill before the forward reads them.

        ``delay_cache_blocks``: the new tokens' KV arrives later (pulled from a prefill
        engine), so nothing enters the prefix cache now; the allocation that follows the load
        registers the blocks, once they hold what their hashes name.
        """
        rid = request.request_id
        managers = self.managers
        if self.window_managers:
            # first, so the blocks that left the window can serve this allocation
            computed = request.num_computed_tokens + num_new_computed_tokens
            for m in self.window_managers:
                if computed >= m.next_removal(rid) and rid in m.req_to_blocks:
                    freed = m.remove_skipped_blocks(rid, computed)
                    self.num_held_blocks -= freed
                    self.num_freed_by_window[m.group_id] += freed
        blocks = self.req_to_blocks.get(rid)
        if blocks is None:  # first allocation: registered only if it succeeds
            blocks = []
            for m in managers:
                m.req_to_blocks[rid] = [] if m.group_id else blocks
        bs = self.block_size
        end = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_hit = len(new_computed_blocks[0]) if new_computed_blocks else 0
        num_new_blocks = (end + num_lookahead_tokens + bs - 1) // bs - len(blocks) - num_hit
        pool = self.block_pool
        new_blocks: list[KVCacheBlock] = []
        if num_new_blocks > 0 or num_hit:
            # hits on free blocks leave the free queue, so they compete with new blocks
            num_evictable_hits = 0
            if new_computed_blocks:
                for hits in new_computed_blocks:
                    for b in hits:
                        if b.ref_cnt == 0 and not b.is_null:
                            num_evictable_hits += 1
            total_new = num_new_blocks * len(managers) if num_new_blocks > 0 else 0
            if total_new > pool.free_block_queue.num_free_blocks - num_evictable_hits:
                if not blocks:
                    for m in managers:
                        del m.req_to_blocks[rid]
                return None
            if new_computed_blocks:
                for m, hits in zip(managers, new_computed_blocks, strict=True):
                    self.num_held_blocks += m.add_hits(rid, m.req_to_blocks[rid], hits)
            if num_new_blocks > 0:
                if len(managers) == 1:
                    new_blocks = pool.get_new_blocks(num_new_blocks)
                    blocks.extend(new_blocks)
                else:
                    new_blocks = pool.get_new_blocks(total_new)
                    for i, m in enumerate(managers):
                        m.req_to_blocks[rid].extend(
                            new_blocks[i * num_new_blocks : (i + 1) * num_new_blocks]
                        )
                self.num_held_blocks += total_new
                offload = self.offload
                if offload is not None:
                    # this step writes them (forward or restore): not offloadable until then
                    offload.mark_uncomputed([b.block_id for b in new_blocks])
                    if num_restored_blocks:
                        first = len(blocks) - num_new_blocks  # group 0's first new block
                        offload.plan_restore(
                            request.block_hashes[first : first + num_restored_blocks],
                            [b.block_id for b in new_blocks[:num_restored_blocks]])
        limit = len(blocks) * bs
        if self.enable_caching and not delay_cache_blocks:
            num_full = (end if end < request.num_tokens else request.num_tokens) // bs
            num_cached = self.num_cached_block.get(rid, 0)
            if num_full > num_cached:
                for m in managers:
                    pool.cache_full_blocks(request, m.req_to_blocks[rid], num_cached, num_full,
                                           m.group_id)
                    m.num_cached_block[rid] = num_full
                num_cached = num_full
            # the next call with an end past this fills a block that must be cached
            next_full = (num_cached + 1) * bs - 1
            if next_full < limit:
                limit = next_full
        for m in self.window_managers:
            # a step that starts at or past this frees blocks: it must call allocate_slots
            nxt = m.next_removal(rid)
            if nxt < limit:
                limit = nxt
        request.kv_fast_limit = limit
        return new_blocks

    def max_blocks(self, num_tokens: int) -> int:
        """The most blocks (all groups) a request of num_tokens KV slots holds at one time."""
        return sum(m.max_blocks(num_tokens) for m in self.managers)

    def num_blocks_to_hold(
        self,
        request: Request,
        num_tokens: int,
        new_computed_blocks: KVCacheBlocks | None = None,
    ) -> int:
        """How many blocks ``request`` would still take from the free queue to hold
        ``num_tokens`` KV slots: new blocks past what it holds (and its prefix-cache hits
        cover), plus the hits that sit in the free queue (touching them takes them out)."""
        rid = request.request_id
        total = 0
        for g, m in enumerate(self.managers):
            hits = new_computed_blocks[g] if new_computed_blocks else ()
            live_hits = 0
            for b in hits:
                if not b.is_null:
                    live_hits += 1
                    if b.ref_cnt == 0:
                        total += 1  # evictable: touching it takes it out of the free queue
            need = m.max_blocks(num_tokens) - m.num_live_blocks(rid) - live_hits
            if need > 0:
                total += need
        return total

    def uncache_unwritten(self, request: Request, num_written_tokens: int) -> None:
        """Before a request that was already scheduled this step is preempted: its blocks
        past the first ``num_written_tokens`` tokens were registered in the prefix cache when
        the step allocated them, but the step no longer computes them."""
        rid = request.request_id
        first = num_written_tokens // self.block_size
        for m in self.managers:
            blocks = m.req_to_blocks.get(rid)
            num_cached = m.num_cached_block.get(rid, 0)
            if blocks is None or num_cached <= first:
                continue
            # blocks past `first` were allocated for this request (hits are written blocks)
            self.block_pool.uncache_blocks(
                (b for b in blocks[first:num_cached] if not b.is_null), m.group_id)
            m.num_cached_block[rid] = first

    def free(self, request: Request) -> None:
        """Release a request's blocks tail first, so its shared prefix is evicted last."""
        self.free_table(request.request_id)
        request.kv_fast_limit = 0

    def free_table(self, key: TableKey) -> None:
        """Release the table held under ``key`` (a request id, or a key given by rekey)."""
        for m in self.managers:
            self.num_held_blocks -= m.free(key)

    def rekey(self, old: str, new: TableKey) -> None:
        """Hold ``old``'s table under ``new``: the blocks of a finished request that must
        outlive it (a prefill's blocks under a lease, a load still writing them), while its
        id may be used again."""
        for m in self.managers:
            if new in m.req_to_blocks:
                raise ValueError(f"a block table is already held under {new!r}")
            if old in m.req_to_blocks:
                m.req_to_blocks[new] = m.req_to_blocks.pop(old)
            if old in m.num_cached_block:
                m.num_cached_block[new] = m.num_cached_block.pop(old)

    def get_blocks(self, request: Request) -> list[KVCacheBlock]:
        """Group 0's table."""
        return self.req_to_blocks.get(request.request_id, [])

    def get_block_ids(self, request: Request) -> list[int]:
        """Every group's table, group 0's first (the wire's layout)."""
        rid = request.request_id
        if self.num_groups == 1:
            return [b.block_id for b in self.req_to_blocks.get(rid, ())]
        return [b.block_id for m in self.managers for b in m.req_to_blocks.get(rid, ())]

    def held_tables(self) -> Iterator[list[KVCacheBlock]]:
        """Every table's real blocks (null placeholders left out), for invariant checks."""
        for m in self.managers:
            for blocks in m.req_to_blocks.values():
                yield [b for b in blocks if not b.is_null] if m.sliding_window else blocks

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()
