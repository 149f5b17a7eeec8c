"""The launcher as a user runs it: real `python -m launch` processes, real torchrun.

Every test kills whatever it started in a finally block and checks nothing was left behind.
Waits have timeouts so that a bug fails the test instead of hanging CI; they are not
performance thresholds (the measured figures go in the issue notes).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import msgspec
import pytest

from launch.processes import free_port
from protocol.config import EngineConfig
from tests.helpers.procs import descendants, wait_no_descendants

WORKLOAD = ["--model", "dummy:tiny", "--num-prompts", "4", "--input-len", "24", "--output-len", "8"]


def _run(args: list[str], timeout: float = 180, **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "launch", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        **kw,
    )


def _tokens(proc: subprocess.CompletedProcess[str]) -> list[list[int]]:
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["summary"]["requests"] == 4
    return [o["token_ids"] for o in out["outputs"]]


@pytest.fixture(scope="module")
def tp2_tokens() -> list[list[int]]:
    return _tokens(_run(["--nproc-per-node", "2", *WORKLOAD, "--json"]))


def test_launcher_tp2_equals_tp1(tp2_tokens: list[list[int]]) -> None:
    tp1 = _tokens(_run(["--nproc-per-node", "1", *WORKLOAD, "--json"]))
    assert tp1 == tp2_tokens
    assert all(len(t) == 8 for t in tp1)
    assert wait_no_descendants(5) == []


def test_two_nodes_on_loopback_equal_one_node(tp2_tokens: list[list[int]]) -> None:
    port = free_port()
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--master-port", str(port)]
    node1 = subprocess.Popen(
        [sys.executable, "-m", "launch", *common, "--node-rank", "1", "--model", "dummy:tiny"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        node0 = _run([*common, "--node-rank", "0", *WORKLOAD, "--json"])
        assert _tokens(node0) == tp2_tokens
        assert node1.wait(timeout=30) == 0, node1.stderr.read() if node1.stderr else ""
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()
    assert wait_no_descendants(5) == []


def test_torchrun_workers_join_a_separate_scheduler(tp2_tokens: list[list[int]]) -> None:
    port = free_port()
    config = EngineConfig(model="dummy:tiny", tensor_parallel_size=2)
    env = dict(os.environ, TANDEM_CONFIG=msgspec.json.encode(config).decode())
    torchrun = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            "-m",
            "workers",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        engine = _run(
            [
                "--engine-only",
                "--nproc-per-node",
                "2",
                "--master-port",
                str(port),
                *WORKLOAD,
                "--json",
            ]
        )
        assert _tokens(engine) == tp2_tokens
        assert torchrun.wait(timeout=30) == 0, torchrun.stderr.read() if torchrun.stderr else ""
    finally:
        if torchrun.poll() is None:
            os.killpg(torchrun.pid, signal.SIGKILL)
            torchrun.wait()
    assert wait_no_descendants(5) == []


def test_killed_worker_fails_the_run_fast_and_leaves_nothing() -> None:
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "launch",
            "--nproc-per-node",
            "2",
            "--model",
            "dummy:tiny",
            "--num-prompts",
            "8",
            "--input-len",
            "16",
            "--output-len",
            "2000",
            "--max-model-len",
            "2048",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        victim = _wait_for_worker(launcher.pid, rank=1, timeout_s=60)
        time.sleep(1.0)  # let generation get going
        all_before = descendants(launcher.pid)
        os.kill(victim, signal.SIGKILL)
        t0 = time.monotonic()
        code = launcher.wait(timeout=30)
        exit_s = time.monotonic() - t0
        err = launcher.stderr.read() if launcher.stderr else ""
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert code != 0
    assert "worker rank 1" in err and "SIGKILL" in err, err[-2000:]
    print(f"launcher exited {exit_s:.3f} s after the worker was killed")
    assert [p for p in all_before if _alive(p)] == []


def _alive(pid: int) -> bool:
    from tests.helpers.procs import pid_alive

    return pid_alive(pid)


def _wait_for_worker(root: int, rank: int, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for pid in descendants(root):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = f.read().split(b"\0")
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read()
            except OSError:
                continue
            if b"workers" in cmd and f"RANK={rank}".encode() in env:
                return pid
        time.sleep(0.1)
    raise TimeoutError(f"worker rank {rank} did not start")
