"""Prefix caching and allocation, worked by hand with block_size 4."""

from engine_core.kv_cache.block_pool import BlockPool
from engine_core.kv_cache.manager import KVCacheManager
from engine_core.request import Request
from engine_core.sched.invariants import check_block_pool
from protocol.messages import SamplingParams
from protocol.request_options import RequestOptions


def toks(s: str) -> list[int]:
    return [ord(c) for c in s]


def mk(kvm: KVCacheManager, rid: str, text: str) -> Request:
    r = Request(rid, toks(text), SamplingParams(), None, 0.0)
    kvm.attach_hasher(r)
    return r


def admit(kvm: KVCacheManager, r: Request) -> tuple[list[int], int]:
    hits, n_hit = kvm.get_computed_blocks(r)
    new = kvm.allocate_slots(r, r.num_tokens - n_hit, n_hit, hits)
    assert new is not None
    r.num_computed_tokens = r.num_tokens
    return [b.block_id for b in (hits[0] if hits else [])], n_hit


def free_ids(kvm: KVCacheManager) -> list[int]:
    return [b.block_id for b in kvm.block_pool.free_block_queue.get_all_free_blocks()]


def check(kvm: KVCacheManager) -> None:
    check_block_pool(kvm.block_pool, kvm.req_to_blocks.values())


def test_prefix_caching_walkthrough() -> None:
    kvm = KVCacheManager(num_blocks=8, block_size=4)  # 7 usable blocks + the null block
    req0 = mk(kvm, "req0", "ABCDEFGHIJKLMNO")
    assert admit(kvm, req0) == ([], 0)
    assert kvm.get_block_ids(req0) == [1, 2, 3, 4]
    # three full blocks are cached; MNO is partial
    assert len(kvm.block_pool.cached_block_hash_to_block) == 3

    req1 = mk(kvm, "req1", "ABCDEFGHIJklmn")
    assert admit(kvm, req1) == ([1, 2], 8)
    assert kvm.get_block_ids(req1) == [1, 2, 5, 6]
    assert [kvm.block_pool.blocks[i].ref_cnt for i in (1, 2, 5, 6)] == [2, 2, 1, 1]
    assert free_ids(kvm) == [7]
    check(kvm)

    # freed tail first: a request's last block sits nearest the eviction end
    kvm.free(req0)
    assert free_ids(kvm) == [7, 4, 3]  # 1 and 2 are still held by req1
    kvm.free(req1)
    assert free_ids(kvm) == [7, 4, 3, 6, 5, 2, 1]
    assert kvm.block_pool.blocks[5].block_hash is not None  # IJkl still cached while free
    check(kvm)

    ijkl_hash = kvm.block_pool.blocks[5].block_hash
    req2 = mk(kvm, "req2", "ABCDEFGHIJKL" + "abcdefghijklmnop")
    hits, n_hit = kvm.get_computed_blocks(req2)
    assert [b.block_id for b in hits[0]] == [1, 2, 3] and n_hit == 12
    new = kvm.allocate_slots(req2, 16, n_hit, hits)
    assert new is not None
    # hits leave the free queue; new blocks come from the head, the cached candidate 5
    # (IJkl) is evicted and loses its hash entry
    assert [b.block_id for b in new] == [7, 4, 6, 5]
    assert ijkl_hash not in kvm.block_pool.cached_block_hash_to_block
    # ... and, now full with req2's tokens, carries req2's last hash instead
    assert kvm.block_pool.blocks[5].block_hash == req2.block_hashes[6]
    assert free_ids(kvm) == []
    assert kvm.prefix_cache_hits == 8 + 12
    check(kvm)


def test_hit_is_capped_so_one_token_is_computed() -> None:
    kvm = KVCacheManager(num_blocks=8, block_size=4)
    admit(kvm, mk(kvm, "a", "ABCDEFGHX"))
    r = mk(kvm, "b", "ABCDEFGH")  # both blocks cached, but the last token must be computed
    assert kvm.get_computed_blocks(r)[1] == 4


def test_allocate_none_changes_nothing_and_spec_tokens_are_not_cached() -> None:
    kvm = KVCacheManager(num_blocks=4, block_size=4)
    r = mk(kvm, "a", "ABCDEF")
    assert kvm.allocate_slots(r, 6, num_lookahead_tokens=100) is None
    assert kvm.req_to_blocks == {} and kvm.num_free_blocks == 3
    assert kvm.allocate_slots(r, 6, num_lookahead_tokens=2) is not None  # 8 slots: 2 blocks
    assert kvm.num_free_blocks == 1
    # the request has 6 real tokens: only one full block may enter the prefix cache even if
    # drafts are computed up to position 8
    r.num_computed_tokens = 6
    r.set_spec_token_ids([1, 2])
    assert kvm.allocate_slots(r, 2) == []
    assert len(kvm.block_pool.cached_block_hash_to_block) == 1
    check(kvm)


def test_salt_separates_caches_and_caching_can_be_off() -> None:
    kvm = KVCacheManager(num_blocks=8, block_size=4)
    a = Request("a", toks("ABCDEFGH"), SamplingParams(), None, 0.0,
                RequestOptions(cache_salt="x"))
    kvm.attach_hasher(a)
    admit(kvm, a)
    b = mk(kvm, "b", "ABCDEFGH")
    assert kvm.get_computed_blocks(b) == ([], 0)
    off = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    admit(off, mk(off, "a", "ABCDEFGH"))
    assert off.get_computed_blocks(mk(off, "b", "ABCDEFGH")) == ([], 0)
    assert off.block_pool.cached_block_hash_to_block == {}


def test_reset_prefix_cache_refuses_while_in_use() -> None:
    kvm = KVCacheManager(num_blocks=8, block_size=4, hash_fn="fast")
    r = mk(kvm, "a", "ABCDEFGH")
    admit(kvm, r)
    assert not kvm.reset_prefix_cache()
    kvm.free(r)
    assert kvm.reset_prefix_cache()
    assert kvm.block_pool.cached_block_hash_to_block == {}
    assert all(b.block_hash is None for b in kvm.block_pool.blocks)


def test_block_pool_null_block_and_touch() -> None:
    pool = BlockPool(4)
    got = pool.get_new_blocks(3)
    assert [b.block_id for b in got] == [1, 2, 3] and pool.get_usage() == 1.0
    pool.free_blocks(reversed(got))
    assert pool.get_num_free_blocks() == 3
    pool.touch([got[1]])
    assert got[1].ref_cnt == 1 and pool.get_num_free_blocks() == 2
    pool.touch([pool.null_block])  # the null block never enters or leaves the free queue
    assert pool.get_num_free_blocks() == 2
