"""Mixtral: Llama/Mistral attention and a sparse MoE block (`block_sparse_moe`, experts w1 =
gate, w3 = up, w2 = down) in every layer; top-k of the softmax, renormalised."""

from __future__ import annotations

from workers.model.llama import LlamaDecoderLayer, LlamaForCausalLM
from workers.model.moe.block import MIXTRAL_EXPERT_NAMES, SparseMoeBlock, set_moe_paths


class MixtralForCausalLM(LlamaForCausalLM):
    def make_layer(self, i: int) -> LlamaDecoderLayer:
        mlp = SparseMoeBlock(self.cfg, self.tp_rank, self.tp_size, self.dtype, self.device,
                             "block_sparse_moe", MIXTRAL_EXPERT_NAMES)
        return LlamaDecoderLayer(self.cfg, self.layout, self.rope, self.tp_rank, self.dtype,
                                 self.device, mlp=mlp)

    def set_attention_backend(self, name: str) -> None:
        super().set_attention_backend(name)
        set_moe_paths(self, self.attn_backend.name)
