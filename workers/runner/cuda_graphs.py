"""CUDA graphs for decode steps.

A decode step (every request has the same 1 + K new tokens: one token, or one plus K drafts)
launches a few hundred small kernels whose launch cost exceeds their run time at small batch
sizes. At start-up the model's forward is captured once per padded batch size (1, 2, 4, 8, then
every 8 up to max_num_seqs), largest first so smaller graphs reuse the first one's memory pool;
a decode step then fills the persistent input buffers (workers/runner/input_staging.py) in place,
padded to the next captured size, and replays the graph. Padding tokens write no K/V (slot -1)
and padding requests have no tokens and no context. Prefill and mixed steps run eagerly.

Capture needs a forward that never synchronises with the host and allocates nothing from the
host side: the Triton attention backend is built that way. Under TP the NCCL all-reduces are
captured inside the graphs.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from workers.runner.input_batch import BatchInputs
from workers.runner.input_staging import InputStaging

if TYPE_CHECKING:
    from workers.model.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Padded batch sizes to capture: 1, 2, 4, 8, then multiples of 8, up to max_num_seqs
    (included even when it is not one of them), ascending."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8))
    sizes.append(max_num_seqs)
    return sorted(set(sizes))


def is_uniform_decode(inputs: BatchInputs, tokens_per_req: int) -> bool:
    """Every scheduled request has exactly tokens_per_req new tokens."""
    return (inputs.max_query_len == tokens_per_req
            and len(inputs.input_ids) == tokens_per_req * len(inputs.seq_lens))


class CudaGraphRunner:
    def __init__(self, model: LlamaForCausalLM, staging: InputStaging, max_num_seqs: int,
                 tokens_per_req: int) -> None:
        self.model = model
        self.staging = staging
        self.tokens_per_req = tokens_per_req
        self.sizes = [s for s in capture_sizes(max_num_seqs)
                      if s * tokens_per_req <= staging.max_tokens and s <= staging.max_reqs]
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def padded_size(self, num_reqs: int) -> int | None:
        for s in self.sizes:
            if s >= num_reqs:
                return s
        return None

    def can_run(self, inputs: BatchInputs) -> bool:
        return (bool(self.graphs) and is_uniform_decode(inputs, self.tokens_per_req)
                and self.padded_size(len(inputs.seq_lens)) in self.graphs)

    def _dummy_inputs(self, num_reqs: int) -> BatchInputs:
        """A decode batch of num_reqs requests that each see only their own new tokens in the
        null block (block 0) and write nowhere."""
        q = self.tokens_per_req
        t = num_reqs * q
        zeros = np.zeros(t, dtype=np.int64)
        return BatchInputs(
            rows=np.arange(num_reqs), num_scheduled=np.full(num_reqs, q, dtype=np.int32),
            input_ids=zeros, positions=np.tile(np.arange(q, dtype=np.int64), num_reqs),
            slot_mapping=np.full(t, -1, dtype=np.int64),
            query_start_loc=(np.arange(num_reqs + 1) * q).astype(np.int32),
            seq_lens=np.full(num_reqs, q, dtype=np.int32),
            block_table=np.zeros((num_reqs, 1), dtype=np.int32),
            logits_indices=np.arange(t, dtype=np.int64), sample_rows=np.arange(num_reqs),
            max_query_len=q, max_seq_len=q)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, into one shared memory pool."""
        start = time.perf_counter()
        device = self.model.device
        free_before = torch.cuda.mem_get_info(device)[0]
        pool = None
        for size in sorted(self.sizes, reverse=True):
            ids, pos, meta = self.staging.stage(self._dummy_inputs(size), for_graph=True)
            # Warm-up outside the graph: compiles the Triton kernels for this shape and lets
            # cuBLAS and NCCL set up their workspaces.
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self.model(ids, pos, meta)
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self.model(ids, pos, meta)
            pool = graph.pool()
            self.graphs[size] = (graph, hidden)
        torch.cuda.synchronize(device)
        used = free_before - torch.cuda.mem_get_info(device)[0]
        logger.info("captured %d CUDA graphs (batch sizes %d..%d, %d token(s) per request) in "
                    "%.1f s, %.0f MiB", len(self.graphs), self.sizes[0], self.sizes[-1],
                    self.tokens_per_req, time.perf_counter() - start, used / 2**20)

    def run(self, inputs: BatchInputs) -> torch.Tensor:
        """Fill the captured buffers with this decode step (padded) and replay; returns the
        hidden states of the real tokens [T, hidden]."""
        num_reqs = len(inputs.seq_lens)
        size = self.padded_size(num_reqs)
        assert size is not None
        self.staging.stage(inputs, num_tokens=size * self.tokens_per_req, num_reqs=size,
                           for_graph=True)
        graph, hidden = self.graphs[size]
        graph.replay()
        return hidden[: len(inputs.input_ids)]
