"""Endpoints, socket options, the start-up sync helpers and tcp authentication."""

from __future__ import annotations

import os
import stat
import threading
import time
from collections.abc import Iterator

import pytest
import zmq

from protocol.auth import curve_keypair, hello_mac, secret_from_env, verify_hello_mac
from protocol.codec import Encoder
from protocol.messages import WorkerHello
from protocol.transport import (
    ENDPOINTS_ENV,
    Endpoints,
    answer_sync,
    ipc_endpoints,
    is_loopback_addr,
    make_socket,
    recv_frame,
    remove_ipc_dir,
    tcp_endpoints,
    wait_subscribers,
)

WAIT_MS = 10_000  # generous: only ever reached when something is broken


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    c = zmq.Context()
    try:
        yield c
    finally:
        c.destroy(linger=0)


@pytest.fixture
def ipc() -> Iterator[Endpoints]:
    eps, path = ipc_endpoints()
    try:
        yield eps
    finally:
        remove_ipc_dir(path)


def bound_tcp(ctx: zmq.Context, kind: int, secret: bytes | None) -> tuple[zmq.Socket, str]:
    sock = make_socket(ctx, kind, "tcp://127.0.0.1:*", bind=True, secret=secret)
    return sock, sock.getsockopt(zmq.LAST_ENDPOINT).decode()


# -------------------------------------------------------------------------------- endpoints


def test_ipc_dir_is_private_and_removable() -> None:
    eps, path = ipc_endpoints()
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
        addrs = [eps.requests, eps.outputs, eps.broadcast, eps.results]
        assert len(set(addrs)) == 4
        for a in addrs:
            assert a.startswith(f"ipc://{path}/")
            assert len(a) - len("ipc://") < 100  # unix socket path limit
    finally:
        remove_ipc_dir(path)
    assert not os.path.exists(path)
    remove_ipc_dir(path)  # idempotent


def test_endpoints_env_round_trip() -> None:
    eps = tcp_endpoints("10.0.0.5", 5550)
    env = eps.to_env()
    assert list(env) == [ENDPOINTS_ENV]
    assert Endpoints.from_env(env) == eps
    assert Endpoints.from_env({}) is None
    with pytest.raises(ValueError, match=ENDPOINTS_ENV):
        Endpoints.from_env({ENDPOINTS_ENV: "{not json"})


def test_tcp_endpoints_ports_and_ipv6() -> None:
    eps = tcp_endpoints("node1", 7000)
    assert (eps.requests, eps.outputs, eps.broadcast, eps.results) == (
        "tcp://node1:7000",
        "tcp://node1:7001",
        "tcp://node1:7002",
        "tcp://node1:7003",
    )
    assert tcp_endpoints("::1", 9).results == "tcp://[::1]:12"


@pytest.mark.parametrize(
    ("addr", "loopback"),
    [
        ("tcp://127.0.0.1:5000", True),
        ("tcp://127.0.0.1:*", True),
        ("tcp://localhost:5000", True),
        ("tcp://[::1]:5000", True),
        ("tcp://0.0.0.0:5000", False),
        ("tcp://*:5000", False),
        ("tcp://10.1.2.3:5000", False),
        ("tcp://eth0:5000", False),
        ("tcp://node7.cluster:5000", False),
    ],
)
def test_is_loopback_addr(addr: str, loopback: bool) -> None:
    assert is_loopback_addr(addr) is loopback


# -------------------------------------------------------------------------------- sockets


@pytest.mark.parametrize("addr", ["tcp://*:5999", "tcp://0.0.0.0:5999", "tcp://10.1.2.3:5999"])
def test_non_loopback_tcp_without_secret_is_refused(ctx: zmq.Context, addr: str) -> None:
    with pytest.raises(ValueError, match="TANDEM_SECRET"):
        make_socket(ctx, zmq.PULL, addr, bind=addr.startswith("tcp://*"))


def test_socket_options_are_set(ctx: zmq.Context, ipc: Endpoints) -> None:
    sock = make_socket(ctx, zmq.PULL, ipc.results, bind=True, hwm=7, linger_ms=3)
    try:
        assert sock.getsockopt(zmq.SNDHWM) == 7
        assert sock.getsockopt(zmq.RCVHWM) == 7
        assert sock.getsockopt(zmq.LINGER) == 3
    finally:
        sock.close()
    default = make_socket(ctx, zmq.PUB, ipc.broadcast, bind=True)
    try:
        assert default.getsockopt(zmq.SNDHWM) == 0  # unlimited: a step plan is never dropped
        assert default.getsockopt(zmq.LINGER) == 0  # close never hangs
    finally:
        default.close()


def test_recv_frame_times_out_and_receives(ctx: zmq.Context, ipc: Endpoints) -> None:
    pull = make_socket(ctx, zmq.PULL, ipc.requests, bind=True)
    push = make_socket(ctx, zmq.PUSH, ipc.requests, bind=False)
    try:
        assert recv_frame(pull, 10) is None
        push.send(b"hello")
        assert recv_frame(pull, WAIT_MS) == b"hello"
    finally:
        pull.close()
        push.close()


# -------------------------------------------------------------------------------- sync


