"""Llama-family decoder (Llama, SmolLM2, Mistral-style, Qwen2 q/k/v bias) built from TP layers.

Head layout under TP: KV heads are padded up to a multiple of tp_size and each padded KV head gets
its group of padded query heads; all padded weights are zero (and so are the o_proj columns that
read them), so every tp_size computes exactly the TP=1 function.

Sliding-window and hybrid models: layers are cut into KV cache groups (protocol.kv_cache_spec);
each group has its own block table (AttentionMetadata per group) and window, and the i-th layer
of every group shares one K/V cache tensor, since a block id belongs to one group at a time.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch
from torch import nn

from protocol.kv_cache_spec import KVCacheGroupSpec, kv_cache_groups, layers_per_group
from workers.attention import select_attention_backend
from workers.attention.base import AttentionBackend, AttentionStep
from workers.attention.reference import AttentionMetadata
from workers.model.config import ModelConfig
from workers.model.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    SiluAndMul,
    TypedModuleList,
    VocabParallelEmbedding,
    pad_to_multiple,
)

logger = logging.getLogger(__name__)


class WeightSource(Protocol):
    """Full-model tensors by HF name; read() may return only a slice, so a rank reads its share."""

    def has(self, name: str) -> bool: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def read(self, name: str, dim: int | None = None, start: int = 0,
             end: int | None = None) -> torch.Tensor: ...


def read_padded(src: WeightSource, name: str, dim: int, start: int, end: int) -> torch.Tensor:
    """Slice [start, end) along dim; the part past the real tensor (padded heads/rows) is zero."""
    real = src.shape(name)[dim]
    part = src.read(name, dim, min(start, real), min(end, real))
    missing = end - max(start, min(end, real))
    if missing <= 0:
        return part
    pad_shape = list(part.shape)
    pad_shape[dim] = missing
    return torch.cat([part, torch.zeros(pad_shape, dtype=part.dtype, device=part.device)], dim=dim)


class TPLayout:
    """How heads and MLP rows are split (and padded) over tp_size ranks."""

    def __init__(self, cfg: ModelConfig, tp_rank: int, tp_size: int):
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        self.group = cfg.num_attention_heads // cfg.num_key_value_heads
        self.kv_heads = pad_to_multiple(cfg.num_key_value_heads, tp_size) // tp_size
        self.q_heads = self.kv_heads * self.group
        self.q_start = tp_rank * self.q_heads
        self.kv_start = tp_rank * self.kv_heads
        self.inter = pad_to_multiple(cfg.intermediate_size, tp_size) // tp_size
        self.inter_start = tp_rank * self.inter
        self.padded_heads = self.kv_heads * tp_size != cfg.num_key_value_heads


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, lay: TPLayout, rope: RotaryEmbedding, tp_rank: int,
                 dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.lay, self.rope, self.head_dim = lay, rope, cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        qkv_out = (lay.q_heads + 2 * lay.kv_heads) * cfg.head_dim
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, qkv_out, cfg.attention_bias,
                                             dtype, device)
        self.o_proj = RowParallelLinear(lay.q_heads * cfg.head_dim, cfg.hidden_size,
                                        cfg.o_proj_bias, tp_rank, dtype, device)
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                attn: AttentionStep) -> torch.Tensor:
        if self.k_cache is None or self.v_cache is None:
            raise RuntimeError("KV cache not allocated: call allocate_kv_cache() first")
        hd, lay = self.head_dim, self.lay
        # The backend rotates q and k, writes the new K/V into the cache and attends.
        out = attn(self.qkv_proj(x), positions, self.rope, lay.q_heads, lay.kv_heads, hd,
                   self.k_cache, self.v_cache, self.scale)
        return self.o_proj(out.view(-1, lay.q_heads * hd))

    def load(self, src: WeightSource, prefix: str) -> None:
        lay, hd = self.lay, self.head_dim
        spans = {"q_proj": (lay.q_start, lay.q_heads), "k_proj": (lay.kv_start, lay.kv_heads),
                 "v_proj": (lay.kv_start, lay.kv_heads)}
        for kind, param in (("weight", self.qkv_proj.weight), ("bias", self.qkv_proj.bias)):
            if param is None:
                continue
            parts = [read_padded(src, f"{prefix}.{name}.{kind}", 0, s * hd, (s + n) * hd)
                     for name, (s, n) in spans.items()]
            param.copy_(torch.cat(parts, dim=0))
        self.o_proj.weight.copy_(read_padded(src, f"{prefix}.o_proj.weight", 1,
                                             lay.q_start * hd, (lay.q_start + lay.q_heads) * hd))
        if self.o_proj.bias is not None:
            self.o_proj.bias.copy_(src.read(f"{prefix}.o_proj.bias"))


class LlamaMLP(nn.Module):
    hf_name = "mlp"  # its weights' name under model.layers.{i}

    def __init__(self, cfg: ModelConfig, lay: TPLayout, tp_rank: int, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        self.lay = lay
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, 2 * lay.inter, False, dtype,
                                                 device)
        self.down_proj = RowParallelLinear(lay.inter, cfg.hidden_size, False, tp_rank, dtype,
                                           device)
        self.act = SiluAndMul(dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))

    def load(self, src: WeightSource, prefix: str) -> None:
        s, e = self.lay.inter_start, self.lay.inter_start + self.lay.inter
        gate = read_padded(src, f"{prefix}.gate_proj.weight", 0, s, e)
        up = read_padded(src, f"{prefix}.up_proj.weight", 0, s, e)
        self.gate_up_proj.weight.copy_(torch.cat([gate, up], dim=0))
        self.down_proj.weight.copy_(read_padded(src, f"{prefix}.down_proj.weight", 1, s, e))


class DecoderMLP(Protocol):
    """What a decoder layer needs of its MLP block: LlamaMLP, or a family's own (the sparse MoE
    block, which lives below this module and so cannot be named here)."""

    hf_name: str  # its weights' name under model.layers.{i}

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def load(self, src: WeightSource, prefix: str) -> None: ...


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, lay: TPLayout, rope: RotaryEmbedding, tp_rank: int,
                 dtype: torch.dtype, device: torch.device,
                 self_attn: LlamaAttention | None = None, mlp: DecoderMLP | None = None):
        """self_attn / mlp: a model family's own blocks (same call and load interface), else
        Llama's."""
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn: LlamaAttention = (
            self_attn or LlamaAttention(cfg, lay, rope, tp_rank, dtype, device))
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp: DecoderMLP = mlp or LlamaMLP(cfg, lay, tp_rank, dtype, device)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, attn: AttentionStep,
                delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual stream h and the previous layer's MLP output `delta`, not yet added (the
        add is fused into this layer's first norm) -> (h, this layer's MLP output)."""
        if delta is None:
            x = self.input_layernorm(h)
        else:
            h, x = self.input_layernorm.add_and_norm(h, delta)
        h, x = self.post_attention_layernorm.add_and_norm(
            h, self.self_attn(x, positions, attn))
        return h, self.mlp(x)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, tp_rank: int, tp_size: int, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        self.cfg, self.tp_rank, self.tp_size = cfg, tp_rank, tp_size
        self.dtype, self.device = dtype, device
        self.layout = lay = TPLayout(cfg, tp_rank, tp_size)
        if lay.padded_heads and tp_rank == 0:
            logger.info(
                "TP=%d does not divide %d KV heads: padding to %d KV / %d query heads with zero "
                "weights (outputs equal TP=1)", tp_size, cfg.num_key_value_heads,
                lay.kv_heads * tp_size, lay.q_heads * tp_size)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                    cfg.rope_scaling, device)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp_rank,
                                                   tp_size, dtype, device)
        self.layers = TypedModuleList(self.make_layer(i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        tied = self.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(tied, cfg.vocab_size, cfg.hidden_size, tp_rank, tp_size,
                                      dtype, device)
        self.attn_backend: AttentionBackend = select_attention_backend("auto", device,
                                                                       cfg.head_dim)
        # KV cache groups: which block table (and window) each layer reads, and which shared
        # cache tensor it uses (its index within its group)
        self.kv_cache_groups: list[KVCacheGroupSpec] = kv_cache_groups(cfg.windows())
        self.layer_group = [0] * cfg.num_hidden_layers
        self.layer_slot = [0] * cfg.num_hidden_layers
        for g, spec in enumerate(self.kv_cache_groups):
            for j, layer in enumerate(spec.layer_ids):
                self.layer_group[layer], self.layer_slot[layer] = g, j

    def make_layer(self, i: int) -> LlamaDecoderLayer:
        """Decoder layer i; model families override this to swap in their attention or MLP."""
        return LlamaDecoderLayer(self.cfg, self.layout, self.rope, self.tp_rank, self.dtype,
                                 self.device)

    def set_attention_backend(self, name: str) -> None:
        """auto | torch | cpu | triton; chosen once, before the first step."""
        self.attn_backend = select_attention_backend(name, self.device, self.cfg.head_dim)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata | list[AttentionMetadata]) -> torch.Tensor:
        """input_ids/positions [T] -> final hidden states [T, hidden]; writes new K/V.

        meta: one AttentionMetadata per KV cache group (their block tables and slots differ),
        or a single one that every group uses (profiling and graph-capture dummies)."""
        attn0 = self.layers[0].self_attn
        if attn0.k_cache is None:
            raise RuntimeError("KV cache not allocated: call allocate_kv_cache() first")
        h = self.embed(input_ids)
        metas = meta if isinstance(meta, list) else [meta] * len(self.kv_cache_groups)
        if len(metas) != len(self.kv_cache_groups):
            raise ValueError(f"{len(metas)} attention metadata for "
                             f"{len(self.kv_cache_groups)} KV cache groups")
        block_size = attn0.k_cache.shape[1]
        # one step per group: its block table and its window, built once for all its layers
        steps = [self.attn_backend.begin(m, block_size, self.device, spec.sliding_window)
                 for m, spec in zip(metas, self.kv_cache_groups, strict=True)]
        layer_group = self.layer_group
        delta = None
        for i, layer in enumerate(self.layers):
            h, delta = layer(h, positions, steps[layer_group[i]], delta)
        if delta is None:  # no layers
            return self.norm(h)
        return self.norm.add_and_norm(h, delta)[1]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> the first layer's input [T, hidden]; multimodal models override it to put
        encoder outputs in place of placeholder tokens."""
        return self.embed_tokens(input_ids)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32, identical on every rank."""
        return self.lm_head(hidden)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> argmax token ids [N], identical on every rank, no full-logit gather."""
        return self.lm_head.greedy(hidden)

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        """A block id holds one group's layers (the groups share the tensors)."""
        per_layer = 2 * block_size * self.layout.kv_heads * self.cfg.head_dim
        return per_layer * layers_per_group(self.kv_cache_groups) * self.dtype.itemsize

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        # Zeros, not empty: masked-out slots are multiplied by 0 and a stray NaN would survive.
        shape = (num_blocks, block_size, self.layout.kv_heads, self.cfg.head_dim)
        caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                   torch.zeros(shape, dtype=self.dtype, device=self.device))
                  for _ in range(layers_per_group(self.kv_cache_groups))]
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            attn.k_cache, attn.v_cache = caches[self.layer_slot[i]]
        # the distinct cache tensors, in slot order (layers of different groups share one):
        # what the KV offload tiers copy for a block id
        self.kv_caches = caches

    @torch.no_grad()
    def prepack_weights(self) -> None:
        """Reorder the linear weights for the CPU matmul library; call once, after loading
        (later in-place weight edits would not reach the packed copies)."""
        for m in self.modules():
            # the layers that keep a packed copy say so with a prepack() method
            prepack = getattr(m, "prepack", None)
            if m is not self and callable(prepack):
                prepack()

    @torch.no_grad()
    def load_weights(self, src: WeightSource) -> None:
        """Fill this rank's shards from full-model tensors named as in HF checkpoints."""
        emb = self.embed_tokens
        self.embed_tokens.weight.copy_(
            read_padded(src, "model.embed_tokens.weight", 0, emb.start, emb.start + emb.rows))
        for i, layer in enumerate(self.layers):
            prefix = f"model.layers.{i}"
            layer.input_layernorm.weight.copy_(src.read(f"{prefix}.input_layernorm.weight"))
            layer.post_attention_layernorm.weight.copy_(
                src.read(f"{prefix}.post_attention_layernorm.weight"))
            layer.self_attn.load(src, f"{prefix}.self_attn")
            layer.mlp.load(src, f"{prefix}.{layer.mlp.hf_name}")
        self.norm.weight.copy_(src.read("model.norm.weight"))
        head = self.lm_head
        if head.weight is not None:
            # Some "untied" checkpoints still omit lm_head; fall back to the embedding.
            name = "lm_head.weight" if src.has("lm_head.weight") else "model.embed_tokens.weight"
            head.weight.copy_(read_padded(src, name, 0, head.start, head.start + head.rows))
