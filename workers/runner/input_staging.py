"""Persistent host staging buffers and their device twins for one worker's step inputs.

On CUDA every step used to allocate fresh device tensors and copy pageable numpy arrays into
them (a synchronous copy each). Here each input has one pinned host buffer and one device
buffer, allocated once at their largest size; a step writes the live prefix of each array into
the pinned buffer and issues one non_blocking host-to-device copy of that prefix. The device
buffers keep their addresses for the worker's life, which is what CUDA-graph replay needs.

Only live data crosses to the device: the prefix of each array, and of the block table only
the columns the step's longest request uses (a table is as wide as max_model_len / block_size,
8,193 columns at a 131k context), packed contiguously.

Each input has two pinned buffers, used in turn: with worker overlap a step is staged while the
step before it still runs, whose own copies may not have left their buffer yet. A buffer is
written again two steps later, once the host has waited for that step's sampled tokens, which
come after every copy the step queued.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from workers.attention.reference import AttentionMetadata
from workers.runner.input_batch import BatchInputs


class _Pinned:
    """Two pinned host buffers of one input, used in turn by successive puts."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        pin = device.type == "cuda"
        self._hosts = [torch.empty(shape, dtype=dtype, pin_memory=pin) for _ in range(2)]
        self._turn = 0
        self.host = self._hosts[0]
        self.host_np = self.host.numpy()

    def flip(self) -> None:
        self._turn ^= 1
        self.host = self._hosts[self._turn]
        self.host_np = self.host.numpy()


class _Staged(_Pinned):
    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        super().__init__(shape, dtype, device)
        self.device = torch.empty(shape, dtype=dtype, device=device)

    def put(self, arr: np.ndarray, length: int | None = None, fill: int = 0) -> torch.Tensor:
        """Copy arr into rows [:len(arr)], `fill` into [len(arr):length]; returns the device
        view of the first `length` rows (default len(arr))."""
        n = len(arr)
        length = n if length is None else length
        if length > self.host_np.shape[0]:
            raise ValueError(f"{length} rows > staging capacity {self.host_np.shape[0]}")
        self.flip()
        self.host_np[:n] = arr
        if length > n:
            self.host_np[n:length] = fill
        dst = self.device[:length]
        dst.copy_(self.host[:length], non_blocking=True)
        return dst


class _StagedTable(_Pinned):
    """A block table: the live [rows, columns] packed contiguously in pinned memory and copied
    as one block; CUDA-graph steps then scatter it on the device into a whole-width twin whose
    address and row stride the captured kernels hold (columns past the live width are stale
    there, and never read: a request reads only the blocks its sequence length covers)."""

    def __init__(self, max_reqs: int, max_cols: int, device: torch.device):
        super().__init__((max_reqs * max_cols,), torch.int32, device)
        self.max_cols = max_cols
        self.packed = torch.empty(max_reqs * max_cols, dtype=torch.int32, device=device)
        self.fixed = torch.empty((max_reqs, max_cols), dtype=torch.int32, device=device)

    def put(self, table: np.ndarray, num_reqs: int, for_graph: bool) -> torch.Tensor:
        r, width = table.shape
        n = r * width
        self.flip()
        self.host_np[:n].reshape(r, width)[:] = table
        packed = self.packed[:n]
        packed.copy_(self.host[:n], non_blocking=True)
        view = packed.view(r, width)
        if not for_graph and num_reqs == r:
            return view
        self.fixed[:r, :width].copy_(view)
        return self.fixed[:num_reqs, :width]


