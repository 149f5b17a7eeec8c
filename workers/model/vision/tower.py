"""The vision tower: patch embedding, blocks with the 2-D rotary, patch merger.

Qwen2.5-VL reorders the patches window by window before the blocks (so that window attention
is block-diagonal over contiguous runs; its full-attention blocks see frames, which stay
contiguous under that order) and restores the input order after the merger.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from workers.model.layers import TypedModuleList
from workers.model.llama import WeightSource
from workers.model.vision.block import VisionBlock
from workers.model.vision.config import VisionConfig
from workers.model.vision.merger import PatchMerger
from workers.model.vision.parallel import VisionShard
from workers.model.vision.patch_embed import PatchEmbed
from workers.model.vision.rotary import vision_rotary_tables
from workers.model.vision.windows import frame_bounds, window_order

logger = logging.getLogger(__name__)


class VisionTransformer(nn.Module):
    def __init__(self, v: VisionConfig, tp_rank: int, tp_size: int, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        self.v, self.device = v, device
        self.shard = shard = VisionShard.of(v, tp_rank, tp_size)
        if tp_size > 1 and tp_rank == 0:
            if shard.sharded:
                logger.info("vision tower: %d heads split over %d ranks", v.num_heads, tp_size)
            else:
                logger.info("vision tower: %d heads do not divide TP=%d, replicated on every "
                            "rank", v.num_heads, tp_size)
        self.patch_embed = PatchEmbed(v, dtype, device)
        self.blocks = TypedModuleList(VisionBlock(v, shard, dtype, device)
                                      for _ in range(v.depth))
        self.merger = PatchMerger(v, dtype, device)

    def forward(self, pixel_values: torch.Tensor,
                grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
        """pixel_values [sum(t*h*w), patch_dim] in the image processor's row order ->
        [sum(t*h*w) / merge_size**2, LM hidden], the images' tokens in order."""
        v = self.v
        expected = sum(t * h * w for t, h, w in grid_thw)
        if pixel_values.shape != (expected, v.patch_dim):
            raise ValueError(f"pixel_values of shape {tuple(pixel_values.shape)} for grids "
                             f"{grid_thw}: expected ({expected}, {v.patch_dim})")
        m = v.spatial_merge_size
        if any(h % m or w % m for _, h, w in grid_thw):
            raise ValueError(f"grid sides must be multiples of the merge size {m}: {grid_thw}")
        x = self.patch_embed(pixel_values.to(self.device))
        cos, sin = vision_rotary_tables(v, grid_thw, self.device)
        full = frame_bounds(grid_thw)
        windowed = v.window_size > 0
        win_bounds = full
        if windowed:
            order_np, win_bounds = window_order(v, grid_thw)
            order = torch.from_numpy(order_np).to(self.device)
            x, cos, sin = (_by_unit(a, order, v.merge_unit) for a in (x, cos, sin))
        for i, block in enumerate(self.blocks):
            use_full = not windowed or i in v.fullatt_block_indexes
            x = block(x, cos, sin, full if use_full else win_bounds)
        out = self.merger(x)
        if windowed:
            out = out[torch.argsort(order)]
        return out

    def load(self, src: WeightSource, prefix: str = "visual") -> None:
        self.patch_embed.load(src, f"{prefix}.patch_embed")
        for i, block in enumerate(self.blocks):
            block.load(src, f"{prefix}.blocks.{i}")
        self.merger.load(src, f"{prefix}.merger")


def _by_unit(x: torch.Tensor, order: torch.Tensor, unit: int) -> torch.Tensor:
    """Rows of x reordered in groups of `unit` rows (one merged unit's patches) by order."""
    return x.view(-1, unit, x.shape[-1])[order].reshape(x.shape)
