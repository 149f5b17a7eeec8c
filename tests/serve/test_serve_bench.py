"""scripts/bench_serve.py --base-url against a real server: one JSON object last, every request
completed, the token counts exact; --with-python-api adds the same workload through LLM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import Any

import pytest
from serve_helpers import ROOT, serve

ENGINE = ["--model", "dummy:micro", "--kv-cache-memory", "16M"]


def run_bench(*argv: str, timeout_s: float = 240.0) -> dict[str, Any]:
    proc = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "scripts", "bench_serve.py"), *argv, "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_bench_serve_base_url(tmp_path: Any) -> None:
    with serve(*ENGINE, "--served-model-name", "m", log_dir=str(tmp_path)) as server:
        res = run_bench(
            "--base-url", server.base_url + "/v1", *ENGINE, "--vocab-size", "512",
            "--num-prompts", "12", "--input-len", "8", "--output-len", "5",
            "--request-rate", "40", "--max-concurrency", "4", "--slo", "ttft=60000",
            "--with-python-api",
        )
    assert res["served_model_name"] == "m" and res["model_root"] == "dummy:micro"
    assert res["completed"] == 12 and res["failed"] == 0
    assert res["total_output_tokens"] == 60
    for m in ("ttft", "tpot", "itl", "e2el"):
        assert res[f"{m}_median_ms"] > 0 and res[f"{m}_p99_ms"] >= res[f"{m}_median_ms"]
    assert res["goodput_rps"] == pytest.approx(res["request_throughput"])
    py = res["python_api"]
    assert py["completed"] == 12 and py["total_output_tokens"] == 60
    assert res["http_over_python_throughput"] > 0
