"""KV cache groups: which layers share a block table (vLLM's KVCacheGroupSpec).

Every layer has a KV spec: full attention (sliding_window = 0) or a sliding window of W tokens
(a query at position p sees keys in (p - W, p]). Workers report their per-layer windows in the
start-up hello; the engine core and the workers both derive the same groups from that list with
``kv_cache_groups``, so the scheduler's block tables and the workers' cache tensors agree.

Layers of one kind are cut into groups of equal size (the gcd of the kinds' layer counts), so
that every group has the same number of layers. Then one block id means the same bytes in every
group: the i-th layer of each group shares one cache tensor, and a block handed to one group is
owned by that group alone until it is freed (vLLM's tensor sharing between groups). A block is
therefore worth ``layers_per_group`` layers of K/V, not all layers, and a windowed group that
frees its old blocks frees real memory.

Pure Python (no torch): protocol/ is imported by both sides.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import gcd

import msgspec

FULL_ATTENTION = "full_attention"
SLIDING_WINDOW = "sliding_window"


class KVCacheGroupSpec(msgspec.Struct, frozen=True, array_like=True):
    """One KV cache group: its layers (model order) and their window (0 = full attention)."""

    sliding_window: int
    layer_ids: tuple[int, ...]

    @property
    def kind(self) -> str:
        return SLIDING_WINDOW if self.sliding_window else FULL_ATTENTION


def kv_cache_groups(layer_windows: Sequence[int]) -> list[KVCacheGroupSpec]:
    """Groups for per-layer windows (0 = full attention). Full attention first (the hybrid
    prefix-cache search starts from it), then windows by size; an empty list means one
    full-attention group with no layers (a model without attention, used by tests)."""
    if not layer_windows:
        return [KVCacheGroupSpec(0, ())]
    if any(w < 0 for w in layer_windows):
        raise ValueError(f"sliding windows must be >= 0, got {list(layer_windows)}")
    by_window: dict[int, list[int]] = {}
    for i, w in enumerate(layer_windows):
        by_window.setdefault(w, []).append(i)
    size = 0
    for layers in by_window.values():
        size = gcd(size, len(layers))
    groups = []
    for w in sorted(by_window):  # 0 (full attention) sorts first
        layers = by_window[w]
        for start in range(0, len(layers), size):
            groups.append(KVCacheGroupSpec(w, tuple(layers[start : start + size])))
    return groups


def layers_per_group(groups: Sequence[KVCacheGroupSpec]) -> int:
    """Layers whose K/V one block id holds (every group has this many layers)."""
    return max(1, len(groups[0].layer_ids))
