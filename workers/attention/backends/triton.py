"""The Triton attention backend, for CUDA workers.

Per layer: one kernel rotates q and k in the fused projection output and stores K/V in their
slots, one kernel attends for the whole mixed step (workers/triton_ops/paged_attention.py), plus
a small merge kernel when the key range is split into segments. Nothing here reads device
memory on the host or copies host data to the device, so a step can be captured in a CUDA graph
(workers/runner/cuda_graphs.py); every decision below uses host-side numbers only (request
count, longest query), which a captured batch size fixes.
"""

from __future__ import annotations

import torch

from workers import triton_ops
from workers.attention.base import AttentionBackend, AttentionStep
from workers.attention.reference import AttentionMetadata
from workers.triton_ops import kv_cache
from workers.triton_ops import paged_attention as kernels
from workers.triton_ops.attention_config import (
    MAX_SEGMENTS,
    AttentionConfig,
    arch_of,
    attention_config,
)


def num_segments(num_reqs: int, kv_heads: int, max_query_len: int, group: int,
                 block_m: int, num_sms: int, programs_per_sm: int) -> int:
    """1 for steps with enough (query block, KV head) programs or any multi-block query; else
    a power of two up to MAX_SEGMENTS that brings the grid near programs_per_sm * num_sms
    (few requests with long contexts would otherwise leave most of the GPU idle)."""
    if max_query_len * group > block_m:
        return 1  # prefill work: enough query blocks, and their tiles are not worth splitting
    programs = max(1, num_reqs * kv_heads)
    want = programs_per_sm * num_sms
    seg = 1
    while seg < MAX_SEGMENTS and programs * seg < want:
        seg *= 2
    return seg


class TritonAttentionStep(AttentionStep):
    def __init__(self, meta: AttentionMetadata, num_sms: int, arch: int,
                 sliding_window: int = 0) -> None:
        super().__init__(meta)
        self.num_sms = num_sms
        self.arch = arch
        self.sliding_window = sliding_window
        # Chosen at the first layer (the head counts come with the call), shared by the rest.
        self.block_m = 0
        self.segments = 1
        self.config: AttentionConfig | None = None
        self.scratch: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def __call__(self, qkv, positions, rope, q_heads, kv_heads, head_dim, k_cache, v_cache,
                 scale):
        meta = self.meta
        kv_cache.rotary_kv_(qkv, q_heads, kv_heads, head_dim, positions, rope.cos, rope.sin,
                            k_cache, v_cache, meta.slot_mapping)
        q = qkv[:, : q_heads * head_dim].view(-1, q_heads, head_dim)
        num_tokens = q.shape[0]
        if not self.block_m:
            group = q_heads // kv_heads
            self.block_m = kernels.block_m_for(group, meta.max_query_len)
            self.config = attention_config(head_dim, str(q.dtype).removeprefix("torch."),
                                           self.arch,
                                           kernels.is_decode_block(group, self.block_m))
            self.segments = num_segments(len(meta.seq_lens_np), kv_heads, meta.max_query_len,
                                         group, self.block_m, self.num_sms,
                                         self.config.programs_per_sm)
            if self.segments > 1:
                self.scratch = kernels.partials(num_tokens, q_heads, head_dim, self.segments,
                                                q.device)
        out = torch.empty(num_tokens, q_heads, head_dim, dtype=q.dtype, device=q.device)
        kernels.paged_attention(out, q, k_cache, v_cache, meta.block_table, meta.seq_lens,
                                meta.query_start_loc, scale, self.block_m, self.segments,
                                self.scratch, self.config, sliding_window=self.sliding_window)
        return out


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True

    def __init__(self) -> None:
        self._device: tuple[int, int] | None = None  # (SM count, attention_config arch)

    def _device_info(self, device: torch.device) -> tuple[int, int]:
        if self._device is None:
            if device.type == "cuda":
                props = torch.cuda.get_device_properties(device)
                self._device = (props.multi_processor_count, arch_of((props.major, props.minor)))
            else:  # the interpreter on CPU tensors (tests)
                self._device = (4, arch_of(None))
        return self._device

    def begin(self, meta, block_size, device, sliding_window=0):
        assert triton_ops.available()
        num_sms, arch = self._device_info(device)
        return TritonAttentionStep(meta, num_sms, arch, sliding_window)
