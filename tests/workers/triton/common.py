"""Shapes shared by the Triton kernel tests."""

from __future__ import annotations

import torch

from tests.helpers.paged import Seq, build_step
from workers.attention import AttentionMetadata

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# (total tokens, already computed): a fresh prefill, a chunk continuing cached context, a
# decode, a long decode, a request verifying 4 drafts, a prefix-cache hit (decode after 8
# cached), a chunk of 24 after 16 cached.
MIXED = [(37, 0), (50, 21), (19, 18), (70, 69), (33, 28), (9, 8), (40, 16)]


def mixed_step(block_size: int, layout=MIXED, seed: int = 0
               ) -> tuple[AttentionMetadata, int]:
    """Metadata of one mixed step with scattered, descending block ids; returns it and the
    number of blocks the caches need."""
    g = torch.Generator().manual_seed(seed)
    seqs, new = [], []
    next_block = 1
    for total, computed in layout:
        n_blocks = -(-total // block_size)
        blocks = list(range(next_block, next_block + n_blocks))[::-1]
        next_block += n_blocks
        tokens = torch.randint(0, 100, (total,), generator=g).tolist()
        seqs.append(Seq(tokens, blocks, computed))
        new.append(total - computed)
    _, _, meta = build_step(seqs, new, block_size, DEVICE)
    return meta, next_block
