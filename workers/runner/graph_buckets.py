"""Which CUDA graph a step replays, and how its inputs are padded to that graph's shape.

Pure host-side logic (numpy), so CPU tests cover everything but the capture and replay.

Approach: full graphs over buckets, not piecewise graphs with attention outside. The Triton
attention's grid depends only on the padded token and request counts, and every other choice
it makes is fixed per graph, so the whole forward (attention included) can be captured. Two
families:

- decode graphs, one per padded request count (1, 2, 4, 8, then every 8 up to max_num_seqs),
  for steps whose requests all have 1..1+K new tokens. A request with fewer than K drafts is
  padded to 1 + K tokens: the padding tokens follow its real ones, write no K/V (slot -1),
  are never in the logits indices (so never verified, never accepted), and read only the null
  block for their own positions (the padded block-table columns are 0). The attention runs
  its narrow decode blocks with the key range split by the padded request count.
- mixed graphs, one per token bucket (powers of two from 16 up to the token budget), for
  every other step: prefill chunks, mixed prefill + decode, decodes with longer queries. Its
  request count is min(tokens, max_num_seqs), which covers every step of that many tokens (a
  scheduled request has at least one). Padding tokens sit after the last request and padding
  requests have no tokens and no context. Captured with wide query blocks (what any query
  length needs), no key split.

Piecewise graphs would keep the attention eager, paying its launch and Python per layer on
every mixed step, which is exactly the cost graphs are meant to remove; the full-graph cost is
padding (at most 2x tokens for the mixed buckets) and memory for the largest mixed graph, which
the KV sizing counts. Which is faster has not been measured on a GPU yet.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from workers.runner.input_batch import BatchInputs

MIN_MIXED_TOKENS = 16


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Padded request counts of the decode graphs: 1, 2, 4, 8, then multiples of 8, up to
    max_num_seqs (included even when it is not one of them), ascending."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8))
    sizes.append(max_num_seqs)
    return sorted(set(sizes))


def mixed_token_buckets(max_tokens: int) -> list[int]:
    """Token counts of the mixed graphs: powers of two from MIN_MIXED_TOKENS, and max_tokens."""
    out = []
    t = MIN_MIXED_TOKENS
    while t < max_tokens:
        out.append(t)
        t *= 2
    out.append(max_tokens)
    return out


@dataclass(frozen=True)
class Bucket:
    decode: bool
    num_tokens: int  # padded
    num_reqs: int  # padded


class GraphPlan:
    """Every bucket captured for one model runner: decode graphs of tokens_per_req = 1 + K
    tokens per request, and mixed graphs up to max_tokens (a step's token budget, drafts
    included)."""

    def __init__(self, max_num_seqs: int, tokens_per_req: int, max_tokens: int,
                 mixed: bool = True) -> None:
        self.tokens_per_req = tokens_per_req
        self.decode = [Bucket(True, s * tokens_per_req, s) for s in capture_sizes(max_num_seqs)
                       if s * tokens_per_req <= max_tokens]
        self.mixed = [Bucket(False, t, min(t, max_num_seqs))
                      for t in mixed_token_buckets(max_tokens)] if mixed else []

    def buckets(self) -> list[Bucket]:
        return self.decode + self.mixed

    def max_tokens(self) -> int:
        return max((b.num_tokens for b in self.buckets()), default=0)

    def choose(self, inputs: BatchInputs) -> Bucket | None:
        """The smallest bucket that holds this step; None: run it eagerly."""
        t, r = len(inputs.input_ids), len(inputs.seq_lens)
        if 0 < inputs.max_query_len <= self.tokens_per_req:
            for b in self.decode:
                if b.num_reqs >= r:
                    return b
        for b in self.mixed:
            if b.num_tokens >= t and b.num_reqs >= r:
                return b
        return None


def pad_to_uniform(inputs: BatchInputs, tokens_per_req: int,
                   block_size: int) -> tuple[BatchInputs, np.ndarray]:
    """A decode step whose requests have 1..tokens_per_req new tokens, each padded to exactly
    tokens_per_req. Returns the padded inputs and, for every real token, its padded index.

    A padded token follows its request's real ones, writes no K/V (slot -1)
    and is never a logits index (the padded logits indices are the real ones, moved), so it is
    never sampled or verified. Its request's sequence length grows by the padding so the
    real queries keep their positions; the block table grows by zero columns (the null block)
    so the padding queries read only valid blocks."""
    q = tokens_per_req
    counts = np.diff(inputs.query_start_loc).astype(np.int64)
    r = len(counts)
    if (counts == q).all():
        return inputs, np.arange(len(inputs.input_ids))
    pad = q - counts
    # padded index of each real token: its request's base + its offset in the request
    req_of = np.repeat(np.arange(r), counts)
    offset = np.arange(len(req_of)) - inputs.query_start_loc[req_of]
    where = req_of * q + offset
    total = r * q

    def spread(a: np.ndarray, fill: int) -> np.ndarray:
        out = np.full(total, fill, dtype=a.dtype)
        out[where] = a
        return out

    seq_lens = (inputs.seq_lens + pad).astype(np.int32)
    width = max(int(inputs.block_table.shape[1]), -(-int(seq_lens.max()) // block_size))

    def widen(table: np.ndarray) -> np.ndarray:
        out = np.zeros((r, width), dtype=table.dtype)
        out[:, : table.shape[1]] = table
        return out

    padded = replace(
        inputs,
        input_ids=spread(inputs.input_ids, 0),
        # position 0: the rotary tables hold max_model_len rows, and a padding token's
        # position past them would read out of bounds (attention takes positions from the
        # sequence lengths, not from here)
        positions=spread(inputs.positions, 0),
        slot_mapping=spread(inputs.slot_mapping, -1),
        query_start_loc=(np.arange(r + 1) * q).astype(np.int32),
        seq_lens=seq_lens,
        block_table=widen(inputs.block_table),
        logits_indices=where[inputs.logits_indices],
        max_query_len=q,
        max_seq_len=int(seq_lens.max()),
        other_groups=[(spread(slots, -1), widen(table)) for slots, table in inputs.other_groups],
    )
    return padded, where
