"""scripts/bench_grammar_cache.py on the cache alone (no server): new schemas past a 1 MiB
budget are evicted and the figures are reported (no timing or memory thresholds here: the
plateau itself is tested in tests/structured/test_grammar_cache.py)."""

from __future__ import annotations

import pytest

from tests.scripts.test_bench_scripts import run_script


def test_bench_grammar_cache_reports() -> None:
    pytest.importorskip("xgrammar")
    res = run_script("bench_grammar_cache.py", "--count", "40", "--cache-mb", "1",
                     timeout_s=240.0)
    assert res["count"] == 40 and res["cache_mb"] == 1
    assert 0 < res["cache_bytes"] <= 2**20 and res["cache_evictions"] > 0
    assert res["cache_grammars"] + res["cache_evictions"] == 40
    assert {"frontend_rss_first_kb", "frontend_rss_last_kb", "frontend_plateau"} <= set(res)
