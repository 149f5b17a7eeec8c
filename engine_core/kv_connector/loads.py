"""The decode side's loads: KV being pulled into a request's blocks, and the remote leases the
engine keeps alive while its requests wait.

A load is settled once every rank has reported it (done, or failed: one failed rank fails the
load). Until then its blocks stay held, even when the request is aborted or the load is given
up: a rank may still be writing into them. Reports for loads already settled, or never
started, are ignored.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from engine_core.request import Request
from protocol.kv_connector import KVLeaseControl, KVTransferParams

Address = tuple[str, int, str]  # (host, lease port, engine id) of a prefill engine

# the shortest remote lease a request's params may claim: a client's remote_lease_s sets how
# often this engine renews every lease it depends on, so it is clamped to [this, our own
# kv_lease_s], and the renew cadence never falls below a quarter of it
MIN_REMOTE_LEASE_S = 1.0


@dataclass
class PendingLoad:
    load_id: int
    request: Request | None  # None once aborted (its blocks are held under held_key)
    num_computed: int  # tokens the request had before (local prefix hit)
    num_tokens: int  # tokens this load brings
    deadline: float
    started: float
    held_key: tuple[str, str] | None = None  # the block manager's key once aborted
    cancelled: bool = False
    timed_out: bool = False
    refused: bool = False  # a prefill rank refused its lease (wrong, guessed or ended key)
    done: set[int] = field(default_factory=set)
    failed: dict[int, str] = field(default_factory=dict)
    nbytes: int = 0
    seconds: float = 0.0  # the slowest rank's


@dataclass
class RemoteRef:
    """A prefill engine's lease this engine's request depends on."""

    address: Address
    key: str


class RemoteLeases:
    """Renews the leases of requests still waiting here; releases them when done with."""

    def __init__(self, lease_s: float, clock: Callable[[], float]) -> None:
        self.lease_s = lease_s  # this engine's kv_lease_s: the longest remote lease assumed
        self.renew_every_s = lease_s / 4
        self.clock = clock
        self.refs: dict[str, RemoteRef] = {}  # request id -> its remote lease
        self._last_renew = clock()
        self._release: dict[Address, list[str]] = {}

    def hold(self, request_id: str, p: KVTransferParams) -> None:
        self.refs[request_id] = RemoteRef(
            (p.remote_host, p.remote_port, p.remote_engine_id), p.remote_request_id)
        lease = clamp_lease(p.remote_lease_s, self.lease_s)
        # renew well inside the shortest lease we depend on (within the clamp)
        self.renew_every_s = min(self.renew_every_s, lease / 4)

    def release(self, request_id: str) -> None:
        ref = self.refs.pop(request_id, None)
        if ref is not None:
            self._release.setdefault(ref.address, []).append(ref.key)

    def take_messages(self) -> list[tuple[Address, KVLeaseControl]]:
        """This moment's control messages: every release since the last call, and renewals
        of everything held when a renewal is due."""
        by_addr: dict[Address, KVLeaseControl] = {}
        for addr, keys in self._release.items():
            by_addr[addr] = KVLeaseControl(engine_id=addr[2], release=keys)
        self._release = {}
        now = self.clock()
        if self.refs and now - self._last_renew >= self.renew_every_s:
            self._last_renew = now
            for ref in self.refs.values():
                msg = by_addr.setdefault(ref.address, KVLeaseControl(engine_id=ref.address[2]))
                msg.renew.append(ref.key)
        return list(by_addr.items())


def clamp_lease(remote_lease_s: float, lease_s: float) -> float:
    """A client-supplied lease time within [MIN_REMOTE_LEASE_S, lease_s] (none, or not a
    finite number: ``lease_s``)."""
    if not math.isfinite(remote_lease_s) or remote_lease_s <= 0:
        return lease_s
    return min(max(remote_lease_s, MIN_REMOTE_LEASE_S), max(lease_s, MIN_REMOTE_LEASE_S))
