"""The worker side of P/D without engines: real block servers and a real puller on real ZeroMQ
sockets in this process, moving random KV between caches laid out as the model lays them out
under TP. Each transport (TCP pull, shared memory, NIXL when it imports) must put exactly the
right heads of the right blocks in place for every TP pairing; leases that ended, a wrong
secret, a dead prefill rank and a cancel must each fail the load, with a reason.
"""

from __future__ import annotations

import platform
import sys

import pytest
import torch
import zmq

from protocol.codec import Decoder, pack, unpack
from protocol.kv_connector import KVConnectorReport, KVLoadOp, KVTransferConfig
from protocol.kv_peer import PeerInfo
from protocol.transport import make_socket
from workers.kv_connector.block_server import BlockServer
from workers.kv_connector.layout import HeadSlice, head_slices
from workers.kv_connector.nixl import nixl_available
from workers.kv_connector.puller import LocalLayout, Puller, boot_id
from workers.kv_connector.shm import SharedCaches

NUM_CACHES, NUM_BLOCKS, BS, HD, HEADS = 4, 12, 4, 8, 4


def test_head_slices() -> None:
    # equal TP: all heads from the same rank
    assert head_slices(4, 1, 2, 2, 2) == [HeadSlice(1, 0, 2, 0)]
    # P TP 1 -> D TP 2: each decode rank takes its half of rank 0's heads
    assert head_slices(4, 1, 2, 1, 4) == [HeadSlice(0, 2, 4, 0)]
    # P TP 2 -> D TP 1: both prefill ranks' heads
    assert head_slices(4, 0, 4, 2, 2) == [HeadSlice(0, 0, 2, 0), HeadSlice(1, 0, 2, 2)]
    # 3 heads padded to 4 over TP 2: the padding head needs nothing
    assert head_slices(3, 1, 2, 1, 3) == [HeadSlice(0, 2, 3, 0)]
    assert head_slices(3, 0, 3, 2, 2) == [HeadSlice(0, 0, 2, 0), HeadSlice(1, 0, 1, 2)]
    with pytest.raises(ValueError):
        head_slices(4, 0, 4, 1, 2)


def _caches(kv_heads: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(NUM_BLOCKS, BS, kv_heads, HD, generator=g) for _ in range(NUM_CACHES)]


class Prefill:
    """The block servers of a prefill engine of TP ``tp`` (one per rank)."""

    def __init__(self, ctx: zmq.Context, tp: int, secret: bytes | None = None,
                 shm: bool = False, nixl: bool = False) -> None:
        self.tp = tp
        self.caches = []
        self.servers = []
        self.keep: list = []
        for r in range(tp):
            caches = _caches(HEADS // tp, seed=r)
            fd, meta, addrs, progress = -1, b"", [], None
            if shm:
                shared = SharedCaches(caches)
                self.keep.append(shared)
                caches, fd = shared.tensors, shared.fd
            if nixl:
                from workers.kv_connector.nixl import NixlAgent

                agent = NixlAgent(f"test-p{r}", caches)
                self.keep.append(agent)
                meta, addrs, progress = agent.metadata, [c.data_ptr() for c in caches], \
                    agent.progress
            info = PeerInfo(engine_id="P", rank=r, tp_size=tp, hostname=_hostname(),
                            boot_id=boot_id(), pid=_pid(), device="cpu", dtype="float32",
                            num_caches=NUM_CACHES, num_blocks=NUM_BLOCKS, block_size=BS,
                            kv_heads=HEADS // tp, total_kv_heads=HEADS, head_dim=HD,
                            shm_fd=fd, nixl_metadata=meta, cache_addrs=addrs)
            server = BlockServer(ctx, "tcp://127.0.0.1:*", secret, caches, info, progress)
            server.start()
            self.caches.append(caches)
            self.servers.append(server)

    @property
    def ports(self) -> list[int]:
        return [s.port for s in self.servers]

    def expose(self, key: str, blocks: list[int]) -> None:
        for s in self.servers:
            s.expose(key, blocks)

    def close(self) -> None:
        for s in self.servers:
            s.close()


def _hostname() -> str:
    import socket

    return socket.gethostname()


def _pid() -> int:
    import os

    return os.getpid()


class Decode:
    """One decode rank: its caches, a puller, and the socket its reports arrive on."""

    def __init__(self, ctx: zmq.Context, tp: int, rank: int, connector: str,
                 secret: bytes | None = None) -> None:
        heads = HEADS // tp
        self.caches = [torch.zeros(NUM_BLOCKS, BS, heads, HD) for _ in range(NUM_CACHES)]
        # the engine core's results socket (CURVE under the rank's secret, as on tcp)
        self.results = make_socket(ctx, zmq.PULL, "tcp://127.0.0.1:*", bind=True, secret=secret)
        port = int(self.results.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])
        lay = LocalLayout(rank, NUM_CACHES, BS, heads, HEADS, HD, "float32")
        self.puller = Puller(ctx, connector, secret, lay, self.caches)
        self.puller.start(f"tcp://127.0.0.1:{port}")
        self.rank, self.tp = rank, tp
        self.dec: Decoder[KVConnectorReport] = Decoder(KVConnectorReport)

    def load(self, load_id: int, p: Prefill, key: str, remote: list[int],
             local: list[int]) -> None:
        self.puller.submit(KVLoadOp(load_id=load_id, block_ids=pack(local),
                                    remote_block_ids=pack(remote), remote_key=key,
                                    remote_engine_id="P", remote_host="127.0.0.1",
                                    remote_rank_ports=p.ports))

    def report(self, timeout_s: float = 30.0) -> KVConnectorReport:
        assert self.results.poll(int(timeout_s * 1000)), "no report"
        return self.dec.decode(self.results.recv())

    def expected(self, p: Prefill, remote: list[int], local: list[int]) -> None:
        """This rank's heads of the prefill engine's blocks are in place."""
        full = [torch.cat([p.caches[r][i] for r in range(p.tp)], dim=2)
                for i in range(NUM_CACHES)]  # every head, as one engine would hold them
        heads = HEADS // self.tp
        lo = self.rank * heads
        for i in range(NUM_CACHES):
            got = self.caches[i][local]
            want = full[i][remote][:, :, lo:lo + heads]
            assert torch.equal(got, want), f"cache {i}"

    def close(self) -> None:
        self.puller.close()
        self.results.close(0)


