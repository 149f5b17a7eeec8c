"""Property test: random allocate / cache-hit / grow / free / evict / reset sequences on a
KVCacheManager keep the block accounting exact after every operation."""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine_core.invariants import check_block_pool
from engine_core.kv_cache_manager import KVCacheManager
from engine_core.request import Request
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
        {k: [b.block_id for b in v] for k, v in kvm.req_to_blocks.items()},
    )


class KVCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kvm = KVCacheManager(num_blocks=12, block_size=BS, hash_fn="fast")
        self.live: dict[str, Request] = {}
        self.n = 0

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(1, 3), max_size=5))
    def admit(self, prefix: list[int], tail: list[int]) -> None:
        r = Request(f"r{self.n}", prefix + tail, SamplingParams(), None, 0.0)
        self.n += 1
        self.kvm.attach_hasher(r)
        hits, n_hit = self.kvm.get_computed_blocks(r)
        assert n_hit < r.num_tokens
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

    @invariant()
    def accounting_is_exact(self) -> None:
        check_block_pool(self.kvm.block_pool, self.kvm.req_to_blocks.values())
        assert set(self.kvm.req_to_blocks) == set(self.live)
        # the admission gate's running total of block-table lengths
        held = sum(len(b) for b in self.kvm.req_to_blocks.values())
        assert self.kvm.num_held_blocks == held


TestKVCacheMachine = KVCacheMachine.TestCase
TestKVCacheMachine.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
