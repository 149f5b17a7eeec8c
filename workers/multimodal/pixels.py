"""Resized uint8 pixels to the float32 patches a Qwen2-VL vision encoder takes.

The frontend sends each image resized (uint8 RGB, [grid_h * patch, grid_w * patch, 3]); every
rank turns it into patches here, as transformers' Qwen2VLImageProcessorPil does after its resize:
rescale (in float64, then float32, as transformers' ``rescale``), normalise in float32 with the
settings' mean and std, repeat the frame to ``temporal_patch_size`` and flatten the patches in
merge-window order (each merge_size x merge_size window of patches is contiguous, row-major
inside it), one row per patch laid out [channel, frame, patch row, patch column]. The result
equals transformers' bit for bit (tests/launch/multimodal/test_processor_parity.py).

numpy only: the ranks call it before the encoder, and the frontend must not need torch for it.
"""

from __future__ import annotations

import numpy as np

from protocol.multimodal import ImageSettings

__all__ = ["check_pixels", "patches"]


def check_pixels(pixels: np.ndarray, grid_thw: tuple[int, int, int],
                 settings: ImageSettings) -> None:
    """ValueError unless ``pixels`` is uint8 [h * patch, w * patch, 3] for ``grid_thw`` with
    whole merge windows (what the frontend produces)."""
    t, h, w = grid_thw
    p, m = settings.patch_size, settings.merge_size
    if t != 1:
        raise ValueError(f"an image has one frame, grid_thw {grid_thw} says {t}")
    if h <= 0 or w <= 0 or h % m or w % m:
        raise ValueError(f"grid {h} x {w} is not whole {m} x {m} merge windows")
    if pixels.dtype != np.uint8 or pixels.shape != (h * p, w * p, 3):
        raise ValueError(f"pixels {pixels.dtype} {pixels.shape} do not match grid_thw "
                         f"{grid_thw}: expected uint8 {(h * p, w * p, 3)}")


def patches(pixels: np.ndarray, grid_thw: tuple[int, int, int],
            settings: ImageSettings) -> np.ndarray:
    """float32 [t * h * w, 3 * temporal_patch_size * patch * patch] for one resized image."""
    check_pixels(pixels, grid_thw, settings)
    _, gh, gw = grid_thw
    p, m, tp = settings.patch_size, settings.merge_size, settings.temporal_patch_size
    # transformers' order of operations and dtypes, so rounding is the same: x * scale in
    # float64 cast to float32, then (x - mean) / std with float32 mean and std
    x = (pixels.astype(np.float64) * settings.rescale_factor).astype(np.float32)
    mean = np.asarray(settings.image_mean, dtype=np.float32)
    std = np.asarray(settings.image_std, dtype=np.float32)
    x = (x - mean) / std  # [H, W, C], broadcast over the channel axis
    # [H, W, C] -> (gh/m, m, p, gw/m, m, p, C) -> (gh/m, gw/m, m_h, m_w, C, p_h, p_w)
    x = x.reshape(gh // m, m, p, gw // m, m, p, 3).transpose(0, 3, 1, 4, 6, 2, 5)
    # the one frame repeated to fill a temporal patch: (..., C, T, p_h, p_w)
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], tp, p, p))
    return np.ascontiguousarray(x.reshape(gh * gw, 3 * tp * p * p))
