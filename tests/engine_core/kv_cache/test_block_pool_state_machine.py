"""Property test: random allocate / cache-hit / grow / free / evict / reset sequences on a
KVCacheManager keep the block accounting exact after every operation: with one full-attention
group, and with several groups (hybrid full + sliding window, two windows) sharing the pool."""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine_core.kv_cache.block_pool import group_key
from engine_core.kv_cache.manager import KVCacheManager
from engine_core.request import Request
from engine_core.sched.invariants import check_block_pool
from protocol.kv_cache_spec import KVCacheGroupSpec
from protocol.messages import SamplingParams

BS = 2
# a tiny alphabet and shared prefixes make cache hits (and evictions of hits) common
PREFIXES = [[1, 2, 3, 4], [1, 2, 5, 6], [7, 7, 7, 7, 7, 7]]


def snapshot(kvm: KVCacheManager) -> object:
    pool = kvm.block_pool
    return (
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
        {h: b.block_id for h, b in pool.cached_block_hash_to_block.items()},
        [{k: [b.block_id for b in v] for k, v in m.req_to_blocks.items()} for m in kvm.managers],
    )


class KVCacheMachine(RuleBasedStateMachine):
    GROUPS: list[KVCacheGroupSpec] | None = None  # None: one full-attention group
    NUM_BLOCKS = 12

    def __init__(self) -> None:
        super().__init__()
        self.kvm = KVCacheManager(num_blocks=self.NUM_BLOCKS, block_size=BS, hash_fn="fast",
                                  kv_cache_groups=self.GROUPS, max_chunk=8)
        self.live: dict[str, Request] = {}
        self.n = 0

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(1, 3), max_size=5))
    def admit(self, prefix: list[int], tail: list[int]) -> None:
        r = Request(f"r{self.n}", prefix + tail, SamplingParams(), None, 0.0)
        self.n += 1
        self.kvm.attach_hasher(r)
        hits, n_hit = self.kvm.get_computed_blocks(r)
        assert n_hit < r.num_tokens
        self.check_hit(r, hits, n_hit)
        before = snapshot(self.kvm)
        new = self.kvm.allocate_slots(r, r.num_tokens - n_hit, n_hit, hits)
        if new is None:
            assert snapshot(self.kvm) == before, "a failed allocation changed state"
            return
        assert all(not b.is_null for b in new)
        r.num_computed_tokens = r.num_tokens
        self.live[r.request_id] = r

    @precondition(lambda self: self.live)
    @rule(data=st.data(), k=st.integers(1, 4))
    def grow(self, data: st.DataObject, k: int) -> None:
        r = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        for t in range(k):
            r.append_output_token(1 + t % 2)
        # window groups give back out-of-window blocks first, whether or not the rest fits
        self.kvm.remove_skipped_blocks(r, r.num_computed_tokens)
        before = snapshot(self.kvm)
        new = self.kvm.allocate_slots(r, r.num_tokens - r.num_computed_tokens)
        if new is None:
            assert snapshot(self.kvm) == before
            r.num_computed_tokens = 0
            self.kvm.free(r)  # as the scheduler would: preempt
            del self.live[r.request_id]
            return
        r.num_computed_tokens = r.num_tokens

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self.kvm.free(self.live.pop(rid))

    @rule()
    def reset(self) -> None:
        ok = self.kvm.reset_prefix_cache()
        assert ok == (not self.live)

    def check_hit(self, r: Request, hits: list, n_hit: int) -> None:
        """Every group's hit has the same length; its real blocks hold this prefix; a window
        group holds every block its first new query can see."""
        if not n_hit:
            assert hits == []
            return
        for m, blocks in zip(self.kvm.managers, hits, strict=True):
            assert len(blocks) * BS == n_hit
            for i, b in enumerate(blocks):
                if not b.is_null:
                    assert b.block_hash == group_key(r.block_hashes[i], m.group_id)
            first_seen = max(0, n_hit - m.sliding_window + 1) if m.sliding_window else 0
            assert all(not b.is_null for b in blocks[first_seen // BS :])

    @invariant()
    def accounting_is_exact(self) -> None:
        kvm = self.kvm
        check_block_pool(kvm.block_pool, kvm.held_tables())
        for m in kvm.managers:
            assert set(m.req_to_blocks) == set(self.live)
        # the admission gate's running total of real blocks in the tables
        held = sum(len(b) for b in kvm.held_tables())
        assert kvm.num_held_blocks == held
        cached = [0] * kvm.num_groups
        for key in kvm.block_pool.cached_block_hash_to_block:
            cached[key[1] if type(key) is tuple else 0] += 1
        assert kvm.block_pool.num_cached_blocks == cached
        for rid, r in self.live.items():
            n = len(kvm.req_to_blocks[rid])
            for m in kvm.managers:
                blocks = m.req_to_blocks[rid]
                assert len(blocks) == n, "group tables of one request differ in length"
                if m.sliding_window:
                    # a window group holds what the next query sees, and a bounded number
                    first_seen = max(0, r.num_computed_tokens - m.sliding_window + 1) // BS
                    assert all(not b.is_null for b in blocks[first_seen:])
                    assert m.num_live_blocks(rid) <= m.max_blocks(r.num_computed_tokens)


TestKVCacheMachine = KVCacheMachine.TestCase
TestKVCacheMachine.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)


class HybridKVCacheMachine(KVCacheMachine):
    """One full-attention group and one sliding window of 5 tokens (3 blocks of 2)."""

    GROUPS = [KVCacheGroupSpec(0, (0,)), KVCacheGroupSpec(5, (1,))]
    NUM_BLOCKS = 20


class TwoWindowsKVCacheMachine(KVCacheMachine):
    """Only windows (Mistral-style groups of two sizes): no group needs the whole prefix."""

    GROUPS = [KVCacheGroupSpec(3, (0,)), KVCacheGroupSpec(6, (1,))]
    NUM_BLOCKS = 16


TestHybridKVCacheMachine = HybridKVCacheMachine.TestCase
TestHybridKVCacheMachine.settings = settings(max_examples=150, stateful_step_count=30,
                                             deadline=None)
TestTwoWindowsKVCacheMachine = TwoWindowsKVCacheMachine.TestCase
TestTwoWindowsKVCacheMachine.settings = settings(max_examples=100, stateful_step_count=30,
                                                 deadline=None)
