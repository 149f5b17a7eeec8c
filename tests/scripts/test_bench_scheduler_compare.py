"""bench_scheduler.py --compare-trace runs trace off, trace on and a git revision's scheduler
in one run and prints their medians (figures are not checked: benchmarks report)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_compare_trace_prints_the_three_medians() -> None:
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                      timeout=30).returncode:
        pytest.skip("not a git checkout: --before-ref needs one")
    proc = subprocess.run(
        [sys.executable, "scripts/bench_scheduler.py", "--compare-trace", "--before-ref", "HEAD",
         "--rounds", "1", "--num-requests", "8", "--steps", "5", "--warmup", "2", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["case"] == "decode8" and out["rounds"] == 1
    # each variant ran once per round, and each reported median is that round's figure
    for variant in ("before", "off", "on"):
        runs = out["us_per_step_by_round"][variant]
        assert len(runs) == 1, variant
        assert out[f"{variant}_us_per_step"] == round(runs[0], 1), variant
    # the "on" variant really wrote its trace (bytes per step of the file it left)
    assert out["trace_bytes_per_step"] > 0


def test_compare_events_prints_both_medians() -> None:
    proc = subprocess.run(
        [sys.executable, "scripts/bench_scheduler.py", "--compare-events", "--rounds", "1",
         "--num-requests", "8", "--steps", "20", "--warmup", "2", "--prompt-len", "16",
         "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["case"] == "decode8" and out["rounds"] == 1
    for variant in ("off", "on"):
        assert out[f"{variant}_us_per_step"] == round(out["us_per_step_by_round"][variant][0], 1)
    # events really flowed in the "on" run: 8 decoding requests fill a 16-token block each
    # every 16 steps, so 20 measured steps store some
    assert out["events_per_step"] > 0
