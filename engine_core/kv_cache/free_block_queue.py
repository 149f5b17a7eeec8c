"""The free-block queue: a doubly linked list threaded through the KVCacheBlocks themselves.

Head = least recently freed (evicted first), tail = most recently freed. A prefix-cache hit on
a free block must take it out of the middle, which a deque cannot do in O(1); two sentinels
remove every empty-list special case from the pointer updates.
"""

from __future__ import annotations

from collections.abc import Iterable

from engine_core.kv_cache.block import KVCacheBlock


class FreeKVCacheBlockQueue:
    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self.head = KVCacheBlock(-1)
        self.tail = KVCacheBlock(-2)
        self.num_free_blocks = 0
        self.head.next_free_block = self.tail
        self.tail.prev_free_block = self.head
        self.append_n(list(blocks))

    def popleft(self) -> KVCacheBlock:
        block = self.head.next_free_block
        if block is self.tail or block is None:
            raise ValueError("no free blocks left")
        nxt = block.next_free_block
        assert nxt is not None
        self.head.next_free_block = nxt
        nxt.prev_free_block = self.head
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Pop n blocks from the head in one walk, relinking the head once."""
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, only {self.num_free_blocks} are free")
        out: list[KVCacheBlock] = []
        if n <= 0:
            return out
        block = self.head.next_free_block
        for _ in range(n):
            assert block is not None
            out.append(block)
            nxt = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = nxt
        assert block is not None
        self.head.next_free_block = block
        block.prev_free_block = self.head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise RuntimeError(f"{block} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self.tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self.tail
        self.tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        """Append blocks in order at the tail in one walk, relinking the tail once."""
        if not blocks:
            return
        last = self.tail.prev_free_block
        assert last is not None
        for block in blocks:
            last.next_free_block = block
            block.prev_free_block = last
            last = block
        last.next_free_block = self.tail
        self.tail.prev_free_block = last
        self.num_free_blocks += len(blocks)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Head to tail (for tests and invariant checks)."""
        out = []
        block = self.head.next_free_block
        while block is not None and block is not self.tail:
            out.append(block)
            block = block.next_free_block
        return out

    def __len__(self) -> int:
        return self.num_free_blocks
