"""scripts/bench_agentic.py end to end on a micro model: fcfs and continuum run in fresh
engines, their tokens agree, pins are made and claimed, and the JSON has the keys the README
quotes (no timing thresholds)."""

from __future__ import annotations

from tests.helpers.procs import wait_no_descendants
from tests.scripts.test_bench_scripts import run_script


def test_bench_agentic_modes() -> None:
    try:
        res = run_script(
            "bench_agentic.py", "--model", "dummy:micro", "--num-jobs", "3", "--turns", "3",
            "--arrival-rate", "20", "--first-len", "64", "--tool-len", "8", "--output-len", "4",
            "--short-tools", "0.05,0.1", "--long-share", "0", "--device-fraction", "0.5",
            "--modes", "fcfs,continuum", "--runs", "1",
            timeout_s=240.0,
        )  # fmt: skip
    finally:
        assert wait_no_descendants(10) == []
    assert res["outputs_match"] is True
    for mode in ("fcfs", "continuum"):
        for key in ("avg_jct_s", "p90_jct_s", "throughput_jobs_per_s"):
            assert res[f"{mode}_{key}"] > 0
        assert len(res[f"{mode}_jct_per_job_s"]) == 3
    assert res["continuum_continuum_pins_created"] > 0
    assert res["continuum_continuum_pin_hits"] > 0
    assert res["continuum_jct_speedup_vs_fcfs"] > 0
