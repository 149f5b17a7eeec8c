"""KV cache coordinators: the prefix-cache hit of a request across its KV cache groups.

Chosen once from the model (vLLM's KVCacheCoordinator family):

- NoPrefixCacheCoordinator: prefix caching is off, nothing is ever a hit;
- UnitaryKVCacheCoordinator: one group, its own longest hit;
- HybridKVCacheCoordinator: several groups (full attention and sliding windows). Every group
  must accept the same hit length, and a shorter candidate can make a window group's hit
  invalid (its window must end exactly at the hit), so the length is a fixed point: each group
  in turn answers the longest hit it accepts at most as long as the candidate, and the
  candidate shrinks until a whole pass over the groups leaves it unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine_core.kv_cache.block import KVCacheBlock
from engine_core.kv_cache.single_type_manager import SingleTypeKVCacheManager
from engine_core.request import BlockHash

# per group, the hit blocks (equal lengths); [] = no hit at all
KVCacheBlocks = list[list[KVCacheBlock]]


class KVCacheCoordinator:
    def __init__(self, managers: Sequence[SingleTypeKVCacheManager]) -> None:
        self.managers = list(managers)

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_num_blocks: int
    ) -> tuple[KVCacheBlocks, int]:
        """(hit blocks per group, hit length in blocks)."""
        raise NotImplementedError


class NoPrefixCacheCoordinator(KVCacheCoordinator):
    def find_longest_cache_hit(self, block_hashes, max_num_blocks):
        return [], 0


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    def find_longest_cache_hit(self, block_hashes, max_num_blocks):
        hits = self.managers[0].find_longest_cache_hit(block_hashes, max_num_blocks)
        return ([hits], len(hits)) if hits else ([], 0)


class HybridKVCacheCoordinator(KVCacheCoordinator):
    def find_longest_cache_hit(self, block_hashes, max_num_blocks):
        managers = self.managers
        length = max_num_blocks
        hits: KVCacheBlocks = [[] for _ in managers]
        changed = True
        while changed and length > 0:
            changed = False
            for g, manager in enumerate(managers):
                # full attention's hit only ever gets truncated; re-asking it is one dict
                # lookup per block, and keeps the rule the same for every group
                found = manager.find_longest_cache_hit(block_hashes, length)
                hits[g] = found
                if len(found) < length:
                    length = len(found)
                    changed = True
        if length == 0:
            return [], 0
        return hits, length


def make_coordinator(managers: Sequence[SingleTypeKVCacheManager],
                     enable_caching: bool) -> KVCacheCoordinator:
    if not enable_caching:
        return NoPrefixCacheCoordinator(managers)
    if len(managers) == 1:
        return UnitaryKVCacheCoordinator(managers)
    return HybridKVCacheCoordinator(managers)
