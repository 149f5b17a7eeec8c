"""The component benchmarks (no model processes) run at a tiny size and print their JSON keys.

Figures are not checked: benchmarks report, tests check behaviour.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

CASES = {
    "profile_ipc.py": (
        ["--quick"],
        [
            "decode_step_bytes",
            "admit_bytes",
            "lifetime_bytes",
            "encode_us",
            "decode_us",
            "broadcast_p50_us",
            "broadcast_p99_us",
            "structured_decode_diff_bytes",
            "structured_decode_diff_bytes_scheduler_side",
            "pd_prefill_diff_bytes_per_request",
            "pd_decode_diff_bytes_per_request",
            "pd_report_bytes_per_request",
            "lora_prepare_lora_bytes",
            "lora_slot_op_bytes",
            "lora_base_request_extra_bytes",
            "lora_adapter_request_extra_bytes",
            "lora_decode_step_bytes_adapters",
        ],
    ),
    "bench_scheduler.py": (
        ["--num-requests", "32", "--steps", "20", "--warmup", "5"],
        ["us_per_step", "schedule_us", "update_us"],
    ),
    "bench_worker.py": (
        ["--num-reqs", "16", "--steps", "10", "--runs", "1"],
        ["prep_us", "naive_prep_us"],
    ),
    "bench_lora.py": (
        ["--model", "dummy:micro", "--repeats", "1", "--warmup", "0", "--decode-steps", "1"],
        ["decode64_cpu_enabled_base_vs_disabled_pct", "decode64_cpu_adapters_8_vs_disabled_pct",
         "cold_load_ms", "warm_swap_ms", "thrash_16_over_8_step_ms"],
    ),
}


@pytest.mark.parametrize("script", list(CASES))
def test_component_bench_prints_json(script: str) -> None:
    args, keys = CASES[script]
    proc = subprocess.run(
        [sys.executable, f"scripts/{script}", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for k in keys:
        assert isinstance(out[k], (int, float)), k
