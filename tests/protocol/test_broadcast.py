"""One PUB, three subscriber processes: start-up sync, then every frame reaches every rank."""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from protocol.codec import Encoder, pack, worker_decoder
from protocol.messages import CachedRequestData, ModelRunnerOutput, SchedulerOutput, Shutdown
from protocol.transport import (
    Endpoints,
    ipc_endpoints,
    make_socket,
    recv_frame,
    remove_ipc_dir,
    wait_subscribers,
)

REPO = Path(__file__).resolve().parents[2]
SUBSCRIBER = Path(__file__).resolve().parent / "subscriber_main.py"
WAIT_MS = 30_000
NUM_SUBSCRIBERS = 3


def spawn_subscribers(eps: Endpoints, n: int, secret: str | None = None) -> list[subprocess.Popen]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    extra = [secret] if secret else []
    return [
        subprocess.Popen(
            [sys.executable, str(SUBSCRIBER), eps.broadcast, eps.results, str(rank), *extra],
            env=env,
            cwd=REPO,
        )
        for rank in range(n)
    ]


def reap(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


@pytest.fixture
def ipc() -> Iterator[tuple[Endpoints, zmq.Context]]:
    eps, path = ipc_endpoints()
    ctx = zmq.Context()
    try:
        yield eps, ctx
    finally:
        ctx.destroy(linger=0)
        remove_ipc_dir(path)


def random_steps(n: int, seed: int) -> list[SchedulerOutput]:
    rng = random.Random(seed)
    steps = []
    for i in range(n):
        handles = rng.sample(range(1000), rng.randint(0, 5))
        steps.append(
            SchedulerOutput(
                step_id=i,
                cached_reqs=CachedRequestData(
                    handles=pack(handles),
                    new_block_counts=pack([1] * len(handles)),
                    new_block_ids=pack([rng.randrange(10_000) for _ in handles]),
                ),
                finished_handles=pack(rng.sample(range(1000), rng.randint(0, 2))),
                num_running=rng.randint(0, 256),
                total_num_scheduled_tokens=rng.randint(0, 2048),
            )
        )
    return steps


def test_broadcast_to_three_subscriber_processes(ipc: tuple[Endpoints, zmq.Context]) -> None:
    eps, ctx = ipc
    pub = make_socket(ctx, zmq.PUB, eps.broadcast, bind=True)
    pull = make_socket(ctx, zmq.PULL, eps.results, bind=True)
    procs = spawn_subscribers(eps, NUM_SUBSCRIBERS)
    try:
        others = wait_subscribers(pub, pull, NUM_SUBSCRIBERS, timeout_s=WAIT_MS / 1000)
        assert others == []
        enc = Encoder()
        digest = hashlib.sha256()
        steps = random_steps(300, seed=1)
        for so in steps:
            frame = enc.encode(so)  # encoded once, the same bytes go to every rank
            digest.update(frame)
            pub.send(frame)
        pub.send(enc.encode(Shutdown(reason="test done")))
        expected = int.from_bytes(digest.digest()[:7], "little")

        dec = worker_decoder()
        reports: dict[int, ModelRunnerOutput] = {}
        while len(reports) < NUM_SUBSCRIBERS:
            frame = recv_frame(pull, WAIT_MS)
            assert frame is not None, f"only ranks {sorted(reports)} reported"
            msg = dec.decode(frame)
            assert isinstance(msg, ModelRunnerOutput), msg
            reports[msg.rank] = msg
        for rank, out in reports.items():
            assert out.step_id == len(steps), f"rank {rank} got {out.step_id} steps"
            assert out.checksum == expected, f"rank {rank} saw different bytes"
        for p in procs:
            assert p.wait(timeout=WAIT_MS / 1000) == 0
    finally:
        reap(procs)
        pub.close()
        pull.close()
