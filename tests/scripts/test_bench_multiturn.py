"""scripts/bench_multiturn.py end to end on a micro model: every mode runs, the tokens agree,
the tiers were used, and the JSON has the keys the README quotes (no timing thresholds)."""

from __future__ import annotations

import pytest

from tests.helpers.procs import wait_no_descendants
from tests.scripts.test_bench_scripts import run_script


def test_bench_multiturn_modes() -> None:
    try:
        res = run_script(
            "bench_multiturn.py", "--model", "dummy:micro", "--num-conversations", "8",
            "--turns", "2", "--first-len", "64", "--turn-len", "8", "--output-len", "4",
            "--modes", "recompute,host,disk", "--runs", "1", "--disk-host-memory", "32K",
            timeout_s=240.0,
        )  # fmt: skip
    finally:
        assert wait_no_descendants(10) == []
    assert res["outputs_match"] is True
    assert res["device_fraction_of_live_kv"] < 0.25
    for mode in ("recompute", "host", "disk"):
        for key in ("returning_ttft_median_ms", "returning_ttft_p99_ms", "total_s"):
            assert res[f"{mode}_{key}"] > 0
    assert res["host_kv_offload_host_hits"] > 0 and res["host_kv_offload_restored_tokens"] > 0
    assert res["disk_kv_offload_disk_hits"] > 0
    # What the tiers are for: the device pool alone keeps no conversation's prefix until it
    # returns, so recompute prefills every history again; with a tier the returning turns'
    # prefixes come back as cache hits, every restored token among them, each restored block
    # one the tier reserved for a restore.
    block = res["block_size"]
    assert res["recompute_prefix_cache_hits"] == 0
    for mode in ("host", "disk"):
        restored = res[f"{mode}_kv_offload_restored_tokens"]
        assert 0 < restored <= res[f"{mode}_prefix_cache_hits"]
        assert restored % block == 0
        assert restored <= res[f"{mode}_kv_offload_host_hits"] * block
    # the reported ratio is recompute's returning TTFT over the tier's (one round: itself)
    assert res["host_returning_ttft_speedup"] == pytest.approx(
        res["recompute_returning_ttft_median_ms"] / res["host_returning_ttft_median_ms"])
