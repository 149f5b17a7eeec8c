"""A decoder for KV cache event batches written from the wire format (vLLM's, as vllm-router
reads it), not from the publisher's code: every frame and every field is checked, and a
batch that a router would drop (an unknown key, a missing one, a wrong type) fails here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

U64 = (1 << 64) - 1
_KEYS = {
    "BlockStored": {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
                    "lora_id", "medium", "lora_name"},
    "BlockRemoved": {"type", "block_hashes", "medium"},
    "AllBlocksCleared": {"type"},
}


@dataclass
class Batch:
    topic: bytes
    seq: int
    ts: float
    events: list[dict[str, Any]]


def _hash(v: Any, what: str) -> int:
    assert isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= U64, f"{what}: {v!r}"
    return v


def check_event(e: Any) -> dict[str, Any]:
    assert isinstance(e, dict), f"an event is a map, got {type(e).__name__}"
    kind = e.get("type")
    assert kind in _KEYS, f"unknown event type {kind!r}"
    assert set(e) == _KEYS[kind], f"{kind} keys {sorted(e)} != {sorted(_KEYS[kind])}"
    if kind == "AllBlocksCleared":
        return e
    hashes = e["block_hashes"]
    assert isinstance(hashes, list) and hashes, "block_hashes: a non-empty list"
    for h in hashes:
        _hash(h, "block_hashes")
    assert e["medium"] is None or isinstance(e["medium"], str)
    if kind == "BlockStored":
        if e["parent_block_hash"] is not None:
            _hash(e["parent_block_hash"], "parent_block_hash")
        bs = e["block_size"]
        assert isinstance(bs, int) and bs > 0
        toks = e["token_ids"]
        assert isinstance(toks, list) and all(isinstance(t, int) and t >= 0 for t in toks)
        assert len(toks) == bs * len(hashes), "token_ids: block_size tokens per block"
        assert e["lora_id"] is None or isinstance(e["lora_id"], int)
        assert e["lora_name"] is None or isinstance(e["lora_name"], str)
    return e


def decode_batch(frames: list[bytes]) -> Batch:
    """Three frames: topic, 8-byte big-endian sequence number, msgpack [ts, events, rank?]."""
    assert len(frames) == 3, f"a batch is 3 frames, got {len(frames)}"
    topic, seq, payload = frames
    assert len(seq) == 8, f"sequence number: 8 bytes, got {len(seq)}"
    body = msgspec.msgpack.decode(payload)  # untyped: whatever the bytes say
    assert isinstance(body, list) and len(body) in (2, 3), f"payload: [ts, events, rank?]: {body}"
    ts, events = body[0], body[1]
    assert isinstance(ts, float), f"ts: a float, got {ts!r}"
    if len(body) == 3:
        assert body[2] is None or isinstance(body[2], int)
    assert isinstance(events, list)
    return Batch(topic, int.from_bytes(seq, "big"), ts, [check_event(e) for e in events])
