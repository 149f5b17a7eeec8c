"""An adapter directory as the engine core sees it: the two files every rank will read, and the
content hash that names what is in them (the prefix cache keys an adapter's KV by it)."""

from __future__ import annotations

import hashlib
import os

# what a PEFT adapter directory must hold, in the order the content hash reads them
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")

_CHUNK = 1 << 20


def missing_file(path: str) -> str | None:
    """The first file of ``ADAPTER_FILES`` missing from ``path`` (its full path), or None."""
    for name in ADAPTER_FILES:
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            return full
    return None


def content_hash(path: str) -> str:
    """sha256 (hex) over the bytes of adapter_config.json, then adapter_model.safetensors.
    Raises OSError when a file cannot be read."""
    h = hashlib.sha256()
    for name in ADAPTER_FILES:
        with open(os.path.join(path, name), "rb") as f:
            while chunk := f.read(_CHUNK):
                # hashlib releases the GIL on large updates: the core's loop runs beside it
                h.update(chunk)
    return h.hexdigest()