# NIXL comes with the test extra where its wheel exists (Linux x86_64): there it must work, so
# only another platform leaves it out
NIXL_WHEEL = sys.platform == "linux" and platform.machine() == "x86_64"
TRANSPORTS = ["tcp", "shm"] + (["nixl"] if NIXL_WHEEL or nixl_available() else [])


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (2, 2), (1, 2), (2, 1)])
def test_every_tp_pairing_moves_the_right_heads(transport: str, p_tp: int, d_tp: int) -> None:
    ctx = zmq.Context()
    p = Prefill(ctx, p_tp, shm=transport == "shm", nixl=transport == "nixl")
    ds = [Decode(ctx, d_tp, r, transport) for r in range(d_tp)]
    try:
        remote, local = [3, 7, 1, 10, 4], [9, 2, 5, 6, 11]
        for d in ds:  # not exposed yet: the pull waits for the prefill engine's step
            d.load(0, p, "req#1", remote, local)
        p.expose("req#1", [1, 3, 4, 7, 10, 0])
        for d in ds:
            rep = d.report()
            assert unpack(rep.done) == [0], rep.reasons
            assert rep.transport == transport and rep.nbytes > 0
            d.expected(p, remote, local)
    finally:
        for d in ds:
            d.close()
        p.close()
        ctx.term()


def test_failures_are_reported_with_a_reason() -> None:
    ctx = zmq.Context()
    p = Prefill(ctx, 1)
    d = Decode(ctx, 1, 0, "tcp")
    try:
        # a lease that ended: its blocks may hold another request's KV now
        p.expose("k1", [1, 2])
        p.servers[0].unexpose("k1")
        d.load(1, p, "k1", [1, 2], [3, 4])
        rep = d.report()
        assert unpack(rep.failed) == [1] and "ended" in rep.reasons[0]
        # blocks outside the lease
        p.expose("k2", [1])
        d.load(2, p, "k2", [1, 2], [3, 4])
        assert "outside" in d.report().reasons[0]
        # a cancel stops a load that waits for its lease
        d.load(3, p, "never", [1], [1])
        d.puller.cancel([3])
        assert d.report().reasons == ["cancelled"]
        # a dead prefill rank: refused at once
        p.close()
        d.load(4, p, "k2", [1], [1])
        rep = d.report()
        assert unpack(rep.failed) == [4] and "prefill rank" in rep.reasons[0]
    finally:
        d.close()
        p.close()
        ctx.term()


def test_a_wrong_secret_is_refused() -> None:
    ctx = zmq.Context()
    p = Prefill(ctx, 1, secret=b"cluster-secret")
    d = Decode(ctx, 1, 0, "tcp", secret=b"another-secret")
    try:
        p.expose("k", [1])
        d.load(1, p, "k", [1], [2])
        rep = d.report()
        assert unpack(rep.failed) == [1] and "CURVE" in rep.reasons[0]
        assert not torch.any(d.caches[0][2])  # nothing arrived
    finally:
        d.close()
        p.close()
        ctx.term()


def test_transfer_ports_off_loopback_need_the_secret() -> None:
    from engine_core.kv_connector.engine_side import KVConnectorEngine

    ctx = zmq.Context()
    try:
        with pytest.raises(ValueError, match="TANDEM_SECRET"):
            KVConnectorEngine(ctx, KVTransferConfig(kv_ip="10.255.255.1"), None)
        with pytest.raises(ValueError, match="TANDEM_SECRET"):
            BlockServer(ctx, "tcp://0.0.0.0:*", None, _caches(2, 0), None)  # type: ignore[arg-type]
    finally:
        ctx.term()


def test_auto_falls_back_to_tcp_when_memory_cannot_be_mapped() -> None:
    import msgspec

    ctx = zmq.Context()
    p = Prefill(ctx, 1, shm=True)
    server = p.servers[0]
    server.info = msgspec.structs.replace(server.info, shm_fd=999_999)  # no such descriptor
    d = Decode(ctx, 1, 0, "auto")
    try:
        p.expose("k", [1, 2, 3])
        d.load(1, p, "k", [1, 2, 3], [4, 5, 6])
        rep = d.report()
        assert unpack(rep.done) == [1] and rep.transport == "tcp", rep.reasons
        d.expected(p, [1, 2, 3], [4, 5, 6])
    finally:
        d.close()
        p.close()
        ctx.term()