def test_wait_subscribers_with_in_process_subscribers(ctx: zmq.Context, ipc: Endpoints) -> None:
    pub = make_socket(ctx, zmq.PUB, ipc.broadcast, bind=True)
    pull = make_socket(ctx, zmq.PULL, ipc.results, bind=True)
    subs = [make_socket(ctx, zmq.SUB, ipc.broadcast, bind=False) for _ in range(2)]
    pushes = [make_socket(ctx, zmq.PUSH, ipc.results, bind=False) for _ in range(2)]
    hello = WorkerHello(
        rank=1,
        world_size=2,
        pid=1,
        hostname="h",
        device="cpu",
        num_blocks=8,
        vocab_size=10,
        max_model_len=64,
        eos_token_id=None,
    )
    pushes[1].send(Encoder().encode(hello))  # arrives before rank 1's WorkerReady
    nonces: list[int] = []
    errors: list[BaseException] = []

    def worker(rank: int) -> None:
        try:
            nonces.append(answer_sync(subs[rank], pushes[rank], rank, WAIT_MS / 1000))
        except BaseException as e:  # surfaced by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(r,), daemon=True) for r in range(2)]
    try:
        for t in threads:
            t.start()
        others = wait_subscribers(pub, pull, 2, timeout_s=WAIT_MS / 1000)
        for t in threads:
            t.join(timeout=WAIT_MS / 1000)
        assert not errors
        assert others == [hello]  # not lost: the caller gets it back
        assert len(set(nonces)) == 1
    finally:
        for s in [pub, pull, *subs, *pushes]:
            s.close()


def test_wait_subscribers_times_out_naming_missing_ranks(ctx: zmq.Context, ipc: Endpoints) -> None:
    pub = make_socket(ctx, zmq.PUB, ipc.broadcast, bind=True)
    pull = make_socket(ctx, zmq.PULL, ipc.results, bind=True)
    try:
        with pytest.raises(TimeoutError, match=r"missing ranks \[0, 1\]"):
            wait_subscribers(pub, pull, 2, timeout_s=0.1)
    finally:
        pub.close()
        pull.close()


def test_answer_sync_times_out(ctx: zmq.Context, ipc: Endpoints) -> None:
    sub = make_socket(ctx, zmq.SUB, ipc.broadcast, bind=False)
    push = make_socket(ctx, zmq.PUSH, ipc.results, bind=False)
    try:
        with pytest.raises(TimeoutError, match="rank 3"):
            answer_sync(sub, push, 3, timeout_s=0.05)
    finally:
        sub.close()
        push.close()


# -------------------------------------------------------------------------------- tcp auth


def test_tcp_push_pull_needs_the_right_secret(ctx: zmq.Context) -> None:
    pull, addr = bound_tcp(ctx, zmq.PULL, b"right secret")
    wrong = make_socket(ctx, zmq.PUSH, addr, bind=False, secret=b"wrong secret")
    plain = make_socket(ctx, zmq.PUSH, addr, bind=False)  # loopback: allowed, but no CURVE
    right = None
    try:
        wrong.send(b"from the wrong peer")
        plain.send(b"from a plain peer")
        assert recv_frame(pull, 300) is None  # both handshakes fail: nothing gets in
        right = make_socket(ctx, zmq.PUSH, addr, bind=False, secret=b"right secret")
        right.send(b"from the right peer")
        assert recv_frame(pull, WAIT_MS) == b"from the right peer"
        assert recv_frame(pull, 100) is None
    finally:
        for s in (pull, wrong, plain, right):
            if s is not None:
                s.close()


def test_tcp_pub_sub_wrong_secret_gets_nothing(ctx: zmq.Context) -> None:
    pub, addr = bound_tcp(ctx, zmq.PUB, b"s3cret")
    good = make_socket(ctx, zmq.SUB, addr, bind=False, secret=b"s3cret")
    bad = make_socket(ctx, zmq.SUB, addr, bind=False, secret=b"guess")
    try:
        deadline = time.monotonic() + WAIT_MS / 1000
        got = None
        while got is None and time.monotonic() < deadline:
            pub.send(b"step")  # re-send: PUB drops until the subscription is in (slow joiner)
            got = recv_frame(good, 20)
        assert got == b"step"
        assert recv_frame(bad, 300) is None
    finally:
        for s in (pub, good, bad):
            s.close()


def test_tcp_with_secret_on_any_interface_is_allowed(ctx: zmq.Context) -> None:
    sock = make_socket(ctx, zmq.PULL, "tcp://*:*", bind=True, secret=b"x")
    sock.close()


# -------------------------------------------------------------------------------- auth


def test_secret_from_env() -> None:
    assert secret_from_env({"TANDEM_SECRET": "abc"}) == b"abc"
    assert secret_from_env({"TANDEM_SECRET": ""}) is None
    assert secret_from_env({}) is None


def test_curve_keys_are_deterministic_per_secret_and_role() -> None:
    assert curve_keypair(b"a", server=True) == curve_keypair(b"a", server=True)
    assert curve_keypair(b"a", server=True) != curve_keypair(b"a", server=False)
    assert curve_keypair(b"a", server=True) != curve_keypair(b"b", server=True)
    with pytest.raises(ValueError):
        curve_keypair(b"", server=True)


def test_hello_mac() -> None:
    mac = hello_mac(b"k", 1, 2, 100, "node")
    assert verify_hello_mac(b"k", mac, 1, 2, 100, "node")
    assert not verify_hello_mac(b"other", mac, 1, 2, 100, "node")
    assert not verify_hello_mac(b"k", mac, 0, 2, 100, "node")
