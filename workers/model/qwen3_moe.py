"""Qwen3-MoE: Qwen3 attention (q/k norms), a sparse MoE block in most layers (router top-k over
num_experts, optional renormalisation by norm_topk_prob) and a dense MLP in the layers named by
mlp_only_layers or skipped by decoder_sparse_step."""

from __future__ import annotations

from workers.model.llama import LlamaDecoderLayer
from workers.model.moe.block import QWEN3_MOE_EXPERT_NAMES, SparseMoeBlock, set_moe_paths
from workers.model.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def make_layer(self, i: int) -> LlamaDecoderLayer:
        mlp = None
        if self.cfg.is_moe_layer(i):
            mlp = SparseMoeBlock(self.cfg, self.tp_rank, self.tp_size, self.dtype, self.device,
                                 "mlp", QWEN3_MOE_EXPERT_NAMES)
        return LlamaDecoderLayer(self.cfg, self.layout, self.rope, self.tp_rank, self.dtype,
                                 self.device, self_attn=self.make_attention(), mlp=mlp)

    def set_attention_backend(self, name: str) -> None:
        super().set_attention_backend(name)
        set_moe_paths(self, self.attn_backend.name)
