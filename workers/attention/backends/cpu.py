"""The CPU attention backend: the C++ kernels of workers/cpu_ops/csrc/ (through workers.cpu_ops).

Rotary and the KV-cache write are one kernel pass; queries of any length read their context
straight from the paged cache (query tiles on AVX-512, short queries elsewhere); fresh prefills
without cached context attend to the step's new K/V directly. Whatever the kernels do not take
goes through the torch reference. With the kernels switched off at run time
(cpu_ops.ENABLED = False) it behaves exactly as the torch backend.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workers import cpu_ops
from workers.attention import reference
from workers.attention.base import AttentionBackend, AttentionStep, split_qkv
from workers.attention.reference import AttentionMetadata, AttentionPlan, GatherScratch, Prefill


class CpuAttentionStep(AttentionStep):
    def __init__(self, meta: AttentionMetadata, plan: AttentionPlan) -> None:
        super().__init__(meta)
        self.plan = plan

    def __call__(self, qkv, positions, rope, q_heads, kv_heads, head_dim, k_cache, v_cache,
                 scale):
        meta, plan = self.meta, self.plan
        done = rope.rotate_and_cache_(positions, qkv, q_heads, kv_heads, head_dim, k_cache,
                                      v_cache, meta.slot_mapping)
        q, k, v = split_qkv(qkv, q_heads, kv_heads, head_dim)
        if not done:
            q, k = rope.forward_torch(positions, q), rope.forward_torch(positions, k)
            reference.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        if q.shape[0] > plan.num_tokens:  # padding tokens belong to nobody
            out[plan.num_tokens :] = 0
        kernel = cpu_ops.active(q) and q.dtype == k_cache.dtype
        if plan.kernel_max_query_len:
            # Decodes and draft verification (and, with the AVX-512 tiles, prefill chunks too)
            # read their context straight from the paged cache: no gather, no dtype copies.
            cpu_ops.paged_attention(out, q, k_cache, v_cache, meta.block_table, meta.seq_lens,
                                    meta.query_start_loc, len(meta.seq_lens_np), scale,
                                    max_query_len=plan.kernel_max_query_len,
                                    sliding_window=plan.sliding_window)
        prefills = plan.prefills
        if kernel and not plan.sliding_window:  # (plain causal SDPA knows no window)
            prefills = _fresh_prefills_batched(out, q, (k, v), prefills, scale)
        reference.attend_planned(out, q, k_cache, v_cache, plan, scale, prefills)
        return out


class CpuAttentionBackend(AttentionBackend):
    name = "cpu"

    def __init__(self, head_dim: int) -> None:
        self.scratch = GatherScratch()
        # The kernel's query tiles cover some head dims only; others keep SDPA for chunks.
        self.any_length = cpu_ops.attention_any_length(head_dim)

    def begin(self, meta, block_size, device, sliding_window=0):
        # Decided per step from cpu_ops.ENABLED, so switching the kernels off at run time
        # (tests, TANDEM_CPU_KERNELS) falls back to the reference plan.
        kernel = cpu_ops.ENABLED and cpu_ops.ops() is not None and device.type == "cpu"
        plan = reference.plan_attention(meta, block_size, device, self.scratch,
                                        short_queries=not kernel,
                                        kernel_all=kernel and self.any_length,
                                        sliding_window=sliding_window)
        return CpuAttentionStep(meta, plan)


def _fresh_prefills_batched(out: torch.Tensor, q: torch.Tensor,
                            new_kv: tuple[torch.Tensor, torch.Tensor] | None,
                            prefills: list[Prefill], scale: float) -> list[Prefill]:
    """Attend prefills that have no cached context (seq_len == chunk length) straight from the
    new K/V: consecutive ones of equal length form one [n, L] SDPA call on views, in the model
    dtype (the CPU kernel accumulates in float32). Returns the prefills left to do."""
    if new_kv is None:
        return prefills
    k_new, v_new = new_kv
    rest: list[Prefill] = []
    i = 0
    while i < len(prefills):
        p = prefills[i]
        length = p.end - p.start
        if p.seq_len != length:
            rest.append(p)
            i += 1
            continue
        j = i + 1
        while (j < len(prefills) and prefills[j].start == prefills[j - 1].end
               and prefills[j].end - prefills[j].start == length
               and prefills[j].seq_len == length):
            j += 1
        n, s, e = j - i, p.start, p.start + (j - i) * length
        heads, hd = q.shape[1], q.shape[2]
        o = F.scaled_dot_product_attention(
            q[s:e].view(n, length, heads, hd).transpose(1, 2),
            k_new[s:e].view(n, length, -1, hd).transpose(1, 2),
            v_new[s:e].view(n, length, -1, hd).transpose(1, 2),
            is_causal=True, scale=scale, enable_gqa=True)
        out[s:e] = o.transpose(1, 2).reshape(e - s, heads, hd)
        i = j
    return rest
