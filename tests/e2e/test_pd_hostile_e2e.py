"""P/D against hostile clients, on a real engine (TP 1, kv_both over the TCP pull, so it is its
own prefill and decode engine): a guessed or made-up lease reads none of the victim's KV and
ends none of its leases, and is counted; request ids that look like the connector's internal
table keys cannot take the engine down; 300 client-named dead endpoints leave the engine
core's descriptors bounded (the census shows the pool); a silent peer holds only its own
request. Nothing here depends on timing.
"""

from __future__ import annotations

import os
import queue
import secrets
import socket
import time

import msgspec
import pytest

from launch import LLM, SamplingParams
from protocol.kv_connector import KVTransferConfig, KVTransferParams
from protocol.request_options import RequestOptions
from tests.e2e.test_pd_e2e import BS, GREEDY, OPTS, PREFILL, prefill, prompt
from tests.helpers.procs import wait_no_descendants

pytestmark = pytest.mark.slow  # one engine (one rank) for the module


@pytest.fixture(scope="module")
def engine():
    e = LLM("dummy:tiny", 1, kv_transfer_config=KVTransferConfig(kv_connector="tcp"), **OPTS)
    try:
        yield e
    finally:
        e.shutdown()
        assert wait_no_descendants(15) == []


def core_pid(e: LLM) -> int:
    (child,) = [c for c in e.group.children if "core" in c.name]
    return child.proc.pid


def num_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def settled(e: LLM, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if int(e.get_stats()["num_free_blocks"]) == e.info.num_blocks - 1:
            return True
        time.sleep(0.05)
    return False


def closed_ports(n: int) -> list[int]:
    """Ports nothing listens on (bound once by the kernel's choice, then closed)."""
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def test_a_guessed_lease_reads_nothing_and_is_counted(engine) -> None:
    e = engine
    text = prompt(4 * BS + 3, 11)
    ref = e.generate([text], GREEDY, use_tqdm=False, cache_salt="reference")
    victim = prefill(e, [text])[0].kv_transfer_params
    assert victim is not None
    refused = e.get_stats()["kv_lease_refused"]
    # the old scheme's next key, and a random one: refused, recomputed (another salt: no
    # prefix hit either), so not one prompt token came from anyone's KV
    for key in ("req-1#2", secrets.token_urlsafe(16)):
        thief = msgspec.structs.replace(victim, remote_request_id=key)
        out = e.generate([text], GREEDY, use_tqdm=False, cache_salt=key, timeout_s=120,
                         kv_transfer_params=thief)
        assert out[0].token_ids == ref[0].token_ids
        assert out[0].metrics.num_cached_tokens == 0
    stats = e.get_stats()
    assert stats["kv_lease_refused"] == refused + 2
    assert stats["kv_leases_active"] >= 1  # the victim's lease survived both
    out = e.generate([text], GREEDY, use_tqdm=False, cache_salt="victim", timeout_s=120,
                     kv_transfer_params=victim)
    assert out[0].token_ids == ref[0].token_ids
    assert out[0].metrics.num_cached_tokens == len(text) - 1  # it got its KV
    assert settled(e)


def test_reserved_looking_request_ids_cannot_take_the_engine_down(engine) -> None:
    e = engine
    assert e.client is not None
    sink: queue.Queue = queue.Queue()
    ids = ["\x00kv-held:req-1#1", "\x00kv-held:load0", "\x00kv-held:", "\x00kv-held:a#1#2"]
    text = prompt(2 * BS + 1, 12)
    for rid in ids:
        e.client.add_request(rid, text, SamplingParams(max_tokens=1), sink,
                             options=RequestOptions(kv_transfer_params=PREFILL))
    finished: dict[str, object] = {}
    deadline = time.monotonic() + 60
    while len(finished) < len(ids) and time.monotonic() < deadline:
        for tr, out, _ in sink.get(timeout=max(0.01, deadline - time.monotonic())):
            if out.finish_reason is not None:
                finished[tr.request_id] = out
    assert set(finished) == set(ids)
    # the engine still serves, P/D included, and every held table is freed in time
    params = prefill(e, [text])[0].kv_transfer_params
    out = e.generate([text], GREEDY, use_tqdm=False, kv_transfer_params=params, timeout_s=60)
    assert out[0].finish_reason == "length"
    e.abort(ids)
    assert e.health().stats is not None


def test_dead_peer_ports_leave_the_descriptors_bounded(engine) -> None:
    e = engine
    pid = core_pid(e)
    before = num_fds(pid)
    text = prompt(BS + 1, 13)
    ports = closed_ports(600)
    params = [KVTransferParams(do_remote_prefill=True, remote_engine_id="ghost",
                               remote_block_ids=[1, 2], remote_host="127.0.0.1",
                               remote_port=ports[2 * i], remote_rank_ports=[ports[2 * i + 1]],
                               tp_size=1, remote_request_id=secrets.token_urlsafe(16),
                               remote_num_tokens=len(text), remote_lease_s=30.0)
              for i in range(300)]
    timeouts = e.get_stats()["kv_transfer_timeouts"]
    outs = e.generate([text] * 300, SamplingParams(max_tokens=1), use_tqdm=False,
                      timeout_s=300, kv_transfer_params=params)
    assert all(o.finish_reason == "length" for o in outs)  # each recomputed (refused at once)
    assert e.get_stats()["kv_transfer_timeouts"] == timeouts  # none waited out the timeout
    census = e.census()
    peers = census["engine_core"]["kv_connector.peers"]
    assert 0 < peers <= 64
    assert census["rank0"]["kv_connector.peers"] <= 64
    # one DEALER holds a descriptor or two (its mailbox, its connection): 300 would be far above
    assert num_fds(pid) - before <= 2 * 64 + 16, (before, num_fds(pid))


def test_a_silent_peer_holds_only_its_own_request(engine) -> None:
    e = engine
    assert e.client is not None
    silent = socket.socket()  # accepts (the kernel does) and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        text = prompt(3 * BS + 2, 14)
        port = silent.getsockname()[1]
        stuck = KVTransferParams(do_remote_prefill=True, remote_engine_id="ghost",
                                 remote_block_ids=[1, 2, 3, 4], remote_host="127.0.0.1",
                                 remote_port=port, remote_rank_ports=[port], tp_size=1,
                                 remote_request_id=secrets.token_urlsafe(16),
                                 remote_num_tokens=len(text))
        sink: queue.Queue = queue.Queue()
        e.client.add_request("stuck", text, GREEDY, sink,
                             options=RequestOptions(kv_transfer_params=stuck))
        other = prompt(3 * BS + 2, 15)
        params = prefill(e, [other])[0].kv_transfer_params
        out = e.generate([other], GREEDY, use_tqdm=False, cache_salt="other", timeout_s=60,
                         kv_transfer_params=params)
        assert out[0].metrics.num_cached_tokens == len(other) - 1  # it loaded, meanwhile
        finals = [o for batch in list(sink.queue) for _, o, _ in batch
                  if o.finish_reason is not None]
        assert finals == []  # the silent peer's request is still waiting
        e.abort(["stuck"])
        assert settled(e)
    finally:
        silent.close()
