"""Prefix-cache block hashes: a chain over full blocks, hash(parent, block tokens, extra keys).

Chaining makes a block's hash name its whole prefix, so one dict lookup per block finds the
longest cached prefix. ``cache_salt`` goes into the first block's extra keys, so requests with
different salts never share anything. A LoRA adapter's identity (its name and content hash)
joins the salt there, so a base-model prompt never hits an adapter's blocks, two adapters never
share blocks, and a name reloaded with new weights never finds the old weights' KV; a
base-model request's keys are the same with and without LoRA enabled. A block that overlaps an
image's placeholder span adds (mm_hash, the block's start relative to the span) per image, so
the same text with different images never shares a block, while the same image at the same
place does; a text-only block's keys are unchanged. "sha256" is collision
safe (the default: a collision would silently serve another prompt's KV); "fast" uses Python's
64-bit tuple hash.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from engine_core.request import BlockHash, Request
from protocol.multimodal import MMItem

HashFn = Callable[[Any, Sequence[int], Any], BlockHash]

_encode = msgspec.msgpack.Encoder().encode


def sha256_block_hash(parent: bytes | None, tokens: Sequence[int], extra: Any) -> bytes:
    # msgpack gives an unambiguous byte string for (parent, tokens, extra) and is fast
    return hashlib.sha256(_encode((parent, tokens, extra))).digest()


def fast_block_hash(parent: int | None, tokens: Sequence[int], extra: Any) -> int:
    return hash((parent, tuple(tokens), extra))


HASH_FUNCTIONS: dict[str, HashFn] = {"sha256": sha256_block_hash, "fast": fast_block_hash}


def get_hash_fn(name: str) -> HashFn:
    try:
        return HASH_FUNCTIONS[name]
    except KeyError:
        raise ValueError(f"unknown prefix_hash {name!r} (expected 'sha256' or 'fast')") from None


def first_block_extra(
    cache_salt: str | None, lora_name: str | None = None, lora_hash: str = ""
) -> tuple[str | None, ...] | None:
    """The extra keys of a request's first block: None for a plain base-model request,
    (salt,) with a cache salt, (salt, adapter name, adapter content hash) with an adapter.
    The three shapes differ in length, so no two of them can be equal."""
    if lora_name is not None:
        return (cache_salt, lora_name, lora_hash)
    return None if cache_salt is None else (cache_salt,)


def mm_block_extra(items: Sequence[MMItem], start: int, end: int) -> tuple[Any, ...]:
    """(mm_hash, start - offset) of each image whose span overlaps tokens [start, end)."""
    keys = []
    for item in items:
        ph = item.placeholder
        if ph.offset < end and start < ph.offset + ph.length:
            keys.append((ph.mm_hash, start - ph.offset))
        elif ph.offset >= end:
            break  # items are in prompt order
    return tuple(keys)


def hash_request_tokens(
    hash_fn: HashFn,
    block_size: int,
    tokens: Sequence[int],
    cache_salt: str | None = None,
    lora_name: str | None = None,
    lora_hash: str = "",
    mm_items: Sequence[MMItem] = (),
) -> list[BlockHash]:
    """Hashes of every full block of ``tokens`` (a reference implementation for tests)."""
    out: list[BlockHash] = []
    parent = None
    first = first_block_extra(cache_salt, lora_name, lora_hash)
    for i in range(len(tokens) // block_size):
        extra: Any = first if i == 0 else None
        mm = mm_block_extra(mm_items, i * block_size, (i + 1) * block_size)
        if mm:
            extra = (extra, mm)
        parent = hash_fn(parent, tokens[i * block_size : (i + 1) * block_size], extra)
        out.append(parent)
    return out


class BlockHasher:
    """Extends ``request.block_hashes`` to cover every full block of its tokens.

    Called when a request is added and whenever an appended token fills a block, so hashing
    cost is paid once per block, never per step.
    """

    def __init__(self, block_size: int, hash_fn: HashFn) -> None:
        self.block_size = block_size
        self.hash_fn = hash_fn

    def __call__(self, request: Request) -> None:
        bs = self.block_size
        hashes = request.block_hashes
        tokens = request.all_token_ids
        i = len(hashes)
        parent = hashes[-1] if hashes else None
        hash_fn = self.hash_fn
        extra: Any
        while (i + 1) * bs <= request.num_tokens:
            if i == 0:
                lora = request.lora
                extra = first_block_extra(
                    request.cache_salt, None if lora is None else lora.lora_name,
                    request.lora_hash,
                )
            else:
                extra = None
            if i * bs < request.mm_end:
                mm = mm_block_extra(request.mm_items, i * bs, (i + 1) * bs)
                if mm:
                    extra = (extra, mm)
            parent = hash_fn(parent, tokens[i * bs : (i + 1) * bs], extra)
            hashes.append(parent)
            i += 1
