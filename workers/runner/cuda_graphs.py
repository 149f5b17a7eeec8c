"""CUDA graph capture and replay for every step shape that repeats.

Which graph a step takes and how its inputs are padded is decided in
workers/runner/graph_buckets.py (pure, tested on CPU); this file only captures the buckets at
start-up, largest first into one shared memory pool (smaller graphs reuse its memory), and
replays them: a step fills the persistent input buffers (workers/runner/input_staging.py) in
place, padded to its bucket (stage: with worker overlap while the step before still runs, the
copies queued behind it), and replays (replay, at the step's launch).

Capture needs a forward that never synchronises with the host and allocates nothing from the
host side: the Triton attention backend is built that way. Under TP the NCCL all-reduces are
captured inside the graphs. Every KV cache group has its own slot mapping and block table in
the staging buffers, so models with several groups are graphed too.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from workers.runner.graph_buckets import Bucket, GraphPlan, pad_to_uniform
from workers.runner.input_batch import BatchInputs
from workers.runner.input_staging import InputStaging

if TYPE_CHECKING:
    from workers.model.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


def dummy_inputs(bucket: Bucket, tokens_per_req: int, num_groups: int,
                 block_size: int, max_blocks_per_req: int | None = None) -> BatchInputs:
    """The step a bucket is captured with: every token writes nowhere (slot -1) and every
    request sees only its own new tokens in the null block (block 0). Decode buckets: each
    request has tokens_per_req tokens. Mixed buckets: the first requests hold as many tokens
    as one request may (max_blocks_per_req blocks: a bucket can be wider than max_model_len),
    the rest one each."""
    t, r = bucket.num_tokens, bucket.num_reqs
    if bucket.decode:
        counts = np.full(r, tokens_per_req, dtype=np.int32)
    else:
        cap = t if max_blocks_per_req is None else max_blocks_per_req * block_size
        counts = np.ones(r, dtype=np.int32)
        extra = t - r  # tokens beyond one per request, poured into the first requests
        for i in range(r):
            take = min(extra, cap - 1)
            counts[i] += take
            extra -= take
        if extra:
            raise ValueError(f"bucket {bucket} holds more tokens than {r} requests of "
                             f"{cap} tokens each")
    qsl = np.zeros(r + 1, dtype=np.int32)
    qsl[1:] = np.cumsum(counts)
    positions = np.concatenate([np.arange(c, dtype=np.int64) for c in counts])
    slots = np.full(t, -1, dtype=np.int64)
    table = np.zeros((r, -(-int(counts.max()) // block_size)), dtype=np.int32)
    return BatchInputs(
        rows=np.arange(r), num_scheduled=counts, input_ids=np.zeros(t, dtype=np.int64),
        positions=positions, slot_mapping=slots, query_start_loc=qsl, seq_lens=counts.copy(),
        block_table=table, logits_indices=np.arange(t, dtype=np.int64),
        sample_rows=np.arange(r),
        # mixed: the longest query any step of this bucket can have, so the attention makes
        # the choices (query block width, no key split) that hold for all of them
        max_query_len=int(counts.max()) if bucket.decode else min(t, cap),
        max_seq_len=int(counts.max()),
        other_groups=[(slots.copy(), table.copy()) for _ in range(num_groups - 1)])


class CudaGraphRunner:
    def __init__(self, model: LlamaForCausalLM, staging: InputStaging, plan: GraphPlan,
                 block_size: int, num_groups: int) -> None:
        self.model = model
        self.staging = staging
        self.plan = plan
        self.block_size = block_size
        self.num_groups = num_groups
        self.graphs: dict[Bucket, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def can_run(self, inputs: BatchInputs) -> bool:
        return bool(self.graphs) and self.plan.choose(inputs) in self.graphs

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, into one shared memory pool."""
        start = time.perf_counter()
        device = self.model.device
        free_before = torch.cuda.mem_get_info(device)[0]
        pool = None
        buckets = sorted(self.plan.buckets(), key=lambda b: (b.num_tokens, b.num_reqs),
                         reverse=True)
        max_cols = self.staging.block_table.max_cols
        max_req_tokens = max_cols * self.block_size
        for bucket in buckets:
            if not bucket.decode and bucket.num_tokens > bucket.num_reqs * max_req_tokens:
                continue  # no step can have that many tokens: such steps do not exist
            ids, pos, meta = self.staging.stage(
                dummy_inputs(bucket, self.plan.tokens_per_req, self.num_groups,
                             self.block_size, max_cols),
                for_graph=True)
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
            self.graphs[bucket] = (graph, hidden)
        torch.cuda.synchronize(device)
        used = free_before - torch.cuda.mem_get_info(device)[0]
        logger.info("captured %d CUDA graphs (%d decode of %d token(s) per request, %d mixed "
                    "up to %d tokens) in %.1f s, %.0f MiB", len(self.graphs),
                    len(self.plan.decode), self.plan.tokens_per_req, len(self.plan.mixed),
                    self.plan.max_tokens(), time.perf_counter() - start, used / 2**20)

    def stage(self, inputs: BatchInputs) -> tuple[Bucket, torch.Tensor, np.ndarray]:
        """Fill the captured buffers with this step, padded to its bucket. Returns the bucket,
        the device input ids (still writable before the replay) and the step's logits
        indices into the padded hidden states."""
        bucket = self.plan.choose(inputs)
        assert bucket is not None and bucket in self.graphs
        if bucket.decode:  # requests with fewer drafts than K get padding tokens
            inputs, _ = pad_to_uniform(inputs, self.plan.tokens_per_req, self.block_size)
        ids, _, _ = self.staging.stage(inputs, num_tokens=bucket.num_tokens,
                                       num_reqs=bucket.num_reqs, for_graph=True)
        return bucket, ids, inputs.logits_indices

    def replay(self, bucket: Bucket) -> torch.Tensor:
        """Run a staged step; returns its (padded) hidden states."""
        graph, hidden = self.graphs[bucket]
        graph.replay()
        return hidden
