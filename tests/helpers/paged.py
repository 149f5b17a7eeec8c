"""Build AttentionMetadata by hand and run a model through its paged KV cache in tests."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from workers.attention.reference import AttentionMetadata


@dataclass
class Seq:
    """One request as the scheduler would see it: token ids, blocks, what the cache holds."""

    tokens: list[int]
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0


def build_step(seqs: list[Seq], num_new: list[int], block_size: int,
               device: torch.device | str = "cpu"):
    """Inputs for one step in which seqs[i] gets num_new[i] new tokens; blocks must cover them."""
    ids, pos, slots, qsl, seq_lens = [], [], [], [0], []
    for s, n in zip(seqs, num_new, strict=True):
        for p in range(s.num_computed, s.num_computed + n):
            ids.append(s.tokens[p])
            pos.append(p)
            slots.append(s.blocks[p // block_size] * block_size + p % block_size)
        qsl.append(qsl[-1] + n)
        seq_lens.append(s.num_computed + n)
    width = max(len(s.blocks) for s in seqs)
    table = np.zeros((len(seqs), width), dtype=np.int32)
    for i, s in enumerate(seqs):
        table[i, : len(s.blocks)] = s.blocks
    qsl_np = np.array(qsl, dtype=np.int32)
    lens_np = np.array(seq_lens, dtype=np.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.from_numpy(qsl_np).to(device),
        seq_lens=torch.from_numpy(lens_np).to(device),
        block_table=torch.from_numpy(table).to(device),
        query_start_loc_np=qsl_np,
        seq_lens_np=lens_np,
        max_query_len=max(num_new),
        max_seq_len=int(lens_np.max()),
    )
    ids_t = torch.tensor(ids, dtype=torch.int64, device=device)
    pos_t = torch.tensor(pos, dtype=torch.int64, device=device)
    return ids_t, pos_t, meta


def run_step(model, seqs: list[Seq], num_new: list[int], block_size: int) -> list[torch.Tensor]:
    """Run one step; returns each request's logits [num_new_i, vocab]; advances num_computed."""
    ids, pos, meta = build_step(seqs, num_new, block_size, model.device)
    logits = model.compute_logits(model(ids, pos, meta)).cpu()
    out = []
    for i, s in enumerate(seqs):
        out.append(logits[meta.query_start_loc_np[i] : meta.query_start_loc_np[i + 1]])
        s.num_computed += num_new[i]
    return out


def greedy_generate(model, prompt: list[int], max_new: int, block_size: int, first_block: int,
                    eos: int | None = None) -> list[int]:
    """Prefill then decode one token at a time through the paged cache; returns new token ids."""
    n_blocks = -(-(len(prompt) + max_new) // block_size)
    seq = Seq(list(prompt), list(range(first_block, first_block + n_blocks)))
    new_tokens: list[int] = []
    step = len(prompt)
    for _ in range(max_new):
        logits = run_step(model, [seq], [step], block_size)[0]
        tok = int(logits[-1].argmax())
        new_tokens.append(tok)
        if tok == eos:
            break
        seq.tokens.append(tok)
        step = 1
    return new_tokens


# (total tokens, already computed): a fresh prefill, a chunk continuing cached context, a
# decode, a long decode, a request verifying 4 drafts, a prefix-cache hit (decode after 8
# cached), a chunk of 24 after 16 cached.
MIXED_STEP = [(37, 0), (50, 21), (19, 18), (70, 69), (33, 28), (9, 8), (40, 16)]


def mixed_step(block_size: int, layout: list[tuple[int, int]] = MIXED_STEP, seed: int | None = None,
               device: torch.device | str = "cpu"):
    """Metadata of one step mixing prefills, chunks, decodes, drafts and a prefix hit, with
    scattered, descending block ids; returns it and the number of blocks the caches need."""
    g = torch.Generator().manual_seed(block_size if seed is None else seed)
    seqs, new = [], []
    next_block = 1
    for total, computed in layout:
        n_blocks = -(-total // block_size)
        blocks = list(range(next_block, next_block + n_blocks))[::-1]
        next_block += n_blocks
        tokens = torch.randint(0, 100, (total,), generator=g).tolist()
        seqs.append(Seq(tokens, blocks, computed))
        new.append(total - computed)
    _, _, meta = build_step(seqs, new, block_size, device)
    return meta, next_block
