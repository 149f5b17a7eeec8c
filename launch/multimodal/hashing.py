"""``mm_hash``: the name of a processed image's content.

sha256 over the processor settings, the pixel array's shape and its bytes: equal images
processed with equal settings get equal hashes (so the encoder output cached for one serves the
other), and any pixel, shape or setting that differs gives another hash. Every field is framed
by its length, so no two different inputs can concatenate to the same bytes.
"""

from __future__ import annotations

import hashlib

import msgspec
import numpy as np

from protocol.multimodal import ImageSettings

__all__ = ["mm_hash"]


def mm_hash(pixels: np.ndarray, settings: ImageSettings) -> str:
    """Hex sha256 of (settings, shape, dtype, bytes) of a processed uint8 image."""
    h = hashlib.sha256(b"tandem-image-v1")
    for part in (msgspec.msgpack.encode(settings),
                 msgspec.msgpack.encode([list(pixels.shape), str(pixels.dtype)])):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    data = np.ascontiguousarray(pixels).data
    h.update(data.nbytes.to_bytes(8, "little"))
    h.update(data)
    return h.hexdigest()
