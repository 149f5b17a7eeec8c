"""bench_attention.py prints one JSON object last, with a figure per backend that ran."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_attention_json():
    out = subprocess.run(
        [sys.executable, "scripts/bench_attention.py", "--device", "cpu", "--dtype", "float32",
         "--num-reqs", "3", "--context", "20", "--heads", "4", "--kv-heads", "2",
         "--head-dim", "16", "--iters", "2", "--backends", "torch", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["kv_bytes_per_call"] == 2 * 3 * 21 * 2 * 16 * 4
    assert result["torch_us"] > 0 and 0 <= result["torch_bandwidth_fraction"]
