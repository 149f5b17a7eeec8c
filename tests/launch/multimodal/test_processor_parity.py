"""Our Qwen2-VL processing (frontend resize + rank-side patches) against transformers'
PIL-backend processor: equal grids and bit-equal pixel_values."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from launch.multimodal.image import to_rgb
from launch.multimodal.processor import ProcessorConfig, resize, smart_resize
from workers.multimodal.pixels import patches

qwen2_vl = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")


def _reference(image: object, **kwargs: int) -> tuple[np.ndarray, np.ndarray]:
    proc = qwen2_vl.Qwen2VLImageProcessorPil(**kwargs)
    out = proc(images=[image], return_tensors="np")
    return np.asarray(out["pixel_values"]), np.asarray(out["image_grid_thw"])


def _ours(image: object, **kwargs: int) -> tuple[np.ndarray, tuple[int, int, int]]:
    config = ProcessorConfig.from_dict({}, kwargs or None)
    item = resize(to_rgb(image), config)
    return patches(item.pixels, item.grid_thw, config.settings), item.grid_thw


def _noise(h: int, w: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    bands = {"RGB": 3, "RGBA": 4, "L": 1}.get(mode, 3)
    a = rng.integers(0, 256, size=(h, w, bands), dtype=np.uint8)
    return Image.fromarray(a[:, :, 0] if bands == 1 else a, mode)


@pytest.mark.parametrize("size", [(10, 10), (100, 37), (37, 100), (640, 480), (28, 28 * 3),
                                  (56, 56)])
def test_rgb_sizes_bit_exact(size: tuple[int, int]) -> None:
    w, h = size
    img = _noise(h, w)
    ref, ref_grid = _reference(img)
    ours, grid = _ours(img)
    assert tuple(ref_grid[0]) == grid
    assert ours.dtype == ref.dtype == np.float32
    assert np.array_equal(ours, ref)


@pytest.mark.parametrize("mode", ["L", "RGBA", "P", "LA", "CMYK"])
def test_modes_bit_exact(mode: str) -> None:
    img = _noise(61, 83, "RGBA" if mode in ("RGBA", "LA") else "RGB", seed=1).convert(mode)
    ref, _ = _reference(img)
    ours, _ = _ours(img)
    assert np.array_equal(ours, ref)


def test_palette_with_transparency_bit_exact() -> None:
    img = _noise(40, 50, seed=2).convert("P")
    img.info["transparency"] = 3
    ref, _ = _reference(img)
    assert np.array_equal(_ours(img)[0], ref)


@pytest.mark.parametrize("shape", [(45, 70, 3), (45, 70), (45, 70, 4), (45, 70, 1)])
def test_uint8_arrays_bit_exact(shape: tuple[int, ...]) -> None:
    a = np.random.default_rng(3).integers(0, 256, size=shape, dtype=np.uint8)
    # transformers cannot take a 2-D array in a list; its [H, W, 1] is the same gray image
    ref, _ = _reference(a[:, :, None] if a.ndim == 2 else a)
    assert np.array_equal(_ours(a)[0], ref)


def test_pixel_bounds_bit_exact() -> None:
    img = _noise(480, 640, seed=4)
    kwargs = {"min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 64}
    ref, ref_grid = _reference(img, **kwargs)
    ours, grid = _ours(img, **kwargs)
    assert tuple(ref_grid[0]) == grid and np.array_equal(ours, ref)


def test_smart_resize_matches_transformers() -> None:
    rng = np.random.default_rng(5)
    for _ in range(300):
        h, w = (int(x) for x in rng.integers(1, 5000, size=2))
        if max(h, w) / min(h, w) > 200:
            continue
        assert smart_resize(h, w) == qwen2_vl.smart_resize(h, w, 28, 56 * 56, 28 * 28 * 1280)


def test_aspect_ratio_refused() -> None:
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(1, 300)
