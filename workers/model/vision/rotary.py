"""The tower's 2-D rotary embedding: half of each head's rotary frequencies turn with the
patch's row, the other half with its column (rotate-half layout over the whole head_dim).

Patches arrive in merge-window order (the image processor groups each merge_size x merge_size
square of patches together, frame by frame), so the (row, col) of patch i follows that order.
"""

from __future__ import annotations

import numpy as np
import torch

from workers.model.vision.config import VisionConfig


def patch_rows_cols(grid_thw: list[tuple[int, int, int]], merge: int) -> np.ndarray:
    """[N, 2] int64 (row, col) of every patch of every image, in merge-window order."""
    out = []
    for t, h, w in grid_thw:
        grid_rows, grid_cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        # [h, w] -> [h/m, m, w/m, m] -> [h/m, w/m, m, m]: square by square, row-major inside
        shape = (h // merge, merge, w // merge, merge)
        rows = grid_rows.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
        cols = grid_cols.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
        out.append(np.tile(np.stack([rows, cols], axis=1), (t, 1)))
    return np.concatenate(out).astype(np.int64)


def vision_rotary_tables(v: VisionConfig, grid_thw: list[tuple[int, int, int]],
                         device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [N, head_dim / 2] float32: columns [0, hd/4) turn with the row, [hd/4, hd/2)
    with the column, at the inverse frequencies of a head_dim / 2 rotary."""
    quarter = v.head_dim // 2
    inv = 1.0 / v.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float32) / quarter)
    pos = torch.from_numpy(patch_rows_cols(grid_thw, v.spatial_merge_size)).float()
    angles = torch.cat([pos[:, :1] * inv, pos[:, 1:] * inv], dim=1)
    return angles.cos().to(device), angles.sin().to(device)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, head_dim] rotated (rotate-half) in float32, back in x's dtype."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)
