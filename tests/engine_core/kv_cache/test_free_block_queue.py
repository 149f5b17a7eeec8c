from engine_core.kv_cache.block import KVCacheBlock
from engine_core.kv_cache.free_block_queue import FreeKVCacheBlockQueue


def ids(q: FreeKVCacheBlockQueue) -> list[int]:
    return [b.block_id for b in q.get_all_free_blocks()]


def test_popleft_append_remove_keep_order_and_count() -> None:
    blocks = [KVCacheBlock(i) for i in range(6)]
    q = FreeKVCacheBlockQueue(blocks)
    assert ids(q) == [0, 1, 2, 3, 4, 5] and len(q) == 6
    assert q.popleft().block_id == 0
    q.remove(blocks[3])  # from the middle
    assert ids(q) == [1, 2, 4, 5] and len(q) == 4
    q.append(blocks[3])
    q.append(blocks[0])
    assert ids(q) == [1, 2, 4, 5, 3, 0] and len(q) == 6
    assert blocks[3].prev_free_block is blocks[5]


def test_popleft_n_and_append_n() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    got = q.popleft_n(3)
    assert [b.block_id for b in got] == [0, 1, 2]
    assert all(b.prev_free_block is None and b.next_free_block is None for b in got)
    assert ids(q) == [3, 4]
    q.append_n([got[2], got[0]])
    assert ids(q) == [3, 4, 2, 0] and len(q) == 4
    assert q.popleft_n(0) == []
    assert [b.block_id for b in q.popleft_n(4)] == [3, 4, 2, 0]
    assert len(q) == 0 and ids(q) == []


def test_empty_queue_errors() -> None:
    q = FreeKVCacheBlockQueue([])
    try:
        q.popleft()
        raise AssertionError("popleft on an empty queue must raise")
    except ValueError:
        pass
    try:
        q.popleft_n(1)
        raise AssertionError("popleft_n past the end must raise")
    except ValueError:
        pass
    b = KVCacheBlock(7)
    try:
        q.remove(b)
        raise AssertionError("removing a block that is not queued must raise")
    except RuntimeError:
        pass
