"""What `--dtype auto` runs in on CPU.

bfloat16 halves the bytes a decode step reads, but only a CPU with native bf16 dot products
(avx512_bf16, AMX) computes it fast: elsewhere every bf16 matmul converts to float32 first and
runs several times slower than float32 itself. So auto picks bfloat16 only for a bf16 (or
fp16) checkpoint, on a CPU whose flags name native bf16, when a probe on this machine (the
model's layer shapes, a few runs) measures bf16 clearly faster; float32 everywhere else (a
float32 checkpoint, an AVX2-only machine). Every rank takes the slowest rank's verdict, so
tensor-parallel ranks never disagree. ``TANDEM_CPU_AUTO_DTYPE`` (float32 | bfloat16) overrides
the choice: the test suite pins float32, since its references are float32.
"""

from __future__ import annotations

import os
import time

import torch

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
MIN_SPEEDUP = 1.2  # a margin, so noise near a tie never flips the choice


def cpu_model_and_flags() -> tuple[str, list[str]]:
    """The CPU's model name and flags (/proc/cpuinfo; empty where there is none)."""
    model = ""
    flags: list[str] = []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = value.strip()
                elif key == "flags" and not flags:
                    flags = value.split()
                if model and flags:
                    break
    except OSError:
        pass
    return model, flags


def native_bf16(flags: list[str]) -> bool:
    return any(f in flags for f in NATIVE_BF16_FLAGS)


def bf16_speedup(hidden: int, tokens: int = 32, reps: int = 5) -> float:
    """float32 time / bfloat16 time of a decode-sized linear layer of this width."""
    h = max(256, min(hidden, 2048))  # bounded: the probe runs at every start-up
    x = torch.randn(tokens, h)
    w = torch.randn(4 * h, h)
    best = {}
    for dtype in (torch.float32, torch.bfloat16):
        xd, wd = x.to(dtype), w.to(dtype)
        torch.nn.functional.linear(xd, wd)  # warm-up (packing, thread pool)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            torch.nn.functional.linear(xd, wd)
            times.append(time.perf_counter() - t0)
        best[dtype] = min(times)
    return best[torch.float32] / max(best[torch.bfloat16], 1e-9)


def choose_cpu_dtype(checkpoint_dtype: str | None, hidden: int) -> tuple[str, str]:
    """(dtype, why) for `--dtype auto` on this CPU, as this rank sees it."""
    forced = os.environ.get("TANDEM_CPU_AUTO_DTYPE")
    if forced in ("float32", "bfloat16"):
        return forced, "TANDEM_CPU_AUTO_DTYPE"
    if checkpoint_dtype not in ("bfloat16", "float16"):
        return "float32", f"the checkpoint is {checkpoint_dtype or 'of no stated dtype'}"
    model, flags = cpu_model_and_flags()
    if not native_bf16(flags):
        return "float32", f"{model or 'this CPU'} has no native bf16 (avx512_bf16 / AMX)"
    speedup = bf16_speedup(hidden)
    if speedup < MIN_SPEEDUP:
        return "float32", f"bf16 measured {speedup:.2f}x float32's speed here"
    return "bfloat16", f"native bf16, measured {speedup:.2f}x float32's speed"
