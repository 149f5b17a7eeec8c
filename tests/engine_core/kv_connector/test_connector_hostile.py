"""The connector's scheduler side against hostile clients (two real schedulers and fake workers,
as in test_connector_scheduler.py): lease keys are capabilities no client can guess or derive,
a request id can never reach the tables the connector holds, a refused lease is counted and
follows the failure policy, and a client's lease time cannot speed up everyone's renewals.
"""

from __future__ import annotations

import math

import msgspec
import pytest

from engine_core.kv_connector.loads import MIN_REMOTE_LEASE_S, RemoteLeases, clamp_lease
from protocol.codec import pack
from protocol.kv_connector import (
    KVConnectorReport,
    KVLeaseControl,
    KVTransferParams,
    params_field_error,
)
from tests.engine_core.kv_connector.test_connector_scheduler import (
    BS,
    Clock,
    Engine,
    prefill,
    reference,
    request,
    run,
)


@pytest.fixture
def pair() -> tuple[Engine, Engine, Clock]:
    clock = Clock()
    return Engine("P", clock), Engine("D", clock), clock


def test_lease_keys_are_random_and_never_derived_from_the_request(pair) -> None:
    p, _, _ = pair
    prompt = list(range(40, 40 + 2 * BS + 1))
    keys = [prefill(p, f"victim-{i}", prompt).remote_request_id for i in range(4)]
    assert len(set(keys)) == 4
    for i, key in enumerate(keys):
        assert f"victim-{i}" not in key and "#" not in key
        assert len(key) >= 22  # 16 random bytes, URL-safe base64


def test_a_guessed_or_wrong_lease_reads_nothing_and_ends_nothing(pair) -> None:
    p, d, _ = pair
    prompt = list(range(50, 50 + 3 * BS + 1))
    victim = prefill(p, "victim-42", prompt)
    # lease messages naming anything but the exact key act on nothing
    for guess in ("victim-42#1", "victim-42#2", victim.remote_request_id[:-1], "x" * 22):
        p.conn.on_control(KVLeaseControl(engine_id="P", renew=[guess], release=[guess]))
    assert victim.remote_request_id in p.conn.leases.leases
    # the thief's load names a guessed key: P's ranks refuse it (the fake transfer only
    # copies under an exposed key); D recomputes and counts the refusal
    thief = msgspec.structs.replace(victim, remote_request_id="victim-42#2")
    d.sched.add_request(request("thief", prompt, 4, thief))
    d.step()
    (op,) = d.loads
    d.loads = []
    assert op.remote_key == "victim-42#2"
    d.conn.on_report(KVConnectorReport(rank=0, failed=pack([op.load_id]),
                                       reasons=["lease refused"], refused=pack([op.load_id])))
    run(p, d)
    assert d.tokens("thief") == reference(prompt, 4)
    assert d.final("thief").num_cached_tokens == 0  # nothing of the victim's KV
    assert d.conn.stats.lease_refused == 1 and d.conn.stats_dict()["kv_lease_refused"] == 1
    # the thief's release of its guessed key did not touch the victim's lease
    assert victim.remote_request_id in p.conn.leases.leases
    d.sched.add_request(request("victim-42", prompt, 4, victim))
    run(p, d)
    assert d.tokens("victim-42") == reference(prompt, 4)
    assert d.final("victim-42").num_cached_tokens == len(prompt) - 1
    assert p.all_free and d.all_free and not p.conn.leases


def test_a_refused_lease_fails_the_request_under_the_fail_policy() -> None:
    clock = Clock()
    p, d = Engine("P", clock), Engine("D", clock, policy="fail")
    prompt = list(range(60, 60 + 2 * BS + 1))
    params = prefill(p, "victim", prompt)
    params.remote_request_id = "made-up"
    d.sched.add_request(request("thief", prompt, 4, params))
    d.step()
    (op,) = d.loads
    d.loads = []
    d.conn.on_report(KVConnectorReport(rank=0, failed=pack([op.load_id]),
                                       reasons=["lease refused"], refused=pack([op.load_id])))
    run(p, d)
    assert d.final("thief").error and "failed" in d.final("thief").error
    assert d.conn.stats.lease_refused == 1
    p.conn.close()
    assert d.all_free


