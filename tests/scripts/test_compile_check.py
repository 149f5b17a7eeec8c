"""CI's compile check: the representative subset of the Triton kernels compiles for sm_90
without spills in bf16 and with tensor-core attention (the full set: scripts/compile_check.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_triton_kernels_compile_for_sm90_without_spills() -> None:
    pytest.importorskip("triton")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "compile_check.py"),
                           "--quick"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "paged_attention" in proc.stdout and "FAIL" not in proc.stdout
    assert "lora_shrink" in proc.stdout and "lora_expand" in proc.stdout
