"""Image placeholders in a prompt: the model's special token ids and the prompt's expansion.

A Qwen2-VL prompt marks each image as ``<|vision_start|><|image_pad|><|vision_end|>`` (vLLM's
form; the chat template writes it). The encoder gives ``t * h * w / merge_size**2`` embeddings
per image, so its one ``<|image_pad|>`` becomes that many, and the item's MMPlaceholder says
where they start.

Token-id prompts are accepted in two forms, per image: one ``image_pad`` id (expanded here), or
already expanded (a run of exactly the image's count, kept). Images are matched to runs of
consecutive image_pad ids in order, so two images need something between their runs (the
vision_end / vision_start ids always are). Any other count is an error naming the image.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["VisionTokens", "expand_prompt", "image_runs"]


@dataclass(frozen=True)
class VisionTokens:
    """The ids of a vision model's placeholder tokens and the encoder's merge size."""

    image_token_id: int
    vision_start_token_id: int | None = None
    vision_end_token_id: int | None = None
    merge_size: int = 2

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> VisionTokens | None:
        """From a config.json's content; None for a model without vision_config (text only).

        transformers' Qwen2-VL configs keep the ids at the top level; newer ones may nest
        them in text_config, which is read as a fallback."""
        vision = config.get("vision_config")
        if not isinstance(vision, dict):
            return None
        nested = config.get("text_config")
        text: dict[str, Any] = nested if isinstance(nested, dict) else {}

        def get(key: str) -> int | None:
            v = config.get(key, text.get(key))
            return v if isinstance(v, int) and not isinstance(v, bool) else None

        image = get("image_token_id")
        if image is None:
            raise ValueError("the model's config.json has a vision_config but no image_token_id")
        merge = vision.get("spatial_merge_size", 2)
        return cls(image, get("vision_start_token_id"), get("vision_end_token_id"),
                   merge if isinstance(merge, int) and merge > 0 else 2)

    @classmethod
    def from_model_dir(cls, path: str | None) -> VisionTokens | None:
        """From ``path``/config.json; None without one (dummy models, .gguf files)."""
        file = os.path.join(path, "config.json") if path else None
        if file is None or not os.path.isfile(file):
            return None
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
        return cls.from_config(data) if isinstance(data, dict) else None


def image_runs(ids: Sequence[int], image_token_id: int) -> list[tuple[int, int]]:
    """(start, length) of every run of consecutive image_token_id ids, in order."""
    runs: list[tuple[int, int]] = []
    start = -1
    for i, t in enumerate(ids):
        if t == image_token_id:
            if start < 0:
                start = i
        elif start >= 0:
            runs.append((start, i - start))
            start = -1
    if start >= 0:
        runs.append((start, len(ids) - start))
    return runs


def expand_prompt(ids: Sequence[int], counts: Sequence[int], image_token_id: int
                  ) -> tuple[list[int], list[int]]:
    """The prompt with each image's placeholder run at its ``counts[i]`` tokens, and each
    run's offset in the result. ValueError when the runs do not match the images."""
    runs = image_runs(ids, image_token_id)
    if len(runs) != len(counts):
        raise ValueError(f"the prompt has {len(runs)} image placeholder(s) for {len(counts)} "
                         "image(s)")
    out: list[int] = []
    offsets: list[int] = []
    pos = 0
    for i, ((start, length), n) in enumerate(zip(runs, counts, strict=True)):
        if length not in (1, n):
            raise ValueError(f"image {i}: its placeholder has {length} tokens; expected 1 (to "
                             f"expand) or {n} (expanded)")
        out.extend(ids[pos:start])
        offsets.append(len(out))
        out.extend([image_token_id] * n)
        pos = start + length
    out.extend(ids[pos:])
    return out, offsets
