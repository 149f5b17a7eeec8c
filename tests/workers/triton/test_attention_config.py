"""The attention launch table: per-arch rows, and the split-key grid sized from the SM count."""

from __future__ import annotations

from workers.attention.backends.triton import num_segments
from workers.triton_ops.attention_config import MAX_SEGMENTS, arch_of, attention_config


def test_rows_differ_by_arch_and_pipeline_kv() -> None:
    assert arch_of((9, 0)) == 90 and arch_of((8, 9)) == 80 and arch_of((7, 5)) == 0
    assert arch_of(None) == 0
    h100 = attention_config(128, "bfloat16", 90, decode=False)
    a100 = attention_config(128, "bfloat16", 80, decode=False)
    assert h100 != a100  # sm_80 runs smaller prefill tiles: its registers spilled otherwise
    for arch in (80, 90):
        for decode in (True, False):
            for hd in (64, 128, 256):
                # 3 stages = two K/V buffers with the block ids read one tile ahead
                assert attention_config(hd, "float16", arch, decode).num_stages >= 3


def test_small_batches_split_keys_until_the_sms_are_busy() -> None:
    ppsm = attention_config(128, "bfloat16", 90, decode=True).programs_per_sm
    # 1 request x 8 KV heads on 132 SMs: 8 programs, split 16 ways (capped)
    assert num_segments(1, 8, 1, 4, 16, 132, ppsm) == MAX_SEGMENTS
    # 64 requests x 8 KV heads = 512 programs: 528 wanted, so 2 segments
    assert num_segments(64, 8, 1, 4, 16, 132, ppsm) == 2
    # a prefill chunk is never split
    assert num_segments(1, 8, 512, 4, 64, 132, ppsm) == 1
