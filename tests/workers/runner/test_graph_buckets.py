"""Which CUDA graph a step takes and how its inputs are padded (pure arithmetic, CPU)."""

from __future__ import annotations

import numpy as np

from workers.runner.cuda_graphs import dummy_inputs
from workers.runner.graph_buckets import (
    GraphPlan,
    capture_sizes,
    mixed_token_buckets,
    pad_to_uniform,
)
from workers.runner.input_batch import BatchInputs


def test_capture_sizes_and_token_buckets():
    assert capture_sizes(256) == [1, 2, 4] + list(range(8, 257, 8))
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(1) == [1]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert mixed_token_buckets(100) == [16, 32, 64, 100]
    assert mixed_token_buckets(16) == [16]


def _inputs(counts: list[int], ctx: int = 10, groups: int = 1) -> BatchInputs:
    t = sum(counts)
    qsl = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    lens = np.array(counts, dtype=np.int32) + ctx
    pos = np.concatenate([np.arange(ctx, ctx + c) for c in counts]).astype(np.int64)
    slots = 1000 + np.arange(t, dtype=np.int64)
    table = np.arange(1, 1 + 2 * len(counts), dtype=np.int32).reshape(len(counts), 2)
    return BatchInputs(
        rows=np.arange(len(counts)), num_scheduled=np.array(counts, dtype=np.int32),
        input_ids=100 + np.arange(t, dtype=np.int64), positions=pos, slot_mapping=slots,
        query_start_loc=qsl, seq_lens=lens, block_table=table,
        logits_indices=np.arange(t, dtype=np.int64), sample_rows=np.arange(len(counts)),
        max_query_len=max(counts), max_seq_len=int(lens.max()),
        other_groups=[(slots + 5000, table + 50) for _ in range(groups - 1)])


def test_bucket_choice():
    plan = GraphPlan(max_num_seqs=20, tokens_per_req=4, max_tokens=100)
    b = plan.choose(_inputs([4, 4, 4]))
    assert b is not None and b.decode and b.num_reqs == 4 and b.num_tokens == 16
    b = plan.choose(_inputs([1, 4, 2]))  # drafts of different lengths: still a decode graph
    assert b is not None and b.decode and b.num_reqs == 4
    b = plan.choose(_inputs([1, 30, 2]))  # a prefill chunk: the smallest mixed bucket
    assert b is not None and not b.decode and (b.num_tokens, b.num_reqs) == (64, 20)
    assert plan.choose(_inputs([90, 11])) is None  # past the largest bucket: eager
    eager_mixed = GraphPlan(20, 4, 100, mixed=False)
    assert eager_mixed.choose(_inputs([1, 30])) is None
    assert plan.max_tokens() == 100


def test_padded_drafts_write_nothing_and_are_never_sampled():
    inputs = _inputs([1, 4, 2], groups=2)
    # sample the last token of request 0, all 4 of request 1, both of request 2
    inputs.logits_indices = np.array([0, 1, 2, 3, 4, 5, 6], dtype=np.int64)
    padded, where = pad_to_uniform(inputs, 4, block_size=4)
    assert list(padded.query_start_loc) == [0, 4, 8, 12]
    real = np.zeros(12, dtype=bool)
    real[where] = True
    # every real token keeps its id, position and slot at its new index
    assert (padded.input_ids[where] == inputs.input_ids).all()
    assert (padded.positions[where] == inputs.positions).all()
    assert (padded.slot_mapping[where] == inputs.slot_mapping).all()
    assert (padded.other_groups[0][0][where] == inputs.other_groups[0][0]).all()
    # padding writes no KV in any group and is never a logits index
    assert (padded.slot_mapping[~real] == -1).all()
    assert (padded.other_groups[0][0][~real] == -1).all()
    assert real[padded.logits_indices].all()
    sampled = inputs.input_ids[inputs.logits_indices]
    assert (padded.input_ids[padded.logits_indices] == sampled).all()
    # the real queries keep their positions: each sequence grows by its padding
    assert list(padded.seq_lens) == [14, 14, 14] and padded.max_query_len == 4
    # the table covers the padded lengths with the null block, real columns untouched
    assert padded.block_table.shape == (3, 4)
    assert (padded.block_table[:, :2] == inputs.block_table).all()
    assert (padded.block_table[:, 2:] == 0).all()
    # already uniform: unchanged
    same, idx = pad_to_uniform(_inputs([4, 4]), 4, 4)
    assert list(idx) == list(range(8)) and same.max_query_len == 4


def test_capture_inputs_write_nowhere():
    plan = GraphPlan(max_num_seqs=8, tokens_per_req=2, max_tokens=64)
    for b in plan.buckets():
        d = dummy_inputs(b, 2, num_groups=2, block_size=16)
        assert len(d.input_ids) == b.num_tokens and len(d.seq_lens) == b.num_reqs
        assert (d.slot_mapping == -1).all() and (d.other_groups[0][0] == -1).all()
        assert (d.block_table == 0).all() and d.query_start_loc[-1] == b.num_tokens
        # mixed graphs are captured with wide query blocks (any query length fits them)
        assert d.max_query_len == (2 if b.decode else b.num_tokens)


def test_capture_inputs_respect_the_longest_request():
    # a mixed bucket wider than max_model_len: no dummy request may need more table columns
    # than the staged block table has (the capture's reshape failed on it)
    plan = GraphPlan(max_num_seqs=8, tokens_per_req=1, max_tokens=256)
    for b in plan.buckets():
        d = dummy_inputs(b, 1, num_groups=1, block_size=16, max_blocks_per_req=3)
        assert d.block_table.shape[1] <= 3 and int(d.seq_lens.max()) <= 48
        assert d.query_start_loc[-1] == b.num_tokens and d.max_query_len <= 48
