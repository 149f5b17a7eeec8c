"""Qwen2-VL / Qwen2.5-VL against transformers on tiny random checkpoints: the vision tower, the
prompt logits with images (M-RoPE), the M-RoPE positions, and both config.json layouts."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from tests.helpers.paged import Seq, build_step
from tests.helpers.tiny_vl import (
    FAMILIES,
    GRIDS,
    IMAGE,
    hf_vl_config,
    make_tiny_hf_vl,
    pixels,
    vl_prompt,
)
from workers.model.config import ModelConfig, dummy_config
from workers.model.loader import load_model
from workers.model.mrope import MMStep, mrope_positions


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    hf = make_tiny_hf_vl(path, request.param)
    ours, _ = load_model(path, 0, 1, torch.float32, torch.device("cpu"))
    return request.param, path, hf, ours


@pytest.mark.parametrize("n_images", [1, 2, 3])
def test_encode_images_matches_hf(checkpoint, n_images):
    _, _, hf, ours = checkpoint
    grids = GRIDS[:n_images]
    pix = pixels(grids)
    with torch.no_grad():
        ref = hf.model.get_image_features(pix, torch.tensor(grids)).pooler_output
    got = ours.encode_images(pix, grids)
    assert len(got) == n_images
    for g, r, (t, h, w) in zip(got, ref, grids, strict=True):
        assert g.shape == (t * h * w // 4, 64)
        assert (g - r).abs().max().item() < 1e-4


def _hf_logits(hf, ids, spans, pix):
    grids = [g for _, g in spans]
    types = torch.zeros(1, len(ids), dtype=torch.int64)
    types[0, torch.tensor(ids) == IMAGE] = 1
    kwargs = {}
    if grids:
        kwargs = dict(pixel_values=pix, image_grid_thw=torch.tensor(grids))
    with torch.no_grad():
        return hf(input_ids=torch.tensor([ids]), mm_token_type_ids=types, **kwargs).logits[0]


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("n_images", [0, 1, 2])
def test_prompt_logits_then_decode_match_hf(checkpoint, n_images, backend):
    """auto is the C++ backend on CPU (its fused rotary reads the per-step tables too)."""
    _, _, hf, ours = checkpoint
    ours.set_attention_backend(backend)
    grids = GRIDS[:n_images]
    ids, spans = vl_prompt(grids, [5, 3, 4][: n_images + 1])
    pix = pixels(grids)
    bs = 16
    ours.allocate_kv_cache(16, bs)
    seq = Seq(list(ids), list(range(1, 1 + -(-(len(ids) + 1) // bs))))
    pos3, delta = mrope_positions(len(ids), spans)
    index = torch.tensor([i for i, t in enumerate(ids) if t == IMAGE], dtype=torch.int64)
    embeds = torch.cat(ours.encode_images(pix, grids)) if grids else torch.zeros(0, 64)
    step_ids, step_pos, meta = build_step([seq], [len(ids)], bs)
    ours.mm_step = MMStep(embeds, index, torch.from_numpy(pos3))
    try:
        got = ours.compute_logits(ours(step_ids, step_pos, meta))
    finally:
        ours.mm_step = None
    ref = _hf_logits(hf, ids, spans, pix)
    assert (got - ref).abs().max().item() < 1e-4
    # a decode step after the prompt: plain LM, 1-D position p + delta
    seq.num_computed = len(ids)
    nxt = int(ref[-1].argmax())
    seq.tokens.append(nxt)
    step_ids, step_pos, meta = build_step([seq], [1], bs)
    got = ours.compute_logits(ours(step_ids, step_pos + delta, meta))
    ref = _hf_logits(hf, ids + [nxt], spans, pix)
    assert (got[-1] - ref[-1]).abs().max().item() < 1e-4


def test_mrope_positions_match_hf_get_rope_index():
    import transformers

    model = transformers.Qwen2VLModel(hf_vl_config("qwen2_vl")).eval()
    rng = np.random.default_rng(0)
    for _ in range(40):
        n = int(rng.integers(0, 4))
        grids = [(1, 2 * int(rng.integers(1, 5)), 2 * int(rng.integers(1, 5))) for _ in range(n)]
        ids, spans = vl_prompt(grids, [int(rng.integers(0, 5)) for _ in range(n + 1)])
        if not ids:
            continue
        got, delta = mrope_positions(len(ids), spans)
        types = (torch.tensor([ids]) == IMAGE).long()
        ref, ref_delta = model.get_rope_index(
            torch.tensor([ids]), types, torch.tensor(grids) if grids else None)
        assert np.array_equal(got, ref[:, 0].numpy()), (grids, ids)
        assert delta == int(ref_delta)


def test_mrope_positions_text_only_and_video_frames():
    pos, delta = mrope_positions(5, [])
    assert np.array_equal(pos, np.tile(np.arange(5), (3, 1))) and delta == 0
    # two frames of a 2 x 4-unit grid after 2 text tokens: t 0..1, h 0..1, w 0..3, then text
    pos, delta = mrope_positions(2 + 16 + 1, [(2, (2, 4, 8))])
    assert pos[:, 2].tolist() == [2, 2, 2] and pos[:, 17].tolist() == [3, 3, 5]
    assert pos[:, 18].tolist() == [6, 6, 6] and delta == 6 + 1 - 19


def test_hub_and_transformers5_layouts_agree(tmp_path):
    """Flat Hub config (LM keys on top, rope_scaling type mrope) == text_config layout."""
    path = str(tmp_path / "m")
    make_tiny_hf_vl(path, "qwen2_vl")
    with open(os.path.join(path, "config.json")) as f:
        v5 = json.load(f)
    hub = {k: v for k, v in v5.items() if k != "text_config"} | v5["text_config"]
    hub["model_type"] = "qwen2_vl"
    rope = hub.pop("rope_parameters")
    hub["rope_theta"] = rope["rope_theta"]
    hub["rope_scaling"] = {"type": "mrope", "mrope_section": rope["mrope_section"]}
    vision = dict(hub["vision_config"])
    vision["in_chans"] = vision.pop("in_channels")
    hub["vision_config"] = vision
    a, b = ModelConfig.from_hf_dict(v5), ModelConfig.from_hf_dict(hub)
    assert a == b
    assert a.vision is not None and a.vision.embed_dim == 32 and a.vision.out_hidden_size == 64
    assert a.attention_bias and not a.o_proj_bias and a.rope_scaling is None
    assert a.mrope_section == [2, 3, 3] and a.image_token_id == IMAGE


def test_hub_weight_names_load(tmp_path, checkpoint):
    """A checkpoint under the Hub's names (visual.*, model.layers.*) loads to the same model."""
    from safetensors.torch import load_file, save_file

    _, path, _, ours = checkpoint
    hub_dir = tmp_path / "hub"
    hub_dir.mkdir()
    tensors = load_file(os.path.join(path, "model.safetensors"))
    renamed = {k.replace("model.visual.", "visual.").replace("model.language_model.", "model."):
               v for k, v in tensors.items()}
    assert "visual.merger.mlp.0.weight" in renamed and "model.norm.weight" in renamed
    save_file(renamed, str(hub_dir / "model.safetensors"))
    with open(os.path.join(path, "config.json")) as f:
        (hub_dir / "config.json").write_text(f.read())
    model, _ = load_model(str(hub_dir), 0, 1, torch.float32, torch.device("cpu"))
    for (name, p), q in zip(model.state_dict().items(), ours.state_dict().values(), strict=True):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("preset", ["qwen2-vl-tiny", "qwen2.5-vl-tiny"])
