"""The prefill side's leases: a finished prefill's blocks, kept for the decode engine to read.

A lease holds the request's block table under its own key (the request id may be used again
at once), so the blocks can be neither reused nor evicted. It ends when the decode engine says
it is done (or gave up), or when ``kv_lease_s`` passes without a renewal; either way the
blocks are freed (they stay in the prefix cache, evictable) and the ranks stop serving them.

A lease key is a capability: whoever presents it may read the lease's blocks and end the
lease. So it is 128 random bits (``secrets``), never derived from the request id or a
counter another client could see or guess.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass

from engine_core.kv_cache.manager import KVCacheManager
from engine_core.kv_connector.stats import ConnectorStats
from protocol.codec import pack
from protocol.kv_connector import KVExposeOp

logger = logging.getLogger("tandem.kv_connector")

# bytes of randomness in a lease key (128 bits; the key is their URL-safe base64, 22 chars)
KEY_BYTES = 16


def held_key(kind: str, name: str) -> tuple[str, str]:
    """The block manager's key for a table an internal holder keeps: a tuple, which no request
    id (a str) can equal, so no client's request id can reach or collide with it."""
    return (kind, name)


@dataclass
class Lease:
    key: str
    deadline: float
    block_ids: list[int]


class LeaseTable:
    def __init__(self, kvm: KVCacheManager, lease_s: float, stats: ConnectorStats,
                 clock: Callable[[], float]) -> None:
        self.kvm = kvm
        self.lease_s = lease_s
        self.stats = stats
        self.clock = clock
        self.leases: dict[str, Lease] = {}
        self.expose: list[KVExposeOp] = []  # this step's new leases, for the ranks
        self.unexpose: list[str] = []  # this step's ended leases

    def __len__(self) -> int:
        return len(self.leases)

    def grant(self, request_id: str, block_ids: list[int]) -> str | None:
        """Hold ``request_id``'s table under a new lease; returns the lease key (None, and
        the table left to its request, in the never-seen case of a key drawn twice)."""
        key = secrets.token_urlsafe(KEY_BYTES)
        if key in self.leases:  # 2^-128: never; but the engine core must not die of it
            logger.error("a lease key was drawn twice; the prefill is not handed over")
            return None
        self.kvm.rekey(request_id, held_key("lease", key))
        self.leases[key] = Lease(key, self.clock() + self.lease_s, block_ids)
        self.expose.append(KVExposeOp(key, pack(block_ids)))
        self.stats.leases += 1
        return key

    # renew and release act only on keys presented exactly (dict lookups): a key is 128
    # random bits, so a sender can only name leases it was given
    def renew(self, keys: list[str]) -> None:
        deadline = self.clock() + self.lease_s
        for key in keys:
            lease = self.leases.get(key)
            if lease is not None:  # a late renewal of an ended lease is ignored
                lease.deadline = deadline

    def release(self, keys: list[str]) -> None:
        for key in keys:
            if key in self.leases:  # a duplicate release is ignored
                self._end(key)
                self.stats.leases_released += 1

    def expire(self) -> None:
        now = self.clock()
        for key in [k for k, lease in self.leases.items() if lease.deadline <= now]:
            self._end(key)
            self.stats.leases_expired += 1

    def release_all(self) -> None:
        for key in list(self.leases):
            self._end(key)

    def _end(self, key: str) -> None:
        del self.leases[key]
        self.kvm.free_table(held_key("lease", key))
        self.unexpose.append(key)

    def held_keys(self) -> set[tuple[str, str]]:
        return {held_key("lease", k) for k in self.leases}
