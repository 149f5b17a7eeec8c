"""bench_pd.py at a tiny size: the transfer figures name their baselines and are quotients of
what the run measured; the P/D comparison reports both sides, with the ratios it claims.
Figures are not checked (benchmarks report, tests check behaviour)."""

from __future__ import annotations

import math

import pytest

from tests.helpers.procs import wait_no_descendants
from tests.scripts.test_bench_scripts import run_script


def test_transfer_figures_name_their_baselines() -> None:
    out = run_script("bench_pd.py", "--quick", "--transfers-only", timeout_s=180)
    t = out["transfers"]
    for name, base in (("tcp", "raw_socket_gbps"), ("shm", "memcpy_gbps")):
        r = t[name]
        assert r["baseline"] == base and r["bytes"] == t["kv_bytes_per_transfer"]
        assert math.isclose(r["gbps"], r["bytes"] / r["seconds"] / 1e9)
        assert math.isclose(r["of_baseline"], r["gbps"] / t[base])
        assert t[f"{name}_scattered_gbps"] > 0
    assert wait_no_descendants(10) == []


@pytest.mark.slow  # three engines, one after the other
def test_pd_against_one_engine() -> None:
    out = run_script("bench_pd.py", "--quick", timeout_s=600)
    split = out["ttft_split"]
    assert split["prompt_len"] == out["config"]["prompt_len"]
    pd, mono = out["pd_1p1d"], out["single_tp2"]
    assert pd["errors"] == 0 and mono["errors"] == 0
    # every request's KV came over (the TTFT split's requests and the load's)
    assert pd["transfers"] == out["config"]["num_requests"] + 3
    assert math.isclose(out["tpot_p99_ratio_pd_over_single"],
                        pd["tpot_p99_ms"] / mono["tpot_p99_ms"])
    assert math.isclose(out["throughput_ratio_pd_over_single"],
                        pd["throughput_tok_s"] / mono["throughput_tok_s"])
    assert wait_no_descendants(10) == []
