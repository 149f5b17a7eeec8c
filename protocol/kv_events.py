"""KV cache events, vLLM's format: what enters and leaves an engine's prefix cache, published
over ZeroMQ so a router (vllm-router's kv_aware policy) can keep an index of which engine holds
which prefix.

``KVEventsConfig`` is the engine option (``--kv-events-config``, vLLM's JSON keys). On the wire
every batch is three frames on a PUB socket: the topic, an 8-byte big-endian sequence number
(0, 1, 2, ... per publisher) and a msgpack payload ``[ts, events]``; each event is a msgpack map
named by its ``"type"``: ``BlockStored`` (block_hashes, parent_block_hash, token_ids,
block_size, lora_id, medium, lora_name: vllm-router refuses a BlockStored without it, even
null), ``BlockRemoved`` (block_hashes, medium), ``AllBlocksCleared``.
Hashes are unsigned 64-bit ints; the router hashes each block's token ids itself and links
blocks by ``parent_block_hash``. A ROUTER socket on ``replay_endpoint`` answers a subscriber
that missed batches: it sends ``[start_seq]`` and gets every buffered batch from there on as
``[seq, payload]``, then ``[END_SEQ, b""]``.

What vllm-router 0.1.17 needs beyond the events (found by experiment, tests/serve/test_router.py):
it gets a text prompt's tokens from the server's ``/v1/completions/render`` and reads the
``token_ids`` key (``prompt_token_ids`` alone leaves the request unscored); it credits no prefix
to a request whose body carries a field it does not know, ``return_token_ids`` included, and none
to a request with a ``cache_salt``.
"""

from __future__ import annotations

from typing import Any

import msgspec

from protocol.config_forms import config_from

SEQ_BYTES = 8
END_SEQ = (-1).to_bytes(SEQ_BYTES, "big", signed=True)  # the end of a replay
MEDIUM = "GPU"  # the engine's own KV cache (vLLM's name for the device tier)


class KVEventsConfig(msgspec.Struct, kw_only=True):
    """``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
    "endpoint": "tcp://127.0.0.1:5557"}'``; vLLM's other keys are ignored."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"  # "zmq" publishes; "null" collects nothing
    # the PUB socket binds this exact address: the router's SUB socket connects to it
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None  # ROUTER socket for replays; None = no replay
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's send high-water mark
    # batches waiting for the publisher thread; past it the oldest is dropped (and counted)
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def active(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


def kv_events_config_error(c: KVEventsConfig) -> str | None:
    if c.publisher not in ("zmq", "null"):
        return f"kv_events_config.publisher must be zmq or null, got {c.publisher!r}"
    for name in ("endpoint", "replay_endpoint"):
        value = getattr(c, name)
        if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
            return f"kv_events_config.{name} must be a tcp://, ipc:// or inproc:// address"
    if c.buffer_steps < 1 or c.hwm < 0 or c.max_queue_size < 1:
        return "kv_events_config.buffer_steps and max_queue_size must be >= 1, hwm >= 0"
    return None


def parse_kv_events_config(value: str | dict[str, Any] | KVEventsConfig,
                           name: str = "--kv-events-config") -> KVEventsConfig:
    """The config in any of its forms (the flag's JSON string, vLLM's dict, the struct);
    ValueError naming the bad key."""
    return config_from(value, KVEventsConfig, name, kv_events_config_error)


def external_hash(block_hash: Any) -> int:
    """A prefix-cache hash as the unsigned 64-bit int the wire carries (sha256: its last 8
    bytes, as vLLM shortens them; "fast": Python's hash, made unsigned)."""
    if isinstance(block_hash, bytes):
        return int.from_bytes(block_hash[-8:], "big")
    return int(block_hash) & 0xFFFF_FFFF_FFFF_FFFF


def block_stored(hashes: list[int], parent: int | None, token_ids: list[int], block_size: int,
                 lora_id: int | None) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": token_ids, "block_size": block_size, "lora_id": lora_id,
            "medium": MEDIUM, "lora_name": None}


def block_removed(hashes: list[int]) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": MEDIUM}


ALL_BLOCKS_CLEARED: dict[str, Any] = {"type": "AllBlocksCleared"}
