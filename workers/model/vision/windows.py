"""Attention segments of the tower: frames for full attention, and Qwen2.5-VL's windows.

A window is a square of window_size pixels, i.e. window_size / patch_size / merge_size merged
units per side (112 px = 4 x 4 units = 64 patches); the windows at the right and bottom edges
are cut short. For window attention the patches are reordered so that each window is one
contiguous run (a merged unit's merge_size**2 patches stay together, in their order); the tower
undoes the order after the merger.
"""

from __future__ import annotations

import numpy as np

from workers.model.vision.config import VisionConfig


def frame_bounds(grid_thw: list[tuple[int, int, int]]) -> list[int]:
    """Patch offsets where each frame of each image starts, plus the total: full attention is
    per frame (an image is one frame; video frames attend separately)."""
    bounds = [0]
    for t, h, w in grid_thw:
        for _ in range(t):
            bounds.append(bounds[-1] + h * w)
    return bounds


def window_order(v: VisionConfig, grid_thw: list[tuple[int, int, int]]
                 ) -> tuple[np.ndarray, list[int]]:
    """(order, bounds): order [units] int64 lists merged units (in the input's unit order)
    window by window (frames in turn, windows row-major, units row-major inside a window);
    bounds are the patch offsets of the windows in that order, plus the total."""
    m = v.spatial_merge_size
    side = v.window_size // m // v.patch_size
    order: list[np.ndarray] = []
    bounds = [0]
    base = 0
    for t, h, w in grid_thw:
        gh, gw = h // m, w // m
        units = np.arange(t * gh * gw, dtype=np.int64).reshape(t, gh, gw) + base
        for f in range(t):
            for y in range(0, gh, side):
                for x in range(0, gw, side):
                    win = units[f, y : y + side, x : x + side].reshape(-1)
                    order.append(win)
                    bounds.append(bounds[-1] + win.size * m * m)
        base += t * gh * gw
    return np.concatenate(order), bounds