@pytest.mark.parametrize("rid", ["\x00kv-held:victim#1", "\x00kv-held:load0",
                                 "\x00kv-held:", "load0", "lease"])
def test_reserved_looking_request_ids_cannot_collide_with_held_tables(pair, rid: str) -> None:
    p, d, _ = pair
    prompt = list(range(70, 70 + 2 * BS + 1))
    # before and after a lease under the "old" name exists, on both sides
    p.sched.add_request(request(rid, prompt, 1, KVTransferParams(do_remote_decode=True)))
    first = prefill(p, "victim", prompt)
    while p.sched.has_unfinished_requests():
        p.step()
    again = prefill(p, rid, prompt)
    # a request id equal to a live lease key is just a request id
    prefill(p, first.remote_request_id, prompt)
    assert len(p.conn.leases) >= 3
    d.sched.add_request(request(rid, prompt, 3, again))
    run(p, d)
    assert d.tokens(rid) == reference(prompt, 3)
    p.conn.close()
    assert p.all_free and d.all_free


def test_client_lease_times_are_clamped() -> None:
    clock = Clock()
    leases = RemoteLeases(30.0, clock)
    assert leases.renew_every_s == 7.5

    def params(key: str, lease_s: float) -> KVTransferParams:
        return KVTransferParams(do_remote_prefill=True, remote_engine_id="P",
                                remote_host="h", remote_port=9, remote_request_id=key,
                                remote_lease_s=lease_s)

    leases.hold("a", params("k1", 0.2))  # a client asking for renewals every 50 ms
    assert leases.renew_every_s == MIN_REMOTE_LEASE_S / 4
    for bad in (1e-9, -1.0, math.nan, math.inf, 1e12):
        leases.hold("b", params("k2", bad))
        assert leases.renew_every_s >= MIN_REMOTE_LEASE_S / 4
    assert clamp_lease(0.05, 30.0) == MIN_REMOTE_LEASE_S
    assert clamp_lease(1e6, 30.0) == 30.0
    assert clamp_lease(math.nan, 30.0) == 30.0
    assert clamp_lease(8.0, 30.0) == 8.0
    # at the floor, a second of waiting sees at most four renewals
    sent = 0
    for _ in range(100):
        clock.t += 0.01
        sent += sum(len(m.renew) > 0 for _, m in leases.take_messages())
    assert sent <= 4


@pytest.mark.parametrize(("field", "value"), [
    ("remote_block_ids", list(range(1, 70))),
    ("remote_block_ids", [0]),
    ("remote_block_ids", [1 << 40]),
    ("remote_port", 70000),
    ("remote_port", -1),
    ("remote_rank_ports", [0]),
    ("remote_rank_ports", list(range(1000, 1100))),
    ("remote_host", "a" * 300),
    ("remote_host", "evil host/../"),
    ("remote_engine_id", "e" * 1000),
    ("remote_request_id", "k" * 1000),
    ("remote_lease_s", math.nan),
    ("remote_lease_s", -1.0),
    ("remote_num_tokens", -5),
])
def test_params_bounds_name_the_field(field: str, value: object) -> None:
    p = KVTransferParams(do_remote_prefill=True, remote_engine_id="P", remote_host="127.0.0.1",
                         remote_port=9, remote_rank_ports=[10], tp_size=1,
                         remote_request_id="k", remote_block_ids=[1, 2], remote_num_tokens=8)
    assert params_field_error(p, 64) is None
    setattr(p, field, value)
    err = params_field_error(p, 64)
    assert err is not None and err[0] == f"kv_transfer_params.{field}", err
