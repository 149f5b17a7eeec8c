"""Paged KV cache accounting: blocks, the free-block queue, the block pool with its prefix
cache, chained block hashes, and the per-group managers behind KVCacheManager."""
