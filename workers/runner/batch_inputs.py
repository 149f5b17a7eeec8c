"""The model inputs of one step, built from the persistent batch's arrays with vectorized ops.

InputBuilder is a mixin of InputBatch (input_batch.py): the attributes below are the batch's
own, declared here so this half reads (and type-checks) on its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from workers.runner.block_table import BlockTable, StateMismatchError
from workers.sample.sampler import SamplingMetadata
from workers.sample.spec_decode import DraftLayout, ragged_arange


@dataclass
class BatchInputs:
    """Host-side model inputs of one step (numpy); ModelRunner moves them to the device."""

    rows: np.ndarray  # [R] batch rows scheduled this step, in query order
    num_scheduled: np.ndarray  # [R] int32
    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    query_start_loc: np.ndarray  # [R+1] int32
    seq_lens: np.ndarray  # [R] int32
    block_table: np.ndarray  # [R, W] int32, 0-padded
    logits_indices: np.ndarray  # [S + K] int64: last 1 + k_i tokens of each sampling request
    sample_rows: np.ndarray  # [S] batch rows that sample, same order
    max_query_len: int
    max_seq_len: int
    # None when no request carries drafts this step (then logits_indices has S entries)
    drafts: DraftLayout | None = None
    # KV cache groups 1..G-1 (block_table and slot_mapping above are group 0's): per group
    # (slot_mapping [T] int64, block_table [R, W] int32)
    other_groups: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)


class InputBuilder:
    num_rows: int
    block_size: int
    num_groups: int
    blocks: BlockTable
    block_table: np.ndarray
    token_ids: np.ndarray
    num_tokens: np.ndarray
    num_computed_tokens: np.ndarray
    num_scheduled: np.ndarray
    num_drafts: np.ndarray
    handles: np.ndarray
    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    want_logprobs: np.ndarray
    seeded: np.ndarray
    seeds: np.ndarray
    num_seeded: int
    _draft_rows: np.ndarray | None
    _arange: np.ndarray
    _flat_tokens: np.ndarray


    def prepare_inputs(self) -> BatchInputs:
        """Vectorized model inputs for the scheduled rows (call after apply).

        The result may share memory with the batch: use it before the next apply().
        """
        n = self.num_rows
        counts_all = self.num_scheduled[:n]
        bs = self.block_size
        sel: slice | np.ndarray
        if (counts_all == 1).all():  # steady decode: one token per row, plain slices
            sel = slice(0, n)
            rows = self._arange[:n]
            counts = counts_all
            computed = self.num_computed_tokens[:n]
            positions = computed.astype(np.int64)
            req = rows
            qsl = self._arange[: n + 1].astype(np.int32)
        else:
            sel = rows = np.flatnonzero(counts_all)
            counts = counts_all[rows]
            computed = self.num_computed_tokens[rows]
            cu = np.cumsum(counts, dtype=np.int64)
            total = int(cu[-1]) if len(cu) else 0
            req = np.repeat(rows, counts)
            offsets = self._arange_tokens(total) - np.repeat(cu - counts, counts)
            positions = np.repeat(computed, counts).astype(np.int64) + offsets
            qsl = np.zeros(len(rows) + 1, dtype=np.int32)
            qsl[1:] = cu
        seq_lens = computed + counts
        num_tokens = self.num_tokens[sel]
        if self._draft_rows is not None:  # drafts are computed on like tokens the row holds
            num_tokens = num_tokens + self.num_drafts[sel]
        # Never compute on tokens the worker does not hold or KV slots it was not given.
        num_blocks = self.blocks.num_blocks
        bad = (seq_lens > num_tokens) | (seq_lens > num_blocks[sel] * bs)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise StateMismatchError(
                f"request {int(self.handles[rows[i]])}: scheduled up to {int(seq_lens[i])} "
                f"tokens, holds {int(num_tokens[i])} tokens and "
                f"{int(num_blocks[rows[i]])} blocks"
            )
        # Flat indices into the 2-D buffers: np.take on 1-D beats 2-D fancy indexing.
        input_ids = self._flat_tokens.take(req * self.token_ids.shape[1] + positions)
        block_idx = self.blocks.block_index(req, positions, bs)
        offset = positions % bs
        slot_mapping = self.blocks.block_ids(0, block_idx) * bs + offset
        max_seq_len = int(seq_lens.max()) if len(rows) else 0
        sampling = seq_lens >= num_tokens
        if sampling.all():
            logits_indices = qsl[1:].astype(np.int64) - 1
            sample_rows = rows
        else:
            pick = np.flatnonzero(sampling)
            logits_indices = qsl[1:][pick].astype(np.int64) - 1
            sample_rows = rows[pick]
        drafts = None
        if self._draft_rows is not None:
            logits_indices, drafts = self._verification_targets(sample_rows, logits_indices)
        return BatchInputs(
            rows=rows,
            num_scheduled=counts,
            input_ids=input_ids.astype(np.int64),
            positions=positions,
            slot_mapping=slot_mapping,
            query_start_loc=qsl,
            seq_lens=seq_lens,
            block_table=self.block_table[sel, : -(-max_seq_len // bs)],
            logits_indices=logits_indices,
            sample_rows=sample_rows,
            max_query_len=int(counts.max()) if len(rows) else 0,
            max_seq_len=max_seq_len,
            drafts=drafts,
            other_groups=[
                (self.blocks.block_ids(g, block_idx) * bs + offset,
                 self.blocks.tables[g][sel, : -(-max_seq_len // bs)])
                for g in range(1, self.num_groups)
            ],
        )

    def _verification_targets(
        self, sample_rows: np.ndarray, last: np.ndarray
    ) -> tuple[np.ndarray, DraftLayout]:
        """Logits indices of each sampling row's last k + 1 tokens, and where its drafts are.

        A row with drafts computes its whole schedule, so it always samples (seq_len == its
        tokens + drafts): every draft row is among sample_rows.
        """
        k = self.num_drafts[sample_rows].astype(np.int64)
        start = sample_rows * self.token_ids.shape[1] + self.num_tokens[sample_rows]
        draft_ids = self._flat_tokens.take(np.repeat(start, k) + ragged_arange(k))
        layout = DraftLayout(k, draft_ids)
        return np.repeat(last - k, k + 1) + layout.rel, layout

    def _arange_tokens(self, total: int) -> np.ndarray:
        if total > len(self._arange):
            self._arange = np.arange(max(total, 2 * len(self._arange)), dtype=np.int64)
        return self._arange[:total]

    def sampling_metadata(self, sample_rows: np.ndarray) -> SamplingMetadata:
        seeded: dict[str, np.ndarray] = {}
        if self.num_seeded:  # a seeded row's numbers are keyed by (seed, token position)
            seeded = dict(seeded=self.seeded[sample_rows], seeds=self.seeds[sample_rows],
                          positions=self.num_tokens[sample_rows].astype(np.int64))
        return SamplingMetadata(
            temperature=self.temperature[sample_rows],
            top_k=self.top_k[sample_rows],
            top_p=self.top_p[sample_rows],
            min_p=self.min_p[sample_rows],
            **seeded,
            need_logprobs=bool(self.want_logprobs[sample_rows].any()),
        )
