"""A prompt with images as the engine takes it: expanded token ids and one MMItem per image.

``ImageInputs`` is built once per served model (its config.json says whether it takes images
and which ids its placeholders have; preprocessor_config.json how images are resized) and is
what the Python API and the HTTP server call; neither needs to know the steps.

The Python API's prompt forms are vLLM's: ``{"prompt": text, "multi_modal_data": {"image":
img_or_list}}`` and ``{"prompt_token_ids": [...], "multi_modal_data": ...}``; plain strings and
token-id lists pass through unchanged.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from launch.multimodal.hashing import mm_hash
from launch.multimodal.image import ImageError, to_rgb
from launch.multimodal.options import MultiModalOptions
from launch.multimodal.placeholders import VisionTokens, expand_prompt
from launch.multimodal.processor import ProcessedImage, ProcessorConfig, resize
from protocol.multimodal import MMItem, MMPlaceholder

__all__ = ["ImageInputs", "is_mm_prompt"]

PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "multi_modal_data"})


def is_mm_prompt(prompt: Any) -> bool:
    """A vLLM-style dict prompt (what needs ImageInputs.prompt_inputs)."""
    return isinstance(prompt, Mapping)


@dataclass
class ImageInputs:
    model: str  # the name errors use
    tokens: VisionTokens | None  # None: a text-only model
    config: ProcessorConfig = field(default_factory=ProcessorConfig)
    options: MultiModalOptions = field(default_factory=MultiModalOptions)

    @classmethod
    def for_model(cls, model: str, options: MultiModalOptions | None = None) -> ImageInputs:
        """From a model name as the engine takes it: a Hugging Face directory is read; any
        other (dummy:*, .gguf) is text only. ValueError for a bad config or kwargs."""
        options = options or MultiModalOptions()
        path = model if os.path.isdir(model) else None
        tokens = VisionTokens.from_model_dir(path)
        config = ProcessorConfig.from_model_dir(path if tokens is not None else None,
                                                options.mm_processor_kwargs)
        if tokens is not None and tokens.merge_size != config.settings.merge_size:
            raise ValueError(f"config.json's spatial_merge_size ({tokens.merge_size}) and "
                             f"preprocessor_config.json's merge_size "
                             f"({config.settings.merge_size}) disagree")
        return cls(model, tokens, config, options)

    @property
    def accepts_images(self) -> bool:
        return self.tokens is not None

    def check_count(self, n: int) -> None:
        """ImageError unless the model takes ``n`` images in one prompt."""
        if n == 0:
            return
        if self.tokens is None:
            raise ImageError(f"model {self.model!r} does not accept images")
        limit = self.options.image_limit()
        if n > limit:
            raise ImageError(f"at most {limit} image(s) per prompt (--limit-mm-per-prompt), "
                             f"got {n}")

    def process(self, image: Any) -> tuple[ProcessedImage, str]:
        """One accepted image (see image.py) resized, with its mm_hash."""
        rgb = to_rgb(image, self.options.max_image_pixels)
        try:
            item = resize(rgb, self.config)
        except ValueError as e:  # smart_resize's aspect-ratio bound
            raise ImageError(str(e)) from None
        return item, mm_hash(item.pixels, self.config.settings)

    def items(self, ids: Sequence[int], images: Sequence[Any]) -> tuple[list[int], list[MMItem]]:
        """``ids`` (one image_pad per image, or already expanded) with each placeholder at
        its image's token count, and the items in prompt order. ImageError when the images
        and the placeholders disagree, or for a bad image."""
        self.check_count(len(images))
        if not images:
            return list(ids), []
        assert self.tokens is not None
        done = [self.process(img) for img in images]
        merge = self.config.settings.merge_size
        counts = [p.num_tokens(merge) for p, _ in done]
        try:
            out, offsets = expand_prompt(ids, counts, self.tokens.image_token_id)
        except ValueError as e:
            raise ImageError(str(e)) from None
        mm = [MMItem(MMPlaceholder(h, off, n, p.grid_thw), p.pixels.tobytes())
              for (p, h), off, n in zip(done, offsets, counts, strict=True)]
        return out, mm

    def prompt_inputs(self, prompt: Mapping[str, Any], encode: Callable[[str], list[int]]
                      ) -> tuple[list[int], list[MMItem]]:
        """A vLLM-style dict prompt as (expanded ids, items); ValueError for a bad one."""
        unknown = sorted(set(prompt) - PROMPT_KEYS)
        if unknown:
            raise ValueError(f"unknown prompt key(s) {unknown}; known: {sorted(PROMPT_KEYS)}")
        if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
            raise ValueError("a dict prompt needs exactly one of 'prompt' and "
                             "'prompt_token_ids'")
        if "prompt" in prompt:
            text = prompt["prompt"]
            if not isinstance(text, str):
                raise ValueError("'prompt' must be a string")
            ids = encode(text)
        else:
            ids = [int(t) for t in prompt["prompt_token_ids"]]
        return self.items(ids, images_of(prompt.get("multi_modal_data")))


def images_of(data: Any) -> list[Any]:
    """multi_modal_data's images: one image or a list of them, as vLLM takes them."""
    if data is None:
        return []
    if not isinstance(data, Mapping):
        raise ValueError("multi_modal_data must be a dict like {'image': [...]}")
    unsupported = sorted(set(data) - {"image"})
    if unsupported:
        raise ValueError(f"unsupported multi_modal_data modality {unsupported}; supported: "
                         "image")
    images = data.get("image")
    if images is None:
        return []
    return list(images) if isinstance(images, (list, tuple)) else [images]
