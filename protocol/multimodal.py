"""Images on the wire: what the frontend sends with a request, and what a step tells the ranks.

An image enters as a processed item: the frontend resizes it as the model's image processor does
and sends the resized RGB pixels (uint8, [h * patch, w * patch, 3]); the ranks rescale,
normalise and cut them into patches themselves (workers/multimodal/pixels.py), since uint8 is
a quarter of the bytes of the float32 patches. ``mm_hash`` names the item's content: a hash of
the processed pixels and the processor settings, so equal hashes mean equal encoder outputs.

A prompt holds an item's embeddings at a placeholder span: ``length`` tokens from prompt
position ``offset``. The engine core keeps the pixels until the request ends and sends them to
the ranks only in a step that runs the encoder on them (``EncoderInput``): an image crosses the
step socket once per encoder run, and not at all when its output is still cached.

A step with encoder work is an ``EncoderSchedulerOutput`` (a SchedulerOutput with one more
field under its own tag), so a text-only step's bytes stay those of a plain SchedulerOutput.
"""

from __future__ import annotations

import msgspec


class MMPlaceholder(msgspec.Struct, array_like=True, frozen=True):
    """Where one item's embeddings go in a prompt."""

    mm_hash: str  # content hash of the processed item (pixels and processor settings)
    offset: int  # prompt position of its first embedding
    length: int  # embeddings (placeholder tokens) the encoder gives for it
    grid_thw: tuple[int, int, int]  # the patch grid before merging: frames, rows, columns


class MMItem(msgspec.Struct, array_like=True, frozen=True):
    """An item as the frontend sends it with its request (AddRequest's options)."""

    placeholder: MMPlaceholder
    pixels: bytes  # uint8 RGB, row-major [grid_h * patch, grid_w * patch, 3]


class EncoderInput(msgspec.Struct, array_like=True, frozen=True):
    """An item the ranks encode this step; its output is cached by ``mm_hash``."""

    mm_hash: str
    grid_thw: tuple[int, int, int]
    pixels: bytes


class RequestPlaceholders(msgspec.Struct, array_like=True, frozen=True):
    """A new request's placeholder spans, in prompt order (M-RoPE positions, embedding merge)."""

    handle: int
    placeholders: list[MMPlaceholder]


class EncoderStep(msgspec.Struct, array_like=True, kw_only=True, omit_defaults=True):
    """The encoder's part of a step diff."""

    # placeholders of this step's new requests that have items
    new_placeholders: list[RequestPlaceholders] = []
    # items to encode this step, before the forward (vLLM: scheduled_encoder_inputs)
    scheduled_encoder_inputs: list[EncoderInput] = []
    # cached outputs no request will read again: every rank drops exactly these
    free_encoder_mm_hashes: list[str] = []


class ImageSettings(msgspec.Struct, array_like=True, frozen=True, kw_only=True):
    """How resized pixels become patches: what the ranks need besides the pixels themselves.

    The frontend reads it from the model's preprocessor_config.json (launch/multimodal/
    processor.py) and it is part of every item's ``mm_hash``; the ranks derive the same value
    from the same file, so it need not travel with each item. Defaults are transformers'
    Qwen2-VL image processor's (OpenAI CLIP mean and std). The resize bounds (min / max
    pixels) are not here: they shape the pixels the frontend sends, not what a rank does.
    """

    patch_size: int = 14  # pixels per patch side
    merge_size: int = 2  # patches per merged token side (spatial_merge_size)
    temporal_patch_size: int = 2  # frames per patch (an image is repeated to fill them)
    image_mean: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)
    image_std: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)
    rescale_factor: float = 1 / 255


def image_settings_from(cfg: dict) -> ImageSettings:
    """The settings a preprocessor_config.json dict names (transformers' defaults for the
    rest); ValueError for a value of the wrong kind. The frontend and the ranks both read
    the file through this, so they cannot disagree."""
    d = ImageSettings()

    def whole(key: str, default: int) -> int:
        v = cfg.get(key, default)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{key} must be a positive integer, got {v!r}")
        return v

    def triple(key: str, default: tuple[float, float, float]) -> tuple[float, float, float]:
        v = cfg.get(key, default)
        if isinstance(v, int | float) and not isinstance(v, bool):
            v = [v] * 3  # one value for every channel, as transformers allows
        if not (isinstance(v, list | tuple) and len(v) == 3
                and all(isinstance(x, int | float) for x in v)):
            raise ValueError(f"{key} must be three numbers, got {v!r}")
        return (float(v[0]), float(v[1]), float(v[2]))

    scale = cfg.get("rescale_factor", d.rescale_factor)
    if not isinstance(scale, int | float) or isinstance(scale, bool):
        raise ValueError(f"rescale_factor must be a number, got {scale!r}")
    return ImageSettings(
        patch_size=whole("patch_size", d.patch_size),
        merge_size=whole("merge_size", d.merge_size),
        temporal_patch_size=whole("temporal_patch_size", d.temporal_patch_size),
        image_mean=triple("image_mean", d.image_mean),
        image_std=triple("image_std", d.image_std),
        rescale_factor=float(scale),
    )
