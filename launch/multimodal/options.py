"""The frontend's image limits and where images may come from, with vLLM's names.

``limit_mm_per_prompt`` ({"image": N}), ``allowed_local_media_path``, ``allowed_media_domains``
and ``mm_processor_kwargs`` are vLLM's engine arguments; the fetch timeout defaults to vLLM's
VLLM_IMAGE_FETCH_TIMEOUT (5 s). vLLM has no names for the byte and pixel bounds, so they are
ours (``media_max_bytes``, ``max_image_pixels``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DEFAULT_MAX_IMAGE_PIXELS", "MM_OPTION_NAMES", "MultiModalOptions", "parse_json_dict",
           "parse_limit_mm"]

DEFAULT_LIMIT_PER_PROMPT = 999  # vLLM v1's default per modality
DEFAULT_MEDIA_MAX_BYTES = 20 * 2**20
# PIL's own warning threshold (about 89.5 megapixels; it refuses at twice this)
DEFAULT_MAX_IMAGE_PIXELS = 89_478_485
MODALITIES = frozenset({"image"})


def _default_timeout() -> float:
    try:
        return float(os.environ.get("VLLM_IMAGE_FETCH_TIMEOUT", "5"))
    except ValueError:
        return 5.0


@dataclass(frozen=True)
class MultiModalOptions:
    limit_mm_per_prompt: dict[str, int] = field(default_factory=dict)
    allowed_local_media_path: str = ""  # file:// URLs only below this directory; "" = none
    allowed_media_domains: tuple[str, ...] = ()  # http(s) hosts allowed; () = any
    mm_processor_kwargs: dict[str, Any] = field(default_factory=dict)
    media_fetch_timeout: float = field(default_factory=_default_timeout)  # seconds, whole fetch
    media_max_bytes: int = DEFAULT_MEDIA_MAX_BYTES  # an encoded image's bytes, any source
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS  # width * height before decoding

    def image_limit(self) -> int:
        return self.limit_mm_per_prompt.get("image", DEFAULT_LIMIT_PER_PROMPT)

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> MultiModalOptions:
        """From the LLM()'s keyword arguments or the parsed flags (the keys of MM_OPTION_NAMES
        that are present and not None); ValueError for a bad value."""
        d = cls()
        get = {k: v for k, v in kwargs.items() if k in MM_OPTION_NAMES and v is not None}
        limits = parse_limit_mm(get.get("limit_mm_per_prompt", {}))
        domains = get.get("allowed_media_domains", ())
        if isinstance(domains, str):
            domains = (domains,)
        opts = cls(
            limit_mm_per_prompt=limits,
            allowed_local_media_path=str(get.get("allowed_local_media_path", "")),
            allowed_media_domains=tuple(str(x).lower() for x in domains),
            mm_processor_kwargs=parse_json_dict(get.get("mm_processor_kwargs", {}),
                                                "mm_processor_kwargs"),
            media_fetch_timeout=float(get.get("media_fetch_timeout", d.media_fetch_timeout)),
            media_max_bytes=int(get.get("media_max_bytes", d.media_max_bytes)),
            max_image_pixels=int(get.get("max_image_pixels", d.max_image_pixels)),
        )
        if opts.media_fetch_timeout <= 0 or opts.media_max_bytes <= 0 or \
                opts.max_image_pixels <= 0:
            raise ValueError("media_fetch_timeout, media_max_bytes and max_image_pixels must "
                             "be positive")
        path = opts.allowed_local_media_path
        if path and not os.path.isdir(path):
            raise ValueError(f"allowed_local_media_path {path!r} is not a directory")
        return opts


MM_OPTION_NAMES = frozenset({
    "limit_mm_per_prompt", "allowed_local_media_path", "allowed_media_domains",
    "mm_processor_kwargs", "media_fetch_timeout", "media_max_bytes", "max_image_pixels",
})


def parse_json_dict(value: str | dict[str, Any], name: str) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except ValueError as e:
            raise ValueError(f"{name}: not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object")
    return dict(value)


def parse_limit_mm(value: str | dict[str, Any]) -> dict[str, int]:
    """vLLM's ``{"image": 4}`` (JSON text or a dict) as a checked dict."""
    limits = parse_json_dict(value, "limit_mm_per_prompt")
    out: dict[str, int] = {}
    for k, v in limits.items():
        if isinstance(v, dict):  # vLLM's newer form: {"image": {"count": 4, ...}}
            v = v.get("count")
        if k not in MODALITIES:
            raise ValueError(f"limit_mm_per_prompt: unsupported modality {k!r}; supported: "
                             f"{', '.join(sorted(MODALITIES))}")
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"limit_mm_per_prompt[{k!r}] must be an integer >= 0")
        out[k] = v
    return out
