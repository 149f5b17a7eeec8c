"""The identity of an adapter's content: sha256 over adapter_config.json's bytes, then
adapter_model.safetensors' bytes, as a hex digest.

Torch-free and standard-library only: the engine core computes it when it registers an
adapter (and sends it with PrepareLoRA and every LoRASlotOp), every rank computes it again
over the bytes it actually reads, so a rank that reads the files later (its host copy was
dropped) can tell whether they are still the ones the core registered.
"""

from __future__ import annotations

import hashlib
import os

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
_CHUNK = 1 << 20


def content_hash_of(config_bytes: bytes, weights_bytes: bytes) -> str:
    """The digest of an adapter whose two files were read into memory."""
    h = hashlib.sha256()
    h.update(config_bytes)
    h.update(weights_bytes)
    return h.hexdigest()


def content_hash(path: str) -> str:
    """The digest of the PEFT directory ``path``, streamed (the weights are never held whole).

    Raises FileNotFoundError naming the missing file; equal to ``content_hash_of`` over the
    same bytes."""
    h = hashlib.sha256()
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise FileNotFoundError(f"LoRA adapter {path!r} has no {name}")
        with open(file, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
    return h.hexdigest()
