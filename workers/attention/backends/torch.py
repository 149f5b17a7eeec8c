"""The torch attention backend: the portable reference (workers/attention/reference.py) behind
the backend interface; the oracle the other backends are tested against, and the fallback
where neither the C++ kernels nor Triton can run."""

from __future__ import annotations

from workers.attention import reference
from workers.attention.base import AttentionBackend, AttentionStep, split_qkv
from workers.attention.reference import AttentionMetadata, GatherScratch


class TorchAttentionStep(AttentionStep):
    def __init__(self, meta: AttentionMetadata, plan: reference.AttentionPlan) -> None:
        super().__init__(meta)
        self.plan = plan

    def __call__(self, qkv, positions, rope, q_heads, kv_heads, head_dim, k_cache, v_cache,
                 scale):
        q, k, v = split_qkv(qkv, q_heads, kv_heads, head_dim)
        q, k = rope.forward_torch(positions, q), rope.forward_torch(positions, k)
        reference.write_kv(k, v, k_cache, v_cache, self.meta.slot_mapping)
        return reference.paged_attention(q, k_cache, v_cache, self.meta, scale, self.plan)


class TorchAttentionBackend(AttentionBackend):
    """Gathers each request's context and attends with torch ops (SDPA or matmul/softmax)."""

    name = "torch"

    def __init__(self) -> None:
        self.scratch = GatherScratch()

    def begin(self, meta, block_size, device, sliding_window=0):
        return TorchAttentionStep(meta, reference.plan_attention(
            meta, block_size, device, self.scratch, sliding_window=sliding_window))
