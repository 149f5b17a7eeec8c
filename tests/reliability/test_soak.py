"""CI-sized soak: scripts/soak.py at a small size loses nothing and leaks no KV block.

RSS growth is reported, not asserted: at this size allocator warm-up dominates it (the 10,000
request run in the README is the real check).
"""

from __future__ import annotations

import importlib.util
import pathlib

from tests.helpers.procs import wait_no_descendants

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "soak.py"


def test_small_soak_loses_nothing() -> None:
    spec = importlib.util.spec_from_file_location("soak", SCRIPT)
    assert spec is not None and spec.loader is not None
    soak = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(soak)
    try:
        res = soak.main(
            [
                "--n",
                "40",
                "--wave",
                "20",
                "--max-prompt",
                "48",
                "--max-out",
                "8",
                "--num-gpu-blocks",
                "16",
                "--json",
            ]
        )
    finally:
        assert wait_no_descendants(10) == []
    print(f"\nsoak: {res}")
    assert res["lost_requests"] == 0
    assert res["leaked_blocks"] == 0
    assert sum(res["finish_reasons"].values()) == 40
    assert set(res["rss_growth_pct_per_process"]) == {"frontend", "engine core", "worker rank 0"}
