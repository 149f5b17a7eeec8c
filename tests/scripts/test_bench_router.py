"""scripts/bench_router.py end to end at a tiny size: two replicas behind the real vllm-router,
every policy runs every request, and the JSON has its keys (no timing thresholds)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import Any

import pytest

from tests.helpers.procs import wait_no_descendants
from tests.scripts.test_bench_scripts import ROOT, SCRIPTS
from tests.serve.router_helpers import ROUTER

pytestmark = [
    pytest.mark.slow,  # two engines and a router per policy
    pytest.mark.skipif(ROUTER is None, reason="the vllm-router binary is not installed"),
]


def run_bench(*argv: str, timeout_s: float) -> dict[str, Any]:
    """The script in its own session; past the timeout SIGTERM first (it stops its servers and
    router, which run in sessions of their own), then SIGKILL."""
    proc = subprocess.Popen([sys.executable, os.path.join(SCRIPTS, "bench_router.py"), *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_bench_router_policies() -> None:
    try:
        res = run_bench("--conversations", "2", "--turns", "2", "--system-words", "8",
                        "--first-words", "40", "--turn-words", "4", "--max-tokens", "2",
                        timeout_s=300.0)
    finally:
        assert wait_no_descendants(10) == []
    for policy in ("round_robin", "cache_aware", "kv_aware"):
        assert res[f"{policy}_requests"] == 4 and res[f"{policy}_errors"] == 0
        for key in ("req_per_s", "output_tok_per_s", "ttft_median_ms", "ttft_p99_ms"):
            assert res[f"{policy}_{key}"] > 0
        assert 0.0 <= res[f"{policy}_prefix_hit_rate"] <= 1.0
    # the second turn extends the first: the router credits it the prefix its events reported
    assert res["kv_aware_credited_prefix_tokens_mean"] > 0
