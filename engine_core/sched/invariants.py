"""Consistency checks of the block accounting and the scheduler's queues.

Run after every step when ``config.debug_invariants`` is on, and by the property tests. They
walk everything (O(blocks + requests)), so they are for debugging, not production.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable, Mapping

from engine_core.kv_cache.block import KVCacheBlock
from engine_core.kv_cache.block_pool import BlockPool
from engine_core.kv_cache.single_type_manager import TableKey
from engine_core.request import Request, RequestStatus


def check_block_pool(pool: BlockPool, holders: Iterable[list[KVCacheBlock]]) -> None:
    """Every non-null block is either free or held (never both); ref_cnt = number of holders;
    the null block is never handed out; the hash map points only at blocks with that hash."""
    held: Counter[int] = Counter()
    for table in holders:
        for block in table:
            assert not block.is_null, "the null block was handed out"
            held[block.block_id] += 1
    free = pool.free_block_queue.get_all_free_blocks()
    assert len(free) == pool.free_block_queue.num_free_blocks, "free count out of sync"
    free_ids = {b.block_id for b in free}
    assert len(free_ids) == len(free), "a block is twice in the free queue"
    null = pool.null_block
    assert null.block_id not in free_ids, "the null block is in the free queue"
    assert null.block_hash is None
    for block in pool.blocks[1:]:
        bid = block.block_id
        assert block.ref_cnt == held[bid], f"{block}: ref_cnt != {held[bid]} holders"
        if bid in free_ids:
            assert held[bid] == 0, f"{block} is both free and held"
        else:
            assert held[bid] > 0, f"{block} is neither free nor held (leaked)"
    for h, block in pool.cached_block_hash_to_block.items():
        assert block.block_hash == h, f"hash map entry points at {block} with another hash"
    for block in pool.blocks:
        if block.block_hash is not None:
            assert pool.cached_block_hash_to_block.get(block.block_hash) is block, (
                f"{block} carries a hash the map does not point back from"
            )


def check_scheduler_queues(
    running: list[Request],
    waiting: Iterable[Request],
    req_to_blocks: Mapping[TableKey, list[KVCacheBlock]],
    block_size: int,
    max_num_seqs: int,
    exempt: Collection[TableKey] = (),
) -> None:
    """``exempt``: tables held outside the running set by the KV connector (prefill leases,
    loads in flight, requests set aside while their KV arrives)."""
    assert len(running) <= max_num_seqs, f"{len(running)} running > max_num_seqs {max_num_seqs}"
    handles = [r.handle for r in running]
    assert None not in handles, "a running request has no handle"
    assert len(set(handles)) == len(handles), "duplicate handle in the running set"
    for r in running:
        assert r.status == RequestStatus.RUNNING, f"{r} in running with status {r.status.name}"
        blocks = req_to_blocks.get(r.request_id, [])
        assert len(blocks) * block_size >= r.num_computed_tokens, f"{r} computed past its blocks"
        assert r.num_computed_tokens <= r.num_tokens_with_spec + r.num_output_placeholders
    waiting_ids = set()
    for r in waiting:
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), f"{r} in waiting"
        if not r.num_external_computed_tokens:  # else its blocks hold KV a prefill engine sent
            assert r.request_id not in req_to_blocks, f"waiting {r} holds blocks"
        assert r.num_computed_tokens == 0
        waiting_ids.add(r.request_id)
    running_ids = {r.request_id for r in running}
    assert not (running_ids & waiting_ids), "a request is both running and waiting"
    loaded = {r for r in waiting_ids if r in req_to_blocks}
    assert set(req_to_blocks) <= running_ids | loaded | set(exempt), (
        "a request that is not running holds blocks")
