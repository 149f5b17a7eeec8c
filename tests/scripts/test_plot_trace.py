"""plot_trace.py draws a PNG from a scheduler trace and prints its JSON summary last."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "engine_core"))

from fake_worker import FakeWorker, make_request, make_scheduler, run_to_completion  # noqa: E402


def test_plot_trace_writes_a_png(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    s = make_scheduler(
        num_blocks=16, max_num_batched_tokens=16, block_size=4, scheduler_trace=str(trace)
    )
    for i in range(8):
        s.add_request(make_request(f"r{i}", [20 + i, 21, 22, 23, 24] * 2, max_tokens=20))
    run_to_completion(s, FakeWorker(4))
    s.close()
    png = tmp_path / "timeline.png"
    proc = subprocess.run(
        [sys.executable, "scripts/plot_trace.py", str(trace), "--out", str(png), "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "MPLBACKEND": "Agg"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out["out"] == str(png) and out["requests"] == 8 and out["steps"] > 0
    assert out["preemptions"] > 0 and 0 < out["peak_kv_usage"] <= 1
