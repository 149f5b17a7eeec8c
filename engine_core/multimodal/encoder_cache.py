"""The engine core's account of the ranks' encoder-output cache (vLLM's EncoderCacheManager).

Entries are keyed by ``mm_hash`` and sized in embeddings. A request references an entry from
the step that schedules (or finds) it until its computed tokens have passed the item's
placeholder span, or until it is preempted or finished. An entry nobody references stays
cached, so a later request with the same image skips the encoder, and is evicted least
recently freed first when a new entry needs room. Evicted hashes are collected for the next
step's ``free_encoder_mm_hashes``: every rank drops exactly those, so the ranks' caches hold
what this account says and never grow past ``capacity``.
"""

from __future__ import annotations

from collections import OrderedDict


class EncoderCacheManager:
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"encoder cache size must be >= 1 embedding, got {capacity}")
        self.capacity = capacity
        self.used = 0  # embeddings of every cached entry, referenced or not
        self.sizes: dict[str, int] = {}
        self.refs: dict[str, set[str]] = {}  # mm_hash -> request ids referencing it
        # unreferenced entries, least recently freed first: what may be evicted
        self.freeable: OrderedDict[str, int] = OrderedDict()
        self.freeable_size = 0
        self._freed: list[str] = []  # evicted since the last step was built
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def __contains__(self, mm_hash: str) -> bool:
        return mm_hash in self.sizes

    def has_ref(self, request_id: str, mm_hash: str) -> bool:
        refs = self.refs.get(mm_hash)
        return refs is not None and request_id in refs

    def add_ref(self, request_id: str, mm_hash: str) -> None:
        """``request_id`` reads the cached entry: it may not be evicted now (a hit)."""
        refs = self.refs[mm_hash]
        if not refs:
            self.freeable_size -= self.freeable.pop(mm_hash)
        refs.add(request_id)

    def can_fit(self, size: int) -> bool:
        """Whether ``size`` embeddings fit, evicting unreferenced entries if need be."""
        return self.used - self.freeable_size + size <= self.capacity

    def allocate(self, request_id: str, mm_hash: str, size: int) -> None:
        """A new entry, referenced by ``request_id``; evicts what it needs (can_fit first)."""
        assert mm_hash not in self.sizes, mm_hash
        while self.used + size > self.capacity:
            old, old_size = self.freeable.popitem(last=False)
            self.freeable_size -= old_size
            self.used -= old_size
            del self.sizes[old], self.refs[old]
            self._freed.append(old)
            self.evictions += 1
        self.sizes[mm_hash] = size
        self.refs[mm_hash] = {request_id}
        self.used += size

    def release(self, request_id: str, mm_hash: str) -> None:
        """``request_id`` no longer reads the entry (its span is computed, or it left)."""
        refs = self.refs.get(mm_hash)
        if refs is None or request_id not in refs:
            return
        refs.discard(request_id)
        if not refs:
            size = self.sizes[mm_hash]
            self.freeable[mm_hash] = size
            self.freeable_size += size

    def take_freed(self) -> list[str]:
        freed, self._freed = self._freed, []
        return freed

    def reset(self) -> None:
        """Forget every unreferenced entry (reset_prefix_cache): the ranks drop them too."""
        for mm_hash, size in self.freeable.items():
            del self.sizes[mm_hash], self.refs[mm_hash]
            self.used -= size
            self._freed.append(mm_hash)
        self.freeable.clear()
        self.freeable_size = 0

    def stats(self) -> dict[str, float]:
        return {
            "encoder_cache_usage": self.used / self.capacity,
            "encoder_cache_entries": float(len(self.sizes)),
            "encoder_cache_hits": float(self.hits),
            "encoder_cache_misses": float(self.misses),
            "encoder_cache_evictions": float(self.evictions),
        }

    def check(self) -> None:
        assert self.used == sum(self.sizes.values()) <= self.capacity, (self.used, self.capacity)
        assert set(self.sizes) == set(self.refs)
        assert self.freeable_size == sum(self.freeable.values())
        for mm_hash, refs in self.refs.items():
            assert (not refs) == (mm_hash in self.freeable), mm_hash
