"""One paged KV-cache block's bookkeeping (the tensor memory lives in the workers)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    # set while the block is full and registered in the prefix cache
    block_hash: Any = None
    # free-queue links, threaded through the blocks so removal from the middle is O(1)
    prev_free_block: KVCacheBlock | None = None
    next_free_block: KVCacheBlock | None = None
    # block 0: a placeholder that is never handed out
    is_null: bool = False

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={self.block_hash!r})"
