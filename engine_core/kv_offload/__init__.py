"""Tiered KV cache accounting: host memory and disk tiers behind the device pool.

The scheduler side owns every decision (which block goes to which slot, what is evicted) and
names the copies; the workers execute them (workers/kv_offload/host_pool.py). Wire form of the
copies: protocol/kv_transfer.py.
"""

from engine_core.kv_offload.manager import (
    KVOffloadManager,
    OffloadCopy,
    RestoreCopy,
    SpillCopy,
    TierLookup,
)
from engine_core.kv_offload.tier import OffloadTier, TierEntry, block_hash_tag, tier_capacity

__all__ = [
    "KVOffloadManager",
    "OffloadCopy",
    "OffloadTier",
    "RestoreCopy",
    "SpillCopy",
    "TierEntry",
    "TierLookup",
    "block_hash_tag",
    "tier_capacity",
]
