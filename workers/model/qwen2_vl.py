"""Qwen2-VL and Qwen2.5-VL: a Qwen2 LM with M-RoPE, fed image embeddings by a vision tower.

One class serves both families (the config's VisionConfig picks the tower's blocks). The rest
of the engine calls:

- encode_images(pixel_values, grid_thw): the images' LM-space embeddings, one tensor per image,
  identical on every rank;
- mm_step: set (an MMStep) around a forward whose tokens include image placeholders or need
  M-RoPE positions; None runs exactly the Qwen2 LM, so text-only and decode steps pay nothing.

Weights load from Hub names (`visual.*`, `model.layers.*`, `model.embed_tokens.weight`,
`model.norm.weight`, `lm_head.weight`) or transformers 5's (`model.visual.*`,
`model.language_model.*`).
"""

from __future__ import annotations

import torch

from workers.attention.reference import AttentionMetadata
from workers.model.config import ModelConfig
from workers.model.llama import LlamaForCausalLM, WeightSource
from workers.model.mrope import MMStep, MRotaryEmbedding
from workers.model.vision.tower import VisionTransformer

# Hub name prefix -> where transformers 5's save_pretrained puts the same tensors
_V5_PREFIXES = (("visual.", "model.visual."), ("model.", "model.language_model."))


class VLWeightNames:
    """A WeightSource that answers to Hub names whichever layout the checkpoint uses."""

    def __init__(self, src: WeightSource):
        self.src = src

    def name(self, hub: str) -> str:
        if self.src.has(hub):
            return hub
        for old, new in _V5_PREFIXES:
            if hub.startswith(old):
                alt = new + hub[len(old):]
                if self.src.has(alt):
                    return alt
        return hub  # missing under either name: the source's own error names it

    def has(self, name: str) -> bool:
        return self.src.has(self.name(name))

    def shape(self, name: str) -> tuple[int, ...]:
        return self.src.shape(self.name(name))

    def read(self, name: str, dim: int | None = None, start: int = 0,
             end: int | None = None) -> torch.Tensor:
        return self.src.read(self.name(name), dim, start, end)


class Qwen2VLForConditionalGeneration(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, tp_rank: int, tp_size: int, dtype: torch.dtype,
                 device: torch.device):
        if cfg.vision is None:
            raise ValueError(f"{cfg.model_type} config without a vision_config")
        super().__init__(cfg, tp_rank, tp_size, dtype, device)
        # the LM rotary with M-RoPE tables, shared by every layer like the one it replaces
        self.mrope = MRotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings,
                                      cfg.rope_theta, cfg.mrope_section, device)
        self.rope = self.mrope
        for layer in self.layers:
            layer.self_attn.rope = self.mrope
        self.visual = VisionTransformer(cfg.vision, tp_rank, tp_size, dtype, device)
        self.mm_step: MMStep | None = None

    @torch.inference_mode()
    def encode_images(self, pixel_values: torch.Tensor,
                      grid_thw: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """pixel_values [sum(t*h*w), C*T*P*P] as the image processor gives them -> one
        [t*h*w / merge_size**2, hidden] tensor per image, in the model dtype."""
        grids = [(int(t), int(h), int(w)) for t, h, w in grid_thw]
        out = self.visual(pixel_values, grids)
        unit = self.visual.v.merge_unit
        return list(out.split([t * h * w // unit for t, h, w in grids]))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = super().embed(input_ids)
        step = self.mm_step
        if step is not None and step.index.numel():
            h[step.index.to(h.device)] = step.embeds.to(device=h.device, dtype=h.dtype)
        return h

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata | list[AttentionMetadata]) -> torch.Tensor:
        step = self.mm_step
        if step is None or step.positions3 is None:
            return super().forward(input_ids, positions, meta)
        n = input_ids.shape[0]
        if tuple(step.positions3.shape) != (3, n):
            raise ValueError(f"positions3 of shape {tuple(step.positions3.shape)} for {n} tokens")
        # row i of the step's tables is token i's M-RoPE rotation; the backends use positions
        # only to index those tables (mrope.py)
        self.mrope.use(self.mrope.step_tables(step.positions3))
        try:
            return super().forward(input_ids, torch.arange(n, device=input_ids.device), meta)
        finally:
            self.mrope.use(None)

    @torch.no_grad()
    def load_weights(self, src: WeightSource) -> None:
        named = VLWeightNames(src)
        super().load_weights(named)
        self.visual.load(named, "visual")
