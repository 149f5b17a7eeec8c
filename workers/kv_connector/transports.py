"""The ways a decode rank pulls KV blocks from a prefill rank, behind one interface
(``Transport.pull``): the TCP pull over ZeroMQ (works anywhere the block server is reachable),
same-host shared memory (CPU), and NIXL (nixl.py: UCX, host or device memory).

Every pull moves heads ``HeadSlice`` of ``remote_ids`` (the prefill rank's blocks) into the
same heads-slot of ``local_ids`` in this rank's caches, for every cache tensor (K and V of
every layer). It raises PeerError (or Cancelled) when it cannot finish; the blocks then hold
partial KV, which the scheduler never registers in the prefix cache.
"""

from __future__ import annotations

import time
import warnings
from collections import deque
from collections.abc import Callable, Sequence

import torch

from protocol.codec import pack
from protocol.kv_peer import (
    PEER_CHECK,
    PEER_DATA,
    PEER_ERROR,
    PEER_NOT_YET,
    PEER_OK,
    PeerInfo,
    PeerRead,
    PeerReply,
)
from workers.kv_connector.layout import HeadSlice
from workers.kv_connector.peer import LeaseRefused, Peer, PeerError, wait_briefly
from workers.kv_connector.runs import copy_blocks
from workers.kv_connector.shm import RemoteCaches

Cancel = Callable[[], bool]
CHUNK_BYTES = 8 << 20  # TCP: bytes per message (several in flight)
WINDOW = 4  # TCP: chunk requests in flight
NOT_YET_WAIT_S = 0.002
# a lease the prefill rank still does not know after this long is refused: its exposing step
# follows the prefill's last one at once, so by then the key is wrong (guessed, made up) or
# from another engine; waiting out kv_transfer_timeout_s would only hold the blocks longer
NOT_YET_LIMIT_S = 5.0


def refusal(peer: Peer, reply: PeerReply) -> PeerError:
    """The error for a reply other than PEER_OK: a refusal of the lease, or another failure."""
    if reply.status == PEER_ERROR:
        return PeerError(f"{peer.addr}: {reply.error or 'failed'}")
    return LeaseRefused(f"{peer.addr}: lease refused ({reply.error or 'no such lease'})")


def await_lease(peer: Peer, key: str, remote_ids: list[int], cancelled: Cancel) -> None:
    """Until the prefill rank serves ``key`` (its exposing step may still be under way), at most
    NOT_YET_LIMIT_S."""
    give_up = time.monotonic() + NOT_YET_LIMIT_S
    while True:
        seq = peer.next_seq()
        peer.send(PeerRead(seq=seq, key=key, block_ids=pack(remote_ids), mode=PEER_CHECK))
        reply, _ = peer.reply(seq, cancelled)
        if reply.status == PEER_OK:
            return
        if reply.status != PEER_NOT_YET or time.monotonic() >= give_up:
            raise refusal(peer, reply)
        wait_briefly(cancelled, NOT_YET_WAIT_S)


def scatter(cache: torch.Tensor, local_ids: list[int], local_start: int,
            data: torch.Tensor) -> None:
    """data ``[n, block_size, heads, head_dim]`` into those heads of those blocks."""
    nh = data.shape[2]
    if data.device != cache.device:
        data = data.to(cache.device)
    copy_blocks(cache[:, :, local_start:local_start + nh], data, range(len(local_ids)),
                local_ids)


class ShmUnavailable(PeerError):
    """The prefill rank's memory cannot be mapped from here (another user's process, a
    restricted /proc): with "auto" the puller falls back to the TCP pull."""


class Transport:
    name = ""

    def pull(self, peer: Peer, info: PeerInfo, key: str, remote_ids: list[int],
             local_ids: list[int], sl: HeadSlice, caches: Sequence[torch.Tensor],
             cancelled: Cancel) -> int:
        """Move the blocks; returns the bytes moved."""
        raise NotImplementedError

    def forget(self, peer: Peer) -> None:
        """The peer's connection is closed: drop what was kept for it."""

    def close(self) -> None:
        pass


