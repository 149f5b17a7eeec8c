"""Tiny random Qwen2-VL / Qwen2.5-VL checkpoints (transformers, saved with save_pretrained in
fp32), pixel rows and prompts with image placeholders, for the VL model tests."""

from __future__ import annotations

import os

import numpy as np
import torch

FAMILIES = ["qwen2_vl", "qwen2_5_vl"]
IMAGE, START, END, VIDEO = 150, 151, 152, 153
PATCH_DIM = 3 * 2 * 14 * 14
# grids in patches (t, h, w): uneven sides, so Qwen2.5-VL's 2 x 2-unit windows (56 px) get cut
# short at the edges
GRIDS = [(1, 4, 8), (1, 6, 6), (1, 10, 4)]


def hf_vl_config(family: str):
    import transformers

    text = dict(vocab_size=200, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2,
                rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                 "rope_theta": 10000.0}, bos_token_id=1, eos_token_id=2)
    tokens = dict(image_token_id=IMAGE, vision_start_token_id=START, vision_end_token_id=END,
                  video_token_id=VIDEO)
    if family == "qwen2_vl":
        vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2,
                      initializer_range=0.2)
        return transformers.Qwen2VLConfig(text_config=text, vision_config=vision, **tokens)
    vision = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                  fullatt_block_indexes=[1], window_size=56, initializer_range=0.2)
    return transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **tokens)


def make_tiny_hf_vl(path: str, family: str, seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    cls = (transformers.Qwen2VLForConditionalGeneration if family == "qwen2_vl"
           else transformers.Qwen2_5_VLForConditionalGeneration)
    model = cls(hf_vl_config(family)).eval()
    # HF starts norms at 1 and biases at 0: randomize them so those paths are exercised
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_q" in name:
                p.copy_((1 if name.endswith("weight") else 0) + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn_like(p))
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return model


def pixels(grids, seed=1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(t * h * w for t, h, w in grids), PATCH_DIM, generator=g)


def vl_prompt(grids, text_runs) -> tuple[list[int], list[tuple[int, tuple[int, int, int]]]]:
    """text_runs[i] text tokens, then image i wrapped in vision start/end, ..., then the last
    run: the ids and the (offset, grid) spans."""
    ids: list[int] = []
    spans = []
    for i, run in enumerate(text_runs):
        ids += [(7 * i + j) % 140 + 3 for j in range(run)]
        if i < len(grids):
            t, h, w = grids[i]
            ids.append(START)
            spans.append((len(ids), grids[i]))
            ids += [IMAGE] * (t * h * w // 4)
            ids.append(END)
    return ids, spans


def hf_greedy_with_images(model, ids: list[int], images: list[np.ndarray],
                          max_new: int) -> list[int]:
    """transformers' greedy tokens for expanded prompt ids and their images, the pixels from
    its own (PIL-backend) Qwen2-VL image processor."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    kwargs = {}
    if images:
        proc = Qwen2VLImageProcessorPil()(images=images, return_tensors="pt")
        kwargs = dict(pixel_values=proc["pixel_values"], image_grid_thw=proc["image_grid_thw"])
    ids_t = torch.tensor([ids])
    # without mm_token_type_ids transformers gives image tokens 1-D positions
    types = (ids_t == IMAGE).long()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(ids_t, attention_mask=torch.ones_like(ids_t),
                             mm_token_type_ids=types, max_new_tokens=max_new, do_sample=False,
                             pad_token_id=0, **kwargs)
    return out[0, len(ids):].tolist()


# a minimal Qwen2-VL-like chat template: an image part is the placeholder, a text part its text
VL_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VL_WORDS = ["user", "assistant", "system", "describe", "the", "image", "what", "is", "this",
            "a", "picture", "of", "and", "in", "color", "red", "blue", "green", "cat", "dog"]


def add_tiny_vl_tokenizer(path: str) -> str:
    """A WordLevel tokenizer (whitespace pre-tokenizer) over the tiny VL model's 200 ids, saved
    in ``path`` as tokenizer.json + tokenizer_config.json: <unk> 0, <s> 1, </s> 2 (the model's
    eos), <|im_start|> 3, <|im_end|> 4, the VL_WORDS, filler words ``w<id>``, and the vision
    tokens at IMAGE / START / END / VIDEO (special). Unknown words are <unk>."""
    import json

    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    specials = {0: "<unk>", 1: "<s>", 2: "</s>", 3: "<|im_start|>", 4: "<|im_end|>",
                IMAGE: "<|image_pad|>", START: "<|vision_start|>", END: "<|vision_end|>",
                VIDEO: "<|video_pad|>"}
    words = iter(VL_WORDS)
    vocab = {}
    for i in range(200):
        vocab[specials.get(i) or next(words, None) or f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(specials[i], special=True, normalized=False)
                            for i in sorted(specials)])
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"bos_token": None, "eos_token": "</s>", "unk_token": "<unk>",
                   "add_bos_token": False, "chat_template": VL_CHAT_TEMPLATE}, f)
    return path


# image sides in pixels, multiples of 28 so the resize keeps them: 4, 12 and 8 image tokens
VL_SIZES = [(56, 56), (84, 112), (112, 56)]


def vl_images(seed: int) -> list[np.ndarray]:
    """Random uint8 RGB images of VL_SIZES."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in VL_SIZES]


def vl_cases(seed_a: int, seed_b: int) -> list[tuple[list[int], list[np.ndarray]]]:
    """(prompt ids with one pad per image, images): 0 to 3 images; two prompts with the same
    text and different images; one image twice in a prompt. Every prompt ends in text after
    the last image's vision_end, as chat prompts do."""
    a, b = vl_images(seed_a), vl_images(seed_b)
    text = [9, 17, 33, 4, 61]

    def ids(n_images: int, tail: list[int]) -> list[int]:
        out = list(text)
        for _ in range(n_images):
            out += [START, IMAGE, END, 40]
        return out + tail

    return [
        (ids(0, [70, 71]), []),
        (ids(1, [72]), [a[0]]),
        (ids(1, [72]), [b[0]]),  # same text, another image
        (ids(2, [73, 74, 75]), [a[1], a[2]]),
        (ids(3, [76]), [a[2], b[1], a[2]]),  # one image twice
    ]


def vl_expanded(ids: list[int], images: list[np.ndarray]) -> list[int]:
    """The ids with each image's one pad expanded to its token count (28 px per token)."""
    out: list[int] = []
    it = iter(images)
    for t in ids:
        if t == IMAGE:
            h, w = next(it).shape[:2]
            out += [IMAGE] * (h // 28 * (w // 28))
        else:
            out.append(t)
    return out