class InputStaging:
    """The step inputs of one worker: token ids, positions, slot mapping, query start offsets,
    sequence lengths, block table and logits indices (a slot mapping and a block table per KV
    cache group)."""

    def __init__(self, device: torch.device, max_tokens: int, max_reqs: int,
                 max_blocks_per_req: int, num_groups: int = 1) -> None:
        self.max_tokens, self.max_reqs = max_tokens, max_reqs
        self.input_ids = _Staged((max_tokens,), torch.int64, device)
        self.positions = _Staged((max_tokens,), torch.int64, device)
        self.slot_mapping = _Staged((max_tokens,), torch.int64, device)
        self.query_start_loc = _Staged((max_reqs + 1,), torch.int32, device)
        self.seq_lens = _Staged((max_reqs,), torch.int32, device)
        self.block_table = _StagedTable(max_reqs, max_blocks_per_req, device)
        self.logits_indices = _Staged((max_tokens,), torch.int64, device)
        # KV cache groups 1..G-1: their slot mappings and block tables
        self.other_groups = [
            (_Staged((max_tokens,), torch.int64, device),
             _StagedTable(max_reqs, max_blocks_per_req, device))
            for _ in range(num_groups - 1)
        ]

    def stage(self, inputs: BatchInputs, num_tokens: int | None = None,
              num_reqs: int | None = None, for_graph: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata | list[AttentionMetadata]]:
        """Device views of the step's inputs, padded to num_tokens / num_reqs (a CUDA-graph
        size) when given: padding tokens write no K/V (slot -1) and padding requests have no
        tokens and no context, so they attend to nothing. for_graph: the block tables are
        the persistent whole-width ones a captured graph reads."""
        t = len(inputs.input_ids)
        r = len(inputs.seq_lens)
        num_tokens = t if num_tokens is None else num_tokens
        num_reqs = r if num_reqs is None else num_reqs
        qsl = self.query_start_loc.put(inputs.query_start_loc, num_reqs + 1, fill=t)
        seq_lens = self.seq_lens.put(inputs.seq_lens, num_reqs, fill=0)
        for_graph = for_graph or num_reqs != r
        qsl_np = self.query_start_loc.host_np[: num_reqs + 1]
        lens_np = self.seq_lens.host_np[:num_reqs]
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping.put(inputs.slot_mapping, num_tokens, fill=-1),
            query_start_loc=qsl,
            seq_lens=seq_lens,
            block_table=self.block_table.put(inputs.block_table, num_reqs, for_graph),
            query_start_loc_np=qsl_np,
            seq_lens_np=lens_np,
            max_query_len=inputs.max_query_len,
            max_seq_len=inputs.max_seq_len,
        )
        ids = self.input_ids.put(inputs.input_ids, num_tokens, fill=0)
        pos = self.positions.put(inputs.positions, num_tokens, fill=0)
        if not inputs.other_groups:
            return ids, pos, meta
        metas = [meta]
        for (slots, table), (staged_slots, staged_table) in zip(
                inputs.other_groups, self.other_groups, strict=True):
            metas.append(replace(meta, slot_mapping=staged_slots.put(slots, num_tokens, fill=-1),
                                 block_table=staged_table.put(table, num_reqs, for_graph)))
        return ids, pos, metas

    def logits_index(self, idx: np.ndarray) -> torch.Tensor:
        return self.logits_indices.put(idx)


def unstaged_inputs(inputs: BatchInputs, device: torch.device
                    ) -> tuple[torch.Tensor, torch.Tensor,
                               AttentionMetadata | list[AttentionMetadata]]:
    """The step's inputs as tensors on a device without staging buffers (on CPU the numpy
    arrays themselves, zero-copy)."""

    def t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device, non_blocking=True)

    meta = AttentionMetadata(
        slot_mapping=t(inputs.slot_mapping),
        query_start_loc=t(inputs.query_start_loc),
        seq_lens=t(inputs.seq_lens),
        block_table=t(inputs.block_table),
        query_start_loc_np=inputs.query_start_loc,
        seq_lens_np=inputs.seq_lens,
        max_query_len=inputs.max_query_len,
        max_seq_len=inputs.max_seq_len,
    )
    if not inputs.other_groups:
        return t(inputs.input_ids), t(inputs.positions), meta
    # one metadata per KV cache group: its own slots and block table, the rest shared
    metas = [meta] + [
        replace(meta, slot_mapping=t(slots), block_table=t(table))
        for slots, table in inputs.other_groups
    ]
    return t(inputs.input_ids), t(inputs.positions), metas
