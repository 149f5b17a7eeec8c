from engine_core.kv_cache.hashing import (
    BlockHasher,
    fast_block_hash,
    hash_request_tokens,
    sha256_block_hash,
)
from engine_core.request import FINISH_REASONS, Request, RequestStatus
from protocol.messages import SamplingParams
from protocol.request_options import RequestOptions


def test_counters_and_status() -> None:
    r = Request("r", [1, 2, 3], SamplingParams(max_tokens=4), 0, 1.0)
    assert (r.num_tokens, r.num_tokens_with_spec, r.num_computed_tokens) == (3, 3, 0)
    assert r.status == RequestStatus.WAITING and not r.is_finished
    r.append_output_token(9)
    r.set_spec_token_ids([4, 5])
    assert r.num_tokens == 4 and r.num_tokens_with_spec == 6 and r.output_token_ids == [9]
    assert r.stop_ids == {0}
    r.status = RequestStatus.FINISHED_ABORTED
    assert r.is_finished and FINISH_REASONS[r.status] == "abort"


def test_ignore_eos_and_stop_ids() -> None:
    sp = SamplingParams(stop_token_ids=[7], ignore_eos=True)
    assert Request("r", [1], sp, 2, 0.0).stop_ids == {7}


def test_block_hashes_grow_incrementally_over_full_blocks_only() -> None:
    for fn in (sha256_block_hash, fast_block_hash):
        r = Request("r", list(range(10)), SamplingParams(), None, 0.0,
                    RequestOptions(cache_salt="s"))
        r.set_block_hasher(BlockHasher(4, fn), 4)
        assert len(r.block_hashes) == 2
        r.append_output_token(10)
        assert len(r.block_hashes) == 2
        r.append_output_token(11)  # 12 tokens: the third block is full
        assert r.block_hashes == hash_request_tokens(fn, 4, list(range(12)), "s")
        # the salt changes the first block's hash, hence the whole chain
        assert r.block_hashes[0] != hash_request_tokens(fn, 4, list(range(12)))[0]
        assert r.block_hashes[2] != hash_request_tokens(fn, 4, list(range(12)))[2]


def test_chained_hash_names_the_whole_prefix() -> None:
    a = hash_request_tokens(sha256_block_hash, 2, [1, 2, 3, 4])
    b = hash_request_tokens(sha256_block_hash, 2, [9, 9, 3, 4])
    assert a[1] != b[1]  # same block tokens, different parent
    assert len(a[0]) == 32
