"""Benchmark scripts: each runs at a tiny size and prints its JSON keys last; helpers are exact.

The scripts start real engine processes; every run is a subprocess in its own session, killed
(with everything it started) in a finally, and no test may leave a process behind.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from tests.helpers.procs import wait_no_descendants

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = os.path.join(ROOT, "scripts")
sys.path.insert(0, SCRIPTS)

import bench_common  # noqa: E402
import bench_serve  # noqa: E402
import serve_load  # noqa: E402

TINY = ["--model", "dummy:micro", "--kv-cache-memory", "16M", "--input-len", "8",
        "--output-len", "4"]  # fmt: skip


@pytest.fixture
def no_leftovers() -> Iterator[None]:
    yield
    assert wait_no_descendants(10) == []


def run_script(name: str, *argv: str, timeout_s: float = 120.0) -> dict[str, Any]:
    """Run scripts/<name> with --json; returns the parsed last stdout line."""
    proc = subprocess.Popen(
        [sys.executable, os.path.join(SCRIPTS, name), *argv, "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        start_new_session=True,  # its own process group: one killpg takes its children too
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert proc.returncode == 0, err[-3000:]
    lines = out.strip().splitlines()
    assert lines, err[-3000:]
    return json.loads(lines[-1])


# ---------------------------------------------------------------------------- helpers


def test_percentile_matches_numpy_linear() -> None:
    sample = [15.0, 20.0, 35.0, 40.0, 50.0, 7.5, 3.0]
    for q in (0, 1, 25, 50, 75, 90, 95, 99, 100):
        assert bench_common.percentile(sample, q) == pytest.approx(np.percentile(sample, q))
    assert bench_common.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert bench_common.percentile([5.0], 99) == 5.0
    assert math.isnan(bench_common.percentile([], 50))


def test_distribution_keys_and_scale() -> None:
    d = bench_common.distribution([0.001, 0.002, 0.003], "ttft", "ms", 1e3)
    assert d["ttft_mean_ms"] == pytest.approx(2.0)
    assert d["ttft_median_ms"] == pytest.approx(2.0)
    assert d["ttft_p99_ms"] == pytest.approx(np.percentile([1, 2, 3], 99))
    assert set(d) == {f"ttft_{s}_ms" for s in ("mean", "median", "p90", "p95", "p99")}


def test_breakdown_summary_non_forward_fraction() -> None:
    cols = bench_common.COLUMNS
    row = dict.fromkeys(cols, 0.0)
    # step wall = 10 + 5 + 5 + 70 + 5 + 5 = 100 µs, forward 60 µs -> 40% is not forward
    row.update(schedule_us=10, encode_us=5, broadcast_us=5, wait_us=70, update_us=5, emit_us=5)
    row.update(worker_forward_us=60, worker_prep_us=4, worker_sample_us=3, num_tokens=8)
    row.update(worker_hidden_us=3, worker_exposed_us=1)
    rows = []
    for i in range(3):  # back to back, 100 µs each
        row.update(start_s=1.0 + i * 100e-6, end_s=1.0 + (i + 1) * 100e-6)
        rows.append([row[c] for c in cols])
    s = bench_common.breakdown_summary(rows)
    assert s["non_forward_fraction"] == pytest.approx(0.4)
    assert s["steps"] == 3
    assert s["worker_forward_median_us"] == 60
    assert s["step_wall_median_us"] == pytest.approx(100)
    assert s["exposed_host_median_us"] == pytest.approx(40)
    assert s["worker_hidden_median_us"] == 3 and s["worker_hidden_fraction"] == 0.75
    # async: each step was planned while the one before ran (start before the previous end),
    # ends 70 µs apart: its wall time is 70, not its 140 µs from start to end
    rows = []
    for i in range(3):
        row.update(start_s=1.0 + i * 70e-6, end_s=1.0 + 140e-6 + i * 70e-6)
        rows.append([row[c] for c in cols])
    s = bench_common.breakdown_summary(rows)
    assert s["step_wall_median_us"] == pytest.approx(70)
    assert s["exposed_host_median_us"] == pytest.approx(10)
    assert math.isnan(bench_common.breakdown_summary([])["non_forward_fraction"])


def test_arrivals_and_slo_parsing() -> None:
    assert serve_load.arrival_offsets(4, math.inf, 1.0, 0) == [0.0] * 4
    offs = serve_load.arrival_offsets(4000, 50.0, 1.0, 0)
    assert offs == sorted(offs) and offs[0] == 0.0
    assert offs[-1] / (len(offs) - 1) == pytest.approx(1 / 50, rel=0.1)  # mean gap = 1 / rate
    bursty = serve_load.arrival_offsets(4000, 50.0, 0.25, 0)
    assert bursty[-1] / (len(bursty) - 1) == pytest.approx(1 / 50, rel=0.2)
    assert bench_serve.parse_slo("ttft=200,tpot=50") == {"ttft": 200.0, "tpot": 50.0}
    with pytest.raises(Exception, match="bad SLO"):
        bench_serve.parse_slo("speed=1")


# ---------------------------------------------------------------------------- the scripts


def test_bench_throughput_breakdown_profile_tp2(tmp_path: Any, no_leftovers: None) -> None:
    prof = tmp_path / "prof"
    res = run_script(
        "bench_throughput.py", *TINY, "-tp", "2", "--num-prompts", "4",
        "--warmup-prompts", "1", "--breakdown", "--profile", str(prof),
        "--peak-tflops", "1", "--peak-bandwidth-gbs", "10",
    )  # fmt: skip
    for k in ("requests_per_s", "input_tokens_per_s", "output_tokens_per_s", "total_s"):
        assert res[k] > 0
    assert (res["peak_tflops"], res["peak_bandwidth_gbs"], res["peak_source"]) == (1, 10, "flags")
    assert res["roofline_fraction"] == pytest.approx(res["roofline_floor_s"] / res["total_s"])
    assert res["output_tokens"] == 16 and res["input_tokens"] == 32
    assert 0.0 <= res["non_forward_fraction"] <= 1.0
    assert res["steps"] >= 4 and res["worker_forward_median_us"] > 0
    # rank 0's host time between launches: on CPU none of it hides behind the device
    assert res["worker_exposed_median_us"] > 0 and res["worker_hidden_fraction"] == 0.0
    timeline = json.loads((prof / "step_timeline.json").read_text())
    assert timeline["columns"] == bench_common.COLUMNS
    assert len(timeline["rows"]) == res["steps"]
    for r in (0, 1):
        trace = json.loads((prof / f"trace_rank{r}.json").read_text())
        assert trace["traceEvents"]


def test_bench_latency(no_leftovers: None) -> None:
    res = run_script(
        "bench_latency.py", *TINY, "--batch-size", "2", "--num-iters", "3",
        "--num-iters-warmup", "1",
    )  # fmt: skip
    assert len(res["latencies_s"]) == 3
    assert res["latency_p50_s"] == pytest.approx(np.percentile(res["latencies_s"], 50))
    assert res["latency_p99_s"] >= res["latency_p50_s"] > 0
    assert res["latency_mean_s"] > 0 and res["latency_p90_s"] > 0
    # roofline of one iteration, peaks measured on this CPU
    assert res["peak_source"] == "measured" and res["roofline_device"] == "cpu"
    assert res["peak_tflops"] > 0 and res["peak_bandwidth_gbs"] > 0
    assert res["roofline_floor_s"] > 0
    assert res["roofline_fraction"] == pytest.approx(res["roofline_floor_s"] / res["latency_p50_s"])


def test_bench_serve_poisson_and_concurrency(no_leftovers: None) -> None:
    res = run_script(
        "bench_serve.py", *TINY, "--num-prompts", "6", "--request-rate", "50",
        "--max-concurrency", "3", "--slo", "ttft=60000,tpot=60000", "--breakdown",
    )  # fmt: skip
    assert res["completed"] == 6 and res["failed"] == 0
    for m in ("ttft", "tpot", "itl", "e2el"):
        for s in ("mean", "median", "p90", "p95", "p99"):
            assert res[f"{m}_{s}_ms"] > 0
    assert res["total_output_tokens"] == 24
    assert res["request_throughput"] > 0 and res["output_tokens_per_s"] > 0
    assert res["goodput_rps"] == pytest.approx(res["request_throughput"])  # generous SLOs
    assert 0.0 <= res["non_forward_fraction"] <= 1.0


def test_sweep_writes_json(tmp_path: Any, no_leftovers: None) -> None:
    out = tmp_path / "sweep.json"
    res = run_script(
        "sweep.py", "--tp", "1", "--batch-sizes", "2", "--out", str(out), "--no-plot",
        *TINY, "--warmup-prompts", "0", timeout_s=180,
    )  # fmt: skip
    assert json.loads(out.read_text())["points"] == res["points"]
    (point,) = res["points"]
    assert point["tensor_parallel_size"] == 1 and point["batch_size"] == 2
    assert point["output_tokens_per_s"] > 0 and point["tpot_median_ms"] > 0
    assert res["png_path"] is None
