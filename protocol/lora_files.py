"""What names an adapter's content on the wire: sha256 over adapter_config.json's bytes, then
adapter_model.safetensors' bytes, as a hex digest.

Torch-free and standard-library only, and here in protocol/ because both sides compute it: the
engine core when it registers an adapter (it travels in PrepareLoRA and every LoRASlotOp, and
it enters the prefix-cache block hashes), every rank again over the bytes it actually reads, so
a rank that reads the files later (its host copy was dropped) can tell whether they are still
the ones the core registered.
"""

from __future__ import annotations

import hashlib
import os

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
# what a PEFT adapter directory must hold, in the order the content hash reads them
ADAPTER_FILES = (CONFIG_NAME, WEIGHTS_NAME)
_CHUNK = 1 << 20


def missing_file(path: str) -> str | None:
    """The first file of ``ADAPTER_FILES`` missing from ``path`` (its full path), or None."""
    for name in ADAPTER_FILES:
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            return full
    return None


def content_hash_of(config_bytes: bytes, weights_bytes: bytes) -> str:
    """The digest of an adapter whose two files were read into memory."""
    h = hashlib.sha256()
    h.update(config_bytes)
    h.update(weights_bytes)
    return h.hexdigest()


def content_hash(path: str) -> str:
    """The digest of the PEFT directory ``path``, streamed (the weights are never held whole;
    hashlib releases the GIL on large updates, so the engine core's loop runs beside it).

    Raises FileNotFoundError naming the missing file (an OSError when one cannot be read);
    equal to ``content_hash_of`` over the same bytes."""
    h = hashlib.sha256()
    for name in ADAPTER_FILES:
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise FileNotFoundError(f"LoRA adapter {path!r} has no {name}")
        with open(file, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
    return h.hexdigest()
