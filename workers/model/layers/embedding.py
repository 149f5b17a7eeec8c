"""Vocab-parallel embedding and LM head: each rank holds a slice of the vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers import cpu_ops
from workers.model.layers.linear import linear, pad_to_multiple, param, prepack
from workers.parallel.distributed import tp_all_gather, tp_all_reduce, tp_world_size


class VocabParallelEmbedding(nn.Module):
    """Rows [rank * V/tp, (rank+1) * V/tp) of the (padded) vocabulary live on this rank."""

    def __init__(self, vocab: int, hidden: int, tp_rank: int, tp_size: int,
                 dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.vocab = vocab
        self.rows = pad_to_multiple(vocab, tp_size) // tp_size
        self.start = tp_rank * self.rows
        self.weight = param((self.rows, hidden), dtype, device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.rows >= self.vocab:  # one shard holds every id: no masking, no reduce
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        # Other ranks own these ids: look up row 0 and zero it, the all-reduce fills them in.
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return tp_all_reduce(out)


class ParallelLMHead(nn.Module):
    """Vocab-parallel output projection; every rank ends with the identical full logits."""

    def __init__(self, embedding: VocabParallelEmbedding | None, vocab: int, hidden: int,
                 tp_rank: int, tp_size: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.vocab = vocab
        self.rows = pad_to_multiple(vocab, tp_size) // tp_size
        self.start = tp_rank * self.rows
        # Tied embeddings share the embedding's shard (same vocab split), nothing to load.
        self.tied = embedding
        self.weight = None if embedding is not None else param((self.rows, hidden), dtype, device)
        self.packed: torch.Tensor | None = None
        # bf16 on a CPU with AVX512-BF16: the weight in cpu_ops.bf16_matmul's layout, which
        # also serves greedy decoding with a fused argmax (no logits written).
        self.pairs: torch.Tensor | None = None

    def matrix(self) -> torch.Tensor:
        """The [rows, hidden] weight the head multiplies by: the tied embedding's shard, else its
        own (__init__ makes exactly one of the two)."""
        if self.tied is not None:
            return self.tied.weight
        assert self.weight is not None, "an untied head owns its weight"
        return self.weight

    def prepack(self) -> None:
        weight = self.matrix()
        if (weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
                and weight.shape[1] % 2 == 0 and cpu_ops.bf16_matmul_available()):
            self.pairs = cpu_ops.pack_bf16_pairs(weight.detach().contiguous())
        else:
            self.packed = prepack(weight)

    def _pairs_for(self, hidden: torch.Tensor) -> torch.Tensor | None:
        if self.pairs is not None and hidden.dtype == torch.bfloat16 and hidden.dim() == 2 \
                and cpu_ops.active(hidden):
            return self.pairs
        return None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.matrix()
        pairs = self._pairs_for(hidden)
        if pairs is not None:
            y = cpu_ops.bf16_matmul(hidden.contiguous(), pairs, self.rows)[0]
            assert y is not None
            logits = y.float()
        else:
            logits = linear(hidden, weight, self.packed).float()
        return tp_all_gather(logits, dim=-1)[..., : self.vocab]

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """argmax over the full vocabulary without gathering the logits: [N, hidden] -> [N].

        Each rank takes the max of its shard; only (max, index) pairs cross ranks, a few
        bytes per request instead of the whole vocabulary. Ties resolve to the lowest id, as
        torch.argmax over the gathered logits would.
        """
        weight = self.matrix()
        pad = max(0, self.start + self.rows - self.vocab)  # padding rows of the last shard
        pairs = self._pairs_for(hidden) if self.rows > pad else None
        if pairs is not None:
            # The argmax runs on each register tile of the matmul: no logits are written.
            _, found, top = cpu_ops.bf16_matmul(hidden.contiguous(), pairs, self.rows,
                                                logits=False, argmax_cols=self.rows - pad)
            assert found is not None and top is not None
            best, idx = top, found
        elif cpu_ops.active(hidden):
            logits = linear(hidden, weight, self.packed)
            # One pass over the model-dtype logits: no float32 copy, no masking pass.
            best, idx = cpu_ops.argmax(logits, cols=max(0, self.rows - pad))
        else:
            # argmax in the model dtype: the float32 copy of [N, vocab] logits would add a
            # full write and read (max and its index are the same either way).
            logits = linear(hidden, weight, self.packed)
            if pad > 0:
                logits[:, self.rows - pad :] = float("-inf")
            best, idx = logits.max(dim=-1)
            best = best.float()
        if tp_world_size() == 1:
            return idx
        # Ids < 2**24 are exact in float32, so (max, id) travel in one small gather.
        pair = torch.stack([best, (idx + self.start).float()], dim=-1)
        every = tp_all_gather(pair, dim=0).view(-1, *pair.shape)  # [tp, N, 2]
        winner = every[..., 0].argmax(dim=0)  # first (lowest) rank holding the max
        return every[..., 1].gather(0, winner.unsqueeze(0)).squeeze(0).long()
