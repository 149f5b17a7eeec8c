"""Rank-to-rank messages of the KV connector: a decode rank asks a prefill rank's block server
who it is (``PeerHello`` -> ``PeerInfo``: its KV layout and how its memory can be read) and for
blocks under a lease (``PeerRead`` -> ``PeerReply``, followed by the bytes when the TCP pull
carries them). Shared memory and NIXL read the prefill rank's memory directly; they still ask
(``PEER_CHECK``) before and after, so no block is used after its lease ended.

Framed like every other message (protocol.codec: magic, version, msgpack), over a ZeroMQ
ROUTER (prefill rank) / DEALER (decode rank) pair; tcp:// off loopback is CURVE-authenticated
under TANDEM_SECRET.
"""

from __future__ import annotations

import msgspec

from protocol.codec import Decoder

# PeerRead.mode
PEER_DATA = 0  # send the blocks' bytes (the TCP pull)
PEER_CHECK = 1  # only say whether the lease still holds them

# PeerReply.status
PEER_OK = 0
PEER_NOT_YET = 1  # no such lease yet: the prefill engine's step that exposes it is under way
PEER_GONE = 2  # the lease ended (released or expired): the blocks may hold other KV now
PEER_ERROR = 3
PEER_REFUSED = 4  # blocks the named lease does not hold: never served, whatever the key


class PeerHello(msgspec.Struct, array_like=True, tag=41, kw_only=True):
    engine_id: str  # the engine the asker expects ("" = any)


class PeerInfo(msgspec.Struct, array_like=True, tag=42, kw_only=True):
    """A prefill rank's identity and KV layout: ``num_caches`` tensors of
    ``[num_blocks, block_size, kv_heads, head_dim]``, this rank holding global KV heads
    ``[rank * kv_heads, (rank + 1) * kv_heads)`` of ``total_kv_heads`` (padding past it)."""

    engine_id: str
    rank: int
    tp_size: int
    hostname: str
    boot_id: str  # with hostname: the same machine (shared memory works)
    pid: int
    device: str  # cpu | cuda:N
    dtype: str
    num_caches: int
    num_blocks: int
    block_size: int
    kv_heads: int
    total_kv_heads: int
    head_dim: int
    shm_fd: int = -1  # a memfd holding every cache back to back (CPU), or -1
    nixl_metadata: bytes = b""  # the rank's NIXL agent, when it has one
    cache_addrs: list[int] = []  # each cache tensor's base address (NIXL descriptors)
    error: str = ""


class PeerRead(msgspec.Struct, array_like=True, tag=43, kw_only=True):
    seq: int  # echoed in the reply
    key: str  # the lease
    block_ids: bytes  # packed: the prefill rank's blocks
    head_start: int = 0  # PEER_DATA: this rank's heads [head_start, head_end) of each block
    head_end: int = 0
    mode: int = PEER_DATA


class PeerReply(msgspec.Struct, array_like=True, tag=44, kw_only=True):
    seq: int
    status: int
    error: str = ""
    nbytes: int = 0  # PEER_DATA and PEER_OK: the size of the frame that follows


PeerMessage = PeerHello | PeerInfo | PeerRead | PeerReply


def peer_decoder() -> Decoder[PeerMessage]:
    return Decoder(PeerMessage, 1 << 20)
