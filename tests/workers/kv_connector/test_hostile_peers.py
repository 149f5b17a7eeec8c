"""A decode rank's puller against peers a hostile client names (real block servers and a real
puller on real sockets, as test_transports.py): a silent peer holds only its own load, a wrong
or guessed lease key and blocks outside a lease are refused and reported as refusals, and the
connections to client-named endpoints stay a bounded pool.
"""

from __future__ import annotations

import socket
import time

import zmq

from protocol.codec import pack, unpack
from protocol.kv_connector import KVLoadOp
from tests.workers.kv_connector.test_transports import Decode, Prefill
from workers.kv_connector import puller as puller_mod


def _load(d: Decode, load_id: int, port: int, key: str, remote: list[int],
          local: list[int]) -> None:
    d.puller.submit(KVLoadOp(load_id=load_id, block_ids=pack(local),
                             remote_block_ids=pack(remote), remote_key=key,
                             remote_engine_id="P", remote_host="127.0.0.1",
                             remote_rank_ports=[port]))


def test_a_silent_peer_holds_only_its_own_load() -> None:
    ctx = zmq.Context()
    silent = socket.socket()  # accepts connections (the kernel does) and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    p = Prefill(ctx, 1)
    d = Decode(ctx, 1, 0, "tcp")
    try:
        _load(d, 1, silent.getsockname()[1], "k", [1], [1])  # first in line
        p.expose("k2", [2, 3])
        _load(d, 2, p.ports[0], "k2", [2, 3], [4, 5])
        rep = d.report()  # the normal load finishes while the silent one is still pending
        assert unpack(rep.done) == [2], rep.reasons
        assert d.puller.num_loads == 1  # load 1 is still waiting for its peer
        d.expected(p, [2, 3], [4, 5])
        d.puller.cancel([1])  # the core gives it up (kv_transfer_timeout_s): it reports
        rep = d.report()
        assert unpack(rep.failed) == [1] and rep.reasons == ["cancelled"]
        assert d.puller.num_loads == 0
    finally:
        d.close()
        p.close()
        silent.close()
        ctx.term()


def test_wrong_keys_and_foreign_blocks_are_reported_as_refusals(monkeypatch) -> None:
    from workers.kv_connector import transports

    monkeypatch.setattr(transports, "NOT_YET_LIMIT_S", 0.2)  # an unknown key's grace
    ctx = zmq.Context()
    p = Prefill(ctx, 1)
    d = Decode(ctx, 1, 0, "tcp")
    try:
        p.expose("victim-key", [1, 2])
        p.expose("thief-key", [5])
        for load_id, key, remote in ((1, "victim-42#2", [1, 2]),  # a guessed old-style key
                                     (2, "x" * 22, [1, 2]),  # a random wrong one
                                     (3, "thief-key", [1, 2])):  # its own key, others' blocks
            _load(d, load_id, p.ports[0], key, remote, [3, 4])
            rep = d.report()
            assert unpack(rep.failed) == [load_id] and unpack(rep.refused) == [load_id]
            assert "victim" not in rep.reasons[0]  # no key is echoed back
        assert not any(torch_any(c[3:5]) for c in d.caches)  # nothing of the victim's KV
        # the victim still reads its lease
        _load(d, 4, p.ports[0], "victim-key", [1, 2], [3, 4])
        assert unpack(d.report().done) == [4]
        d.expected(p, [1, 2], [3, 4])
    finally:
        d.close()
        p.close()
        ctx.term()


def torch_any(t) -> bool:
    return bool(t.abs().sum() > 0)


def test_connections_to_named_endpoints_are_a_bounded_pool(monkeypatch) -> None:
    monkeypatch.setattr(puller_mod, "MAX_PEERS", 4)
    made: list[object] = []

    class CountedPeer(puller_mod.Peer):
        def __init__(self, *a: object) -> None:
            super().__init__(*a)  # type: ignore[arg-type]
            made.append(self)

    monkeypatch.setattr(puller_mod, "Peer", CountedPeer)
    ctx = zmq.Context()
    silent = []
    d = Decode(ctx, 1, 0, "tcp")
    try:
        for i in range(10):  # peers that accept and never answer: never dropped as broken
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            s.listen(4)
            silent.append(s)
            _load(d, i, s.getsockname()[1], "k", [1], [1])
            deadline = time.monotonic() + 10
            while len(made) <= i and time.monotonic() < deadline:
                time.sleep(0.01)
            assert len(made) == i + 1
            d.puller.cancel([i])
            assert d.report().reasons == ["cancelled"]
            assert d.puller.num_peers <= 4
    finally:
        d.close()
        for s in silent:
            s.close()
        ctx.term()
