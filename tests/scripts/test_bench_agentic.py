"""scripts/bench_agentic.py end to end on a micro model: fcfs and continuum run in fresh
engines, their tokens agree, pins are made and claimed, and the JSON has the keys the README
quotes (no timing thresholds)."""

from __future__ import annotations

import pytest

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
    # Every turn's prompt is the job's whole context so far: the same prompts in both modes.
    prompt_tokens = 3 * sum(64 + k * (4 + 8) for k in range(3))
    for mode in ("fcfs", "continuum"):
        recomputed = res[f"{mode}_recomputed_tokens"]
        assert 0 < recomputed <= prompt_tokens
        assert res[f"{mode}_prefix_hit_rate"] == pytest.approx(1 - recomputed / prompt_tokens)
    # Pins were made and claimed, and what the claims saved was served from the prefix cache:
    # the engine's count of pinned tokens reused is at most the prompt tokens the frontend saw
    # come back cached (a claim happens at a turn's first admission, where its hit is counted).
    pins = {k: res[f"continuum_continuum_{k}"] for k in (
        "pins_created", "pins_skipped", "pin_hits", "pin_expiries", "pressure_releases",
        "tokens_saved")}
    assert pins["pin_hits"] > 0 and pins["tokens_saved"] > 0
    assert pins["tokens_saved"] <= prompt_tokens - res["continuum_recomputed_tokens"]
    # a pin ends once (claimed, expired or released under pressure, among other ends), and
    # only a turn that is not a job's last can leave one (3 jobs x 2 such turns)
    assert pins["pin_hits"] + pins["pin_expiries"] + pins["pressure_releases"] \
        <= pins["pins_created"]
    assert pins["pins_created"] + pins["pins_skipped"] <= 3 * 2
    # the reported ratio is fcfs JCT over continuum JCT (one round: the ratio itself)
    assert res["continuum_jct_speedup_vs_fcfs"] == pytest.approx(
        res["fcfs_avg_jct_s"] / res["continuum_avg_jct_s"])
