"""NIXL (the ``nixl-cu12`` wheel, UCX backend): the production path between machines. Each rank
registers its KV cache tensors with a NIXL agent (host memory on CPU, device memory on GPU);
a decode rank loads the prefill rank's agent metadata from the block server's PeerInfo and
READs the blocks one-sidedly, straight into its own blocks. With equal head slices one
descriptor covers a block of one cache; a head slice of a block is one descriptor per token
slot. The lease is checked with the block server before and after, as for shared memory.

NIXL is optional: ``nixl_available()`` says whether it imports (the wheel's module is
``nixl_cu12``; a ``nixl`` package that wraps it is taken too).
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import time
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from protocol.kv_peer import PeerInfo
from workers.kv_connector.layout import HeadSlice
from workers.kv_connector.peer import Cancelled, Peer, PeerError
from workers.kv_connector.runs import runs
from workers.kv_connector.transports import Cancel, Transport, await_lease


@functools.cache
def _api() -> Any:
    for name in ("nixl_cu12._api", "nixl._api"):
        try:
            api = importlib.import_module(name)
        except ImportError:
            continue
        if not os.environ.get("NIXL_LOG_LEVEL"):  # its INFO lines go to stdout
            logging.getLogger("nixl").setLevel(logging.WARNING)
        return api
    return None


def nixl_available() -> bool:
    return _api() is not None


PROGRESS_S = 0.0002  # a waiting reader's pause between progress calls


def _mem(t: torch.Tensor) -> str:
    return "VRAM" if t.is_cuda else "DRAM"


class NixlAgent:
    """One rank's agent with its caches registered.

    Without NIXL's progress thread: it polls without pause, which on a machine of few cores
    takes one from the ranks' forward passes. Progress is driven instead by whoever waits on
    it: a decode rank while its read is in flight, a prefill rank's block server (``progress``)
    for a while after a decode rank asked about a lease (it reads right after)."""

    def __init__(self, name: str, caches: Sequence[torch.Tensor]) -> None:
        api = _api()
        if api is None:
            raise RuntimeError("NIXL is not installed (pip install nixl-cu12)")
        self.agent = api.nixl_agent(
            name, api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self.caches = list(caches)
        self.reg = self.agent.register_memory(self.agent.get_reg_descs(self.caches))

    @property
    def metadata(self) -> bytes:
        return bytes(self.agent.get_agent_metadata())

    def progress(self) -> None:
        self.agent.get_new_notifs()  # drives the backend's progress

    def close(self) -> None:
        try:
            self.agent.deregister_memory(self.reg)
        except Exception:  # noqa: BLE001 - best effort at exit
            pass


def descriptors(base: int, block_ids: Sequence[int], block_bytes: int, token_bytes: int,
                head_bytes: int, head_start: int, num_heads: int, whole: bool,
                block_size: int, lengths: Sequence[int] | None = None) -> np.ndarray:
    """(address, length) rows for heads [head_start, head_start + num_heads) of these blocks
    of one cache. ``whole`` (both sides move whole blocks): one row per run of ``lengths``
    consecutive blocks starting at each id; else one per token slot (the two lists must pair
    up row for row)."""
    ids = np.asarray(block_ids, dtype=np.int64)
    if whole:
        n = np.asarray(lengths if lengths is not None else [1] * len(ids), dtype=np.int64)
        addrs = base + ids * block_bytes
        return np.stack([addrs, n * block_bytes], 1)
    slots = np.arange(block_size, dtype=np.int64) * token_bytes
    addrs = (base + ids[:, None] * block_bytes + slots[None, :]
             + head_start * head_bytes).reshape(-1)
    return np.stack([addrs, np.full_like(addrs, num_heads * head_bytes)], 1)


class NixlTransport(Transport):
    name = "nixl"

    def __init__(self, caches: Sequence[torch.Tensor]) -> None:
        self.local = NixlAgent(f"tandem-d-{os.getpid()}-{uuid.uuid4().hex[:8]}", caches)
        self._remote: dict[str, str] = {}  # peer address -> remote agent name

    def pull(self, peer: Peer, info: PeerInfo, key: str, remote_ids: list[int],
             local_ids: list[int], sl: HeadSlice, caches: Sequence[torch.Tensor],
             cancelled: Cancel) -> int:
        if not info.nixl_metadata or len(info.cache_addrs) != len(caches):
            raise PeerError(f"prefill rank {info.rank} has no NIXL agent")
        await_lease(peer, key, remote_ids, cancelled)
        agent = self.local.agent
        name = self._remote.get(peer.addr)
        if name is None:
            name = agent.add_remote_agent(info.nixl_metadata)
            self._remote[peer.addr] = name
        c0 = caches[0]
        esz = c0.element_size()
        hd, bs = info.head_dim, info.block_size
        r_head, l_head = hd * esz, hd * esz
        r_tok, l_tok = info.kv_heads * r_head, c0.shape[2] * l_head
        r_blk, l_blk = bs * r_tok, bs * l_tok
        nh = sl.num_heads
        whole = nh == info.kv_heads == c0.shape[2]
        src, dst, lengths = remote_ids, local_ids, None
        if whole:  # one descriptor per run of consecutive blocks on both sides
            rs = runs(remote_ids, local_ids)
            src, dst, lengths = [r[0] for r in rs], [r[1] for r in rs], [r[2] for r in rs]
        rem, loc = [], []
        for addr, c in zip(info.cache_addrs, caches, strict=True):
            rem.append(descriptors(addr, src, r_blk, r_tok, r_head, sl.remote_start, nh,
                                   whole, bs, lengths))
            loc.append(descriptors(c.data_ptr(), dst, l_blk, l_tok, l_head,
                                   sl.local_start, nh, whole, bs, lengths))
        r = np.concatenate(rem)
        lo = np.concatenate(loc)
        r_dev = 0 if info.device == "cpu" else int(info.device.split(":")[-1] or 0)
        l_dev = c0.device.index or 0
        r3 = np.concatenate([r, np.full((len(r), 1), r_dev, np.int64)], 1)
        l3 = np.concatenate([lo, np.full((len(lo), 1), l_dev, np.int64)], 1)
        handle = agent.initialize_xfer(
            "READ", agent.get_xfer_descs(l3, _mem(c0)),
            agent.get_xfer_descs(r3, "DRAM" if info.device == "cpu" else "VRAM"), name)
        try:
            state = agent.transfer(handle)
            while state == "PROC":  # checking drives the transfer's progress
                if cancelled():
                    raise Cancelled("cancelled")
                time.sleep(PROGRESS_S)
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise PeerError(f"NIXL read from prefill rank {info.rank} failed ({state})")
        finally:
            try:
                agent.release_xfer_handle(handle)
            except Exception:  # noqa: BLE001 - a cancelled read may still be in flight
                pass
        await_lease(peer, key, remote_ids, cancelled)
        return int(lo[:, 1].sum())

    def forget(self, peer: Peer) -> None:
        name = self._remote.pop(peer.addr, None)
        if name is not None:
            try:
                self.local.agent.remove_remote_agent(name)
            except Exception:  # noqa: BLE001
                pass

    def close(self) -> None:
        self.local.close()
