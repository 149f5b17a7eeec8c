"""scripts/bench_structured.py end to end on a micro model: both workloads run at each batch,
the compile timings and wire bytes are reported, and a constrained request adds nothing to the
steady decode diff (no timing thresholds)."""

from __future__ import annotations

import os
import sys

import pytest

from tests.helpers.procs import wait_no_descendants
from tests.scripts.test_bench_scripts import run_script

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "serve"))
from serve_helpers import make_tokenizer_dir  # noqa: E402


def test_bench_structured_reports(tmp_path) -> None:
    pytest.importorskip("xgrammar")
    tok = make_tokenizer_dir(str(tmp_path / "tok"))
    try:
        res = run_script("bench_structured.py", "--model", "dummy:micro", "--tokenizer", tok,
                         "--batches", "1,4", "--output-len", "8", "--repeats", "1",
                         timeout_s=240.0)
    finally:
        assert wait_no_descendants(10) == []
    for b in (1, 4):
        plain, constrained = res[f"step_ms_plain_b{b}"], res[f"step_ms_json_b{b}"]
        assert res[f"overhead_b{b}"] == pytest.approx(constrained / plain - 1.0)
        # worker-side matchers: the steady decode diff carries no bitmask
        assert res[f"decode_diff_bytes_b{b}"] < res[f"decode_diff_bytes_scheduler_side_b{b}"]
    # a constraint costs bytes only when its request arrives
    assert res["new_request_bytes_constrained_b1"] > res["new_request_bytes_plain_b1"]
    # compile times are reported, not bounded (timings are the benchmark's to report)
    for key in ("compile_cold_ms", "compile_cold_table_built_ms", "compile_cached_ms"):
        assert isinstance(res[key], float), key
