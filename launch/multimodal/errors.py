"""ImageError, apart from the modules that need Pillow: the server imports it on every start,
and a text-only install has no Pillow."""

from __future__ import annotations

__all__ = ["ImageError"]


class ImageError(ValueError):
    """An image that cannot be used, with a reason a client may read."""
