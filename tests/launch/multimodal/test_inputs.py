"""Image decoding limits, mm_hash, prompt expansion and ImageInputs (no engine)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from launch.multimodal.hashing import mm_hash
from launch.multimodal.image import ImageError, decode_image, to_rgb
from launch.multimodal.inputs import ImageInputs
from launch.multimodal.options import MultiModalOptions, parse_limit_mm
from launch.multimodal.placeholders import VisionTokens, expand_prompt
from protocol.multimodal import ImageSettings

PAD, START, END = 151655, 151652, 151653


def _png(w: int, h: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (10, 20, 30)).save(buf, "PNG")
    return buf.getvalue()


def _vl_dir(tmp_path: Path, preprocessor: dict | None = None) -> str:
    cfg = {"image_token_id": PAD, "vision_start_token_id": START, "vision_end_token_id": END,
           "vision_config": {"spatial_merge_size": 2}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    if preprocessor is not None:
        (tmp_path / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    return str(tmp_path)


def test_corrupt_and_empty_images_refused_without_paths() -> None:
    for data in (b"", b"not an image at all", _png(20, 20)[:40]):
        with pytest.raises(ImageError) as e:
            to_rgb(data)
        assert "/" not in str(e.value) and "BytesIO" not in str(e.value)


def test_over_pixel_limit_refused_from_the_header() -> None:
    data = _png(400, 300)
    with pytest.raises(ImageError, match="over the limit of 100000 pixels"):
        decode_image(data, max_pixels=100_000)
    assert decode_image(data, max_pixels=120_000).size == (400, 300)


def test_decompression_bomb_refused_before_decoding() -> None:
    # a 20000 x 20000 black PNG compresses to a few hundred KB; refused from its header
    buf = io.BytesIO()
    Image.new("1", (20000, 20000)).save(buf, "PNG")
    with pytest.raises(ImageError, match="over the limit"):
        to_rgb(buf.getvalue())


def test_arrays() -> None:
    gray = np.full((5, 7), 9, np.uint8)
    assert to_rgb(gray).shape == (5, 7, 3)
    assert to_rgb(np.full((5, 7, 3), 1.0)).max() == 255
    for bad in (np.full((5, 7, 3), 2.0), np.zeros((5, 7, 2), np.uint8), np.zeros((3,), np.uint8),
                np.full((4, 4, 3), 300, np.int32)):
        with pytest.raises(ImageError):
            to_rgb(bad)
    with pytest.raises(ImageError, match="unsupported image type"):
        to_rgb("a path")


def test_mm_hash_properties() -> None:
    a = np.random.default_rng(0).integers(0, 256, (28, 56, 3), dtype=np.uint8)
    s = ImageSettings()
    assert mm_hash(a, s) == mm_hash(a.copy(), s)
    b = a.copy()
    b[3, 4, 1] ^= 1
    assert mm_hash(b, s) != mm_hash(a, s)
    assert mm_hash(a.reshape(56, 28, 3), s) != mm_hash(a, s)  # same bytes, other shape
    assert mm_hash(a, ImageSettings(image_mean=(0.5, 0.5, 0.5))) != mm_hash(a, s)
    assert len(mm_hash(a, s)) == 64


def test_expand_prompt_forms() -> None:
    ids = [1, START, PAD, END, 2, START, PAD, END, 3]
    out, offs = expand_prompt(ids, [4, 6], PAD)
    assert out == [1, START] + [PAD] * 4 + [END, 2, START] + [PAD] * 6 + [END, 3]
    assert offs == [2, 9]
    assert expand_prompt(out, [4, 6], PAD) == (out, offs)  # already expanded: kept
    with pytest.raises(ValueError, match="2 image placeholder"):
        expand_prompt(ids, [4], PAD)
    with pytest.raises(ValueError, match="image 0"):
        expand_prompt([START, PAD, PAD, END], [4], PAD)


def test_vision_tokens_from_config() -> None:
    assert VisionTokens.from_config({"image_token_id": 5}) is None  # no vision_config
    t = VisionTokens.from_config({"vision_config": {}, "text_config": {"image_token_id": 5}})
    assert t is not None and t.image_token_id == 5 and t.merge_size == 2


def test_image_inputs_items(tmp_path: Path) -> None:
    inputs = ImageInputs.for_model(_vl_dir(tmp_path))
    img = Image.new("RGB", (100, 37), (200, 100, 0))
    ids, items = inputs.items([7, START, PAD, END, 8, START, PAD, END], [img, _png(640, 480)])
    assert len(items) == 2
    p0, p1 = items[0].placeholder, items[1].placeholder
    assert p0.grid_thw == (1, 2, 8) and p0.length == 4 and p0.offset == 2
    assert p1.grid_thw == (1, 34, 46) and p1.length == 34 * 46 // 4
    assert p1.offset == 2 + 4 + 3
    assert ids[p1.offset:p1.offset + p1.length] == [PAD] * p1.length
    assert len(ids) == 8 - 2 + p0.length + p1.length
    assert len(items[0].pixels) == 28 * 112 * 3
    # equal images, equal hashes
    _, again = inputs.items([START, PAD, END], [img.copy()])
    assert again[0].placeholder.mm_hash == p0.mm_hash


def test_image_inputs_refusals(tmp_path: Path) -> None:
    text_only = ImageInputs.for_model("dummy:tiny")
    with pytest.raises(ValueError, match="model 'dummy:tiny' does not accept images"):
        text_only.items([1, 2], [_png(30, 30)])
    assert text_only.items([1, 2], []) == ([1, 2], [])
    inputs = ImageInputs.for_model(_vl_dir(tmp_path),
                                   MultiModalOptions(limit_mm_per_prompt={"image": 1}))
    with pytest.raises(ValueError, match=r"at most 1 image\(s\) per prompt"):
        inputs.items([START, PAD, END] * 2, [_png(30, 30)] * 2)
    with pytest.raises(ValueError, match="1 image placeholder"):
        ImageInputs.for_model(_vl_dir(tmp_path)).items([START, PAD, END], [_png(30, 30)] * 2)


def test_preprocessor_config_and_kwargs(tmp_path: Path) -> None:
    d = _vl_dir(tmp_path, {"min_pixels": 3136, "max_pixels": 28 * 28 * 4, "merge_size": 2,
                           "patch_size": 14, "temporal_patch_size": 2})
    inputs = ImageInputs.for_model(d)
    assert inputs.config.max_pixels == 28 * 28 * 4
    item, _ = inputs.process(_png(640, 480))
    assert item.grid_thw == (1, 2, 4)  # 56 x 28 pixels: under 28 * 28 * 4
    more = ImageInputs.for_model(d, MultiModalOptions(mm_processor_kwargs={"max_pixels": 10**6}))
    assert more.config.max_pixels == 10**6
    with pytest.raises(ValueError, match="unknown mm_processor_kwargs"):
        ImageInputs.for_model(d, MultiModalOptions(mm_processor_kwargs={"fps": 1}))


def test_dict_prompts(tmp_path: Path) -> None:
    inputs = ImageInputs.for_model(_vl_dir(tmp_path))
    img = Image.new("L", (56, 56))

    def encode(text: str) -> list[int]:
        assert text == "<|vision_start|><|image_pad|><|vision_end|>hi"
        return [START, PAD, END, 42]

    ids, items = inputs.prompt_inputs(
        {"prompt": "<|vision_start|><|image_pad|><|vision_end|>hi",
         "multi_modal_data": {"image": img}}, encode)
    assert ids == [START] + [PAD] * 4 + [END, 42] and len(items) == 1
    ids2, _ = inputs.prompt_inputs(
        {"prompt_token_ids": [START, PAD, END, 42], "multi_modal_data": {"image": [img]}}, encode)
    assert ids2 == ids
    with pytest.raises(ValueError, match="unsupported multi_modal_data"):
        inputs.prompt_inputs({"prompt_token_ids": [1], "multi_modal_data": {"video": []}}, encode)


def test_limit_flag_parsing() -> None:
    assert parse_limit_mm('{"image": 4}') == {"image": 4}
    assert parse_limit_mm({"image": {"count": 2}}) == {"image": 2}
    for bad in ('{"audio": 1}', '{"image": -1}', "[1]", "{"):
        with pytest.raises(ValueError):
            parse_limit_mm(bad)
