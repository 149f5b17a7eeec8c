"""Shared-memory TP collectives between real processes, checked against gloo's."""

from __future__ import annotations

import glob
import json
import os
import socket
import subprocess
import sys

import pytest

from workers import cpu_ops

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(cpu_ops.ops() is None, reason="no C++ compiler: kernels off"),
]
HELPER = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                      "helpers", "shm_run.py")


def _run(tmp_path, mode: str, world: int, timeout_s: float = 60) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    before = set(glob.glob("/dev/shm/tandem-tp-*"))
    procs = []
    try:
        for rank in range(world):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
            procs.append(subprocess.Popen([sys.executable, HELPER, mode, str(tmp_path)], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        for rank, p in enumerate(procs):
            out, _ = p.communicate(timeout=timeout_s)
            assert p.returncode == 0, f"rank {rank}:\n{out.decode()}"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    # The segment is unlinked once mapped: nothing is left in /dev/shm.
    assert set(glob.glob("/dev/shm/tandem-tp-*")) <= before
    ranks = [0] if mode == "die" else range(world)  # in "die" rank 1 leaves without a result
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in ranks]


@pytest.mark.parametrize("world", [2, 3])
def test_all_reduce_and_all_gather_match_gloo(tmp_path, world):
    results = _run(tmp_path, "ok", world)
    for r in results:
        assert r["shm"]
        for key, err in r["reduce_err"].items():
            # 2 ranks: a + b is exact in any order; bf16 rounds once here, per step in gloo.
            tol = 0.0 if (world == 2 and "float32" in key) else (1e-5 if "float32" in key else 0.07)
            assert err <= tol, (key, err)
        assert r["identical"]
        assert r["gather"] == [[float(i), 10.0 * i] for i in range(world)]
        assert r["big_gather_equal"]


def test_dead_peer_raises_instead_of_hanging(tmp_path):
    (r0,) = _run(tmp_path, "die", 2)
    assert r0["shm"]
    assert r0["error"] and "rank 1" in r0["error"] and "died" in r0["error"]
