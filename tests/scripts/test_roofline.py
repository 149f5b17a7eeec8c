"""Roofline arithmetic against a case computed by hand."""

from __future__ import annotations

import argparse
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))

from roofline import ModelShape, peaks, prefill_flops, workload_floor  # noqa: E402

# 2 layers, hidden 4, 2 query heads / 1 KV head of dim 2, MLP 8, vocab 10.
# Per layer: q 4x4=16, k 4x2=8, v 8, o 16, gate/up/down 4x8=32 each -> 144; x2 layers = 288.
# LM head 10x4 = 40; norms (2*2+1)*4 = 20.
SHAPE = ModelShape(num_layers=2, hidden=4, q_heads=2, kv_heads=1, head_dim=2, intermediate=8,
                   vocab=10)


def test_shape_counts() -> None:
    assert SHAPE.layer_linear_params == 144 and SHAPE.linear_params == 288
    assert SHAPE.lm_head_params == 40 and SHAPE.norm_params == 20
    assert SHAPE.weight_bytes_per_step(2) == (288 + 40 + 20) * 2 == 696
    assert SHAPE.kv_bytes_per_token(2) == 2 * 2 * 1 * 2 * 2 == 16
    assert SHAPE.attn_flops_per_key == 4 * 2 * 2 * 2 == 32


def test_prefill_flops_by_hand() -> None:
    # 3 tokens: linear 2*288*3 = 1728; attention 32 * (1+2+3) = 192; LM head once 2*40 = 80
    assert prefill_flops(SHAPE, 3) == 1728 + 192 + 80 == 2000


def test_workload_floor_by_hand() -> None:
    # One request, 3 tokens in, 3 out: the prefill gives token 1, decode steps j=1,2 attend to
    # 4 and 5 keys. At 1000 FLOP/s and 100 B/s:
    #   prefill 2000 FLOPs -> 2.0 s
    #   step 1: bytes 696 + 16*4 = 760 -> 7.6 s; FLOPs 2*(288+40) + 32*4 = 784 -> 0.784 s
    #   step 2: bytes 696 + 16*5 = 776 -> 7.76 s
    f = workload_floor(SHAPE, [3], [3], max_batch=8, dtype_bytes=2, peak_flops=1000.0,
                       peak_bytes_per_s=100.0)
    assert f.prefill_flops == 2000 and f.prefill_s == pytest.approx(2.0)
    assert f.decode_bytes == 760 + 776 and f.decode_flops == 784 + 816
    assert f.decode_s == pytest.approx(7.6 + 7.76)
    assert f.total_s == pytest.approx(17.36)


def test_batching_shares_weight_reads_and_devices_split_work() -> None:
    # Two such requests in one wave: each step reads the weights once, both contexts.
    f = workload_floor(SHAPE, [3, 3], [3, 3], max_batch=2, dtype_bytes=2, peak_flops=1000.0,
                       peak_bytes_per_s=100.0)
    assert f.decode_s == pytest.approx((696 + 2 * 64) / 100 + (696 + 2 * 80) / 100)
    # One at a time: twice the single-request floor.
    g = workload_floor(SHAPE, [3, 3], [3, 3], max_batch=1, dtype_bytes=2, peak_flops=1000.0,
                       peak_bytes_per_s=100.0)
    assert g.total_s == pytest.approx(2 * 17.36)
    # Compute-bound when FLOPs are slow: max() picks the FLOP time; two devices halve it.
    h = workload_floor(SHAPE, [3], [2], max_batch=1, dtype_bytes=2, peak_flops=1.0,
                       peak_bytes_per_s=1e9, num_devices=2)
    assert h.prefill_s == pytest.approx(1000.0) and h.decode_s == pytest.approx(784 / 2)


def test_peaks_from_flags_are_not_measured() -> None:
    args = argparse.Namespace(peak_tflops=989.0, peak_bandwidth_gbs=3350.0, dtype="bfloat16")
    assert peaks(args, "cuda:0") == (989e12, 3350e9, "flags")