class TcpTransport(Transport):
    """The block server sends a chunk as one frame per cache (straight from its memory when
    the chunk's blocks are consecutive and every head goes; else gathered first); this rank
    copies each frame into its blocks. Chunks are pipelined (WINDOW in flight)."""

    name = "tcp"

    def pull(self, peer: Peer, info: PeerInfo, key: str, remote_ids: list[int],
             local_ids: list[int], sl: HeadSlice, caches: Sequence[torch.Tensor],
             cancelled: Cancel) -> int:
        await_lease(peer, key, remote_ids, cancelled)
        c0 = caches[0]
        nh = sl.num_heads
        shape_tail = (c0.shape[1], nh, c0.shape[3])
        per_block = len(caches) * c0.shape[1] * nh * c0.shape[3] * c0.element_size()
        chunk = max(1, CHUNK_BYTES // per_block)
        n = len(remote_ids)
        pending: deque[tuple[int, int, int]] = deque()
        i = total = 0
        while i < n or pending:
            while i < n and len(pending) < WINDOW:
                j = min(n, i + chunk)
                seq = peer.next_seq()
                peer.send(PeerRead(seq=seq, key=key, block_ids=pack(remote_ids[i:j]),
                                   head_start=sl.remote_start, head_end=sl.remote_end,
                                   mode=PEER_DATA))
                pending.append((seq, i, j))
                i = j
            seq, a, b = pending.popleft()
            reply, frames = peer.reply(seq, cancelled)
            if reply.status != PEER_OK:
                raise refusal(peer, reply)
            if len(frames) != len(caches):
                raise PeerError(f"{peer.addr} sent {len(frames)} frames for {len(caches)} caches")
            size = (b - a) * per_block // len(caches)
            for cache, frame in zip(caches, frames, strict=True):
                buf = frame.buffer
                if len(buf) != size:
                    raise PeerError(f"{peer.addr} sent {len(buf)} bytes, expected {size}")
                data = torch.frombuffer(buf, dtype=c0.dtype).view(b - a, *shape_tail)
                scatter(cache, local_ids[a:b], sl.local_start, data)
            total += (b - a) * per_block
        return total


class ShmTransport(Transport):
    """Map the prefill rank's memfd (same machine, CPU) and copy from it directly; the lease
    is checked before and after the copy."""

    name = "shm"

    def __init__(self) -> None:
        self._maps: dict[str, RemoteCaches] = {}

    @staticmethod
    def usable(info: PeerInfo, hostname: str, boot_id: str, device: torch.device) -> bool:
        return (info.shm_fd >= 0 and info.hostname == hostname and info.boot_id == boot_id
                and device.type == "cpu" and info.device == "cpu")

    def pull(self, peer: Peer, info: PeerInfo, key: str, remote_ids: list[int],
             local_ids: list[int], sl: HeadSlice, caches: Sequence[torch.Tensor],
             cancelled: Cancel) -> int:
        await_lease(peer, key, remote_ids, cancelled)
        rc = self._maps.get(peer.addr)
        if rc is None:
            c0 = caches[0]
            shape = (info.num_blocks, info.block_size, info.kv_heads, info.head_dim)
            try:
                with warnings.catch_warnings():  # read-only memory: never written through
                    warnings.simplefilter("ignore", UserWarning)
                    rc = RemoteCaches(info.pid, info.shm_fd, info.num_caches, shape, c0.dtype)
            except OSError as e:
                raise ShmUnavailable(f"cannot map the memory of prefill rank {info.rank} "
                                     f"(pid {info.pid}): {e}") from None
            self._maps[peer.addr] = rc
        r0, r1, l0 = sl.remote_start, sl.remote_end, sl.local_start
        total = 0
        for c, r in zip(caches, rc.tensors, strict=True):
            copy_blocks(c[:, :, l0:l0 + (r1 - r0)], r[:, :, r0:r1], remote_ids, local_ids)
            total += len(remote_ids) * r[0, :, r0:r1].numel() * r.element_size()
        # the lease must still hold: else the prefill engine may have reused a block mid-copy
        await_lease(peer, key, remote_ids, cancelled)
        return total

    def forget(self, peer: Peer) -> None:
        rc = self._maps.pop(peer.addr, None)
        if rc is not None:
            rc.close()

    def close(self) -> None:
        for rc in self._maps.values():
            rc.close()
        self._maps.clear()
