"""scripts/overload.py at a small size: the JSON it reports has every key, nothing failed, the
counts add up and every per-request map is back to its idle size (no timing thresholds)."""

from __future__ import annotations

from tests.helpers.procs import wait_no_descendants
from tests.scripts.test_bench_scripts import run_script


def test_overload_reports_and_comes_back_to_idle() -> None:
    try:
        res = run_script("overload.py", "--duration", "4", "--ramp-s", "1", "--idle", "0.5",
                         "--max-num-seqs", "4", "--max-queued-requests", "4",
                         "--output-len", "8", timeout_s=300.0)
    finally:
        assert wait_no_descendants(10) == []
    for key in ("served", "refused", "failed", "p99_latency_s", "rss_mb", "free_blocks",
                "maps_after", "maps_back_to_idle"):
        assert key in res, key
    assert res["failed"] == 0, res["failure_kinds"]
    assert res["served"] > 0
    assert res["served"] + res["refused"] + res["aborted"] == res["sent"]
    assert res["maps_back_to_idle"] is True and res["leftovers"] == {}
    assert res["free_blocks"]["after"] == res["free_blocks"]["idle_before"]
    assert set(res["maps_after"]) == {"frontend", "engine_core", "rank0"}
    assert set(res["rss_mb"]) == {"frontend", "engine core", "worker rank 0"}
    for figures in res["rss_mb"].values():
        assert 0 < figures["start"] <= figures["peak"]
