"""Qwen2-VL's image processor up to the resize, reimplemented (transformers is not imported).

``smart_resize`` picks the size: both sides multiples of patch_size * merge_size (28), the area
within [min_pixels, max_pixels], the aspect ratio kept as far as that allows. The image is then
resized with PIL's BICUBIC filter, as transformers' PIL-backend processor
(Qwen2VLImageProcessorPil) does; what the frontend sends are those resized uint8 pixels, and
the ranks finish the job (workers/multimodal/pixels.py).

Settings come from the model directory's preprocessor_config.json when it has one (both the
older ``min_pixels`` / ``max_pixels`` keys and ``size: {shortest_edge, longest_edge}``), else
transformers' defaults; ``--mm-processor-kwargs`` may override min_pixels / max_pixels.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from PIL import Image

from protocol.multimodal import ImageSettings, image_settings_from

__all__ = ["MAX_ASPECT_RATIO", "ProcessedImage", "ProcessorConfig", "resize", "smart_resize"]

MAX_ASPECT_RATIO = 200  # transformers refuses more elongated images
DEFAULT_MIN_PIXELS = 56 * 56
DEFAULT_MAX_PIXELS = 28 * 28 * 1280


@dataclass(frozen=True)
class ProcessorConfig:
    settings: ImageSettings = field(default_factory=ImageSettings)
    min_pixels: int = DEFAULT_MIN_PIXELS
    max_pixels: int = DEFAULT_MAX_PIXELS

    @property
    def factor(self) -> int:
        return self.settings.patch_size * self.settings.merge_size

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], overrides: dict[str, Any] | None = None
                  ) -> ProcessorConfig:
        """From preprocessor_config.json's content; ``overrides`` (min_pixels / max_pixels)
        win. ValueError for a value of the wrong kind."""
        given = cfg.get("size")
        size: dict[str, Any] = given if isinstance(given, dict) else {}
        min_px = size.get("shortest_edge", cfg.get("min_pixels", DEFAULT_MIN_PIXELS))
        max_px = size.get("longest_edge", cfg.get("max_pixels", DEFAULT_MAX_PIXELS))
        # the older keys win over `size`, as transformers' __init__ lets them
        min_px = cfg.get("min_pixels", min_px)
        max_px = cfg.get("max_pixels", max_px)
        unknown = sorted(set(overrides or {}) - {"min_pixels", "max_pixels"})
        if unknown:
            raise ValueError(f"unknown mm_processor_kwargs {unknown}; known: max_pixels, "
                             "min_pixels")
        min_px = (overrides or {}).get("min_pixels", min_px)
        max_px = (overrides or {}).get("max_pixels", max_px)
        try:
            settings = image_settings_from(cfg)
        except ValueError as e:
            raise ValueError(f"preprocessor_config.json: {e}") from None
        for name, v in (("min_pixels", min_px), ("max_pixels", max_px)):
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if min_px > max_px:
            raise ValueError(f"min_pixels ({min_px}) is over max_pixels ({max_px})")
        return cls(settings, min_px, max_px)

    @classmethod
    def from_model_dir(cls, path: str | None, overrides: dict[str, Any] | None = None
                       ) -> ProcessorConfig:
        cfg: dict[str, Any] = {}
        file = os.path.join(path, "preprocessor_config.json") if path else None
        if file is not None and os.path.isfile(file):
            with open(file, encoding="utf-8") as f:
                data = json.load(f)
            cfg = data if isinstance(data, dict) else {}
        return cls.from_dict(cfg, overrides)


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = DEFAULT_MIN_PIXELS,
                 max_pixels: int = DEFAULT_MAX_PIXELS) -> tuple[int, int]:
    """transformers' smart_resize, to the float operation (so sizes agree exactly)."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"image aspect ratio {max(height, width) / min(height, width):.1f} "
                         f"is over {MAX_ASPECT_RATIO}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class ProcessedImage:
    pixels: np.ndarray  # uint8 RGB [grid_h * patch, grid_w * patch, 3]
    grid_thw: tuple[int, int, int]

    def num_tokens(self, merge_size: int) -> int:
        """Embeddings the encoder gives for it: patches / merge_size**2."""
        t, h, w = self.grid_thw
        return t * h * w // (merge_size * merge_size)


def resize(rgb: np.ndarray, config: ProcessorConfig) -> ProcessedImage:
    """uint8 RGB [H, W, 3] resized as Qwen2VLImageProcessorPil does, with its patch grid."""
    height, width = rgb.shape[:2]
    new_h, new_w = smart_resize(height, width, config.factor, config.min_pixels,
                                config.max_pixels)
    if (new_h, new_w) == (height, width):
        out = rgb  # PIL returns a copy of the same pixels for an unchanged size
    else:
        out = np.asarray(Image.fromarray(rgb).resize((new_w, new_h), Image.Resampling.BICUBIC))
    p = config.settings.patch_size
    return ProcessedImage(np.ascontiguousarray(out, dtype=np.uint8), (1, new_h // p, new_w // p))