def test_tiny_presets_run_and_profile(preset):
    from workers.runner.memory_profile import profile_forward

    model, cfg = load_model(f"dummy:{preset}", 0, 1, torch.float32, torch.device("cpu"))
    assert cfg.vision is not None
    out = model.encode_images(pixels(GRIDS[:2]), GRIDS[:2])
    assert [o.shape[0] for o in out] == [8, 9] and all(torch.isfinite(o).all() for o in out)
    profile_forward(model, 40, 32, 4, 16, torch.device("cpu"))


def test_real_shape_presets():
    a, b = dummy_config("dummy:qwen2-vl-2b"), dummy_config("dummy:qwen2.5-vl-7b")
    assert a.vision is not None and b.vision is not None
    assert (a.vision.embed_dim, a.vision.intermediate_size, a.vision.out_hidden_size) == (
        1280, 5120, 1536)
    assert b.vision.fullatt_block_indexes == [7, 15, 23, 31] and b.vision.window_size == 112
    assert a.mrope_section == b.mrope_section == [16, 24, 24]


@pytest.mark.slow
def test_tp2_matches_hf(checkpoint, tmp_path):
    """Two gloo ranks: the tower split by heads (2 heads / 2 ranks), every rank's images and
    logits equal to transformers'."""
    from safetensors.torch import load_file

    from tests.helpers.multiproc import HERE, run_ranks

    _, path, hf, _ = checkpoint
    out = str(tmp_path / "out")
    run_ranks(os.path.join(HERE, "vl_tp_run.py"), [path, out], 2, timeout_s=120)
    grids = GRIDS[:2]
    pix = pixels(grids)
    with torch.no_grad():
        ref_images = hf.model.get_image_features(pix, torch.tensor(grids)).pooler_output
    ids, spans = vl_prompt(grids, [5, 3, 4])
    ref_logits = _hf_logits(hf, ids, spans, pix)
    ranks = [load_file(os.path.join(out, f"rank{r}.safetensors")) for r in range(2)]
    for got in ranks:
        for i, ref in enumerate(ref_images):
            assert (got[f"image.{i}"] - ref).abs().max().item() < 1e-4
        assert (got["logits"] - ref_logits).abs().max().item() < 1e-4
    assert torch.equal(ranks[0]["image.0"], ranks[1]["image.0"])
