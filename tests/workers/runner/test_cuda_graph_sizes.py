"""Which batch sizes the decode CUDA graphs are captured for (pure arithmetic, CPU)."""

from __future__ import annotations

import numpy as np

from workers.runner.cuda_graphs import capture_sizes, is_uniform_decode
from workers.runner.input_batch import BatchInputs


def test_capture_sizes():
    assert capture_sizes(256) == [1, 2, 4] + list(range(8, 257, 8))
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(1) == [1]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]


def _inputs(counts: list[int]) -> BatchInputs:
    t = sum(counts)
    qsl = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    return BatchInputs(
        rows=np.arange(len(counts)), num_scheduled=np.array(counts, dtype=np.int32),
        input_ids=np.zeros(t, dtype=np.int64), positions=np.zeros(t, dtype=np.int64),
        slot_mapping=np.zeros(t, dtype=np.int64), query_start_loc=qsl,
        seq_lens=np.array(counts, dtype=np.int32) + 10, block_table=np.zeros((len(counts), 1),
                                                                              dtype=np.int32),
        logits_indices=np.arange(t), sample_rows=np.arange(len(counts)),
        max_query_len=max(counts), max_seq_len=max(counts) + 10)


def test_uniform_decode_detection():
    assert is_uniform_decode(_inputs([1, 1, 1]), 1)
    assert is_uniform_decode(_inputs([4, 4]), 4)  # a token and 3 drafts each
    assert not is_uniform_decode(_inputs([1, 5]), 1)  # a prefill chunk in the step
    assert not is_uniform_decode(_inputs([1, 4]), 4)  # drafts rejected for one request
