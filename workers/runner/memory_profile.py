"""How many KV blocks a rank gets: the arithmetic, the CUDA profile run and the start-up log line.

On CUDA (vLLM's `gpu_memory_utilization` meaning): after the weights are loaded, one forward of
max_num_batched_tokens tokens measures the peak activation memory; the KV cache gets

    total * utilization - (memory in use after loading) - (peak activation increase)

"Memory in use" is the device's own figure (total - free), so the CUDA context, the weights and
anything else on the GPU count against the budget, and what 1 - utilization leaves free is room
for allocator fragmentation. Two more terms come out of the KV cache:

- the sampler's peak: sampling runs after the forward (whose activations are free again by
  then) on max_num_seqs x (1 + drafts) rows of full-vocabulary logits and holds several float32
  copies of them (workers/sample/peak_memory.py counts them), so the step's peak is the larger
  of the profiled forward and the sampler's peak;
- the CUDA graph pool: captured graphs keep their activations in a private pool that eager
  steps cannot reuse, so it is added. All graphs share one pool, captured largest first, so it
  holds about the activations of the largest graph's token count: the profile's peak scaled
  from the profile's token count to that one, plus a fixed allowance per graph for the
  instantiated graph itself.

On CPU the budget is a fixed byte count.
`num_gpu_blocks_override` beats everything, then an explicit `kv_cache_memory`.

The device queries are parameters, so the arithmetic is tested on CPU with stubbed figures.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from protocol.config import CPU_KV_CACHE_MEMORY, EngineConfig, default_max_batched_tokens

if TYPE_CHECKING:
    from workers.model.llama import LlamaForCausalLM

logger = logging.getLogger("tandem.memory")

MiB = 1024 * 1024


@dataclass
class KVCachePlan:
    num_blocks: int
    kv_bytes: int  # num_blocks * bytes_per_block
    bytes_per_block: int
    weights_bytes: int
    # None: no profile run (CPU, or the size came from an explicit option)
    peak_activation_bytes: int | None
    total_bytes: int | None  # the device's memory, where it was queried
    source: str  # num_gpu_blocks_override | kv_cache_memory | gpu_memory_utilization | cpu default
    sampler_bytes: int = 0  # the sampler's peak (counted, not profiled)
    graph_bytes: int = 0  # the CUDA graph pool's estimate (0: no graphs)
    # LoRA slot buffers (--enable-lora): allocated before the sizing, so on CUDA the memory in
    # use after loading already holds them; reported, not subtracted twice
    lora_bytes: int = 0

    def log_line(self, rank: int, device: str) -> str:
        def mib(n: int | None) -> str:
            return "not profiled" if n is None else f"{n / MiB:.1f} MiB"

        total = "" if self.total_bytes is None else f", device total {mib(self.total_bytes)}"
        lora = f", LoRA slots {mib(self.lora_bytes)}" if self.lora_bytes else ""
        return (
            f"rank {rank} on {device}: weights {mib(self.weights_bytes)} "
            f"({self.weights_bytes} B), peak activations {mib(self.peak_activation_bytes)}, "
            f"sampler peak {mib(self.sampler_bytes)}, CUDA graphs {mib(self.graph_bytes)}{lora}, "
            f"KV cache {mib(self.kv_bytes)} ({self.kv_bytes} B) = {self.num_blocks} blocks of "
            f"{self.bytes_per_block} B [{self.source}]{total}"
        )


# Device memory of one instantiated CUDA graph beyond its pool (its nodes and kernel
# parameters; a few hundred KiB for a few hundred launches): an allowance, not a measurement.
GRAPH_OVERHEAD_BYTES = 2 * MiB


def kv_bytes_from_utilization(
    total_bytes: int, utilization: float, used_after_load: int, peak_activation_bytes: int,
    sampler_bytes: int = 0, graph_bytes: int = 0,
) -> int:
    """What `total * utilization` leaves for the KV cache once the memory already in use (CUDA
    context, weights, other processes), the step's peak (the profiled forward or the sampler,
    whichever is larger: they do not overlap) and the CUDA graph pool are taken out."""
    step_peak = max(peak_activation_bytes, sampler_bytes)
    return int(total_bytes * utilization) - used_after_load - step_peak - graph_bytes


def graph_pool_bytes(peak_activation_bytes: int, profile_tokens: int, num_graphs: int,
                     max_graph_tokens: int) -> int:
    """Estimated memory of num_graphs CUDA graphs sharing one pool, the largest of
    max_graph_tokens tokens, from a profile forward of profile_tokens tokens that peaked at
    peak_activation_bytes (activations grow about linearly with the token count)."""
    if num_graphs <= 0 or profile_tokens <= 0:
        return 0
    scale = min(1.0, max_graph_tokens / profile_tokens)
    return int(peak_activation_bytes * scale) + num_graphs * GRAPH_OVERHEAD_BYTES


# The most KV blocks sized from gpu_memory_utilization: the engine core's block pool holds one
# Python object per block (about 1.2 s and 150 MB per million to build), and a tiny model on a
# large GPU would otherwise ask for tens of millions. Real-size models stay far below it (an 8B
# Llama's 2 MiB blocks fill 140 GB with 70,000); the explicit overrides are not capped.
MAX_AUTO_KV_BLOCKS = 1 << 20


def plan_kv_cache(
    config: EngineConfig,
    *,
    device_type: str,
    bytes_per_block: int,
    weights_bytes: int,
    mem_get_info: Callable[[], tuple[int, int]] | None = None,
    profile_peak: Callable[[], int] | None = None,
    sampler_bytes: int = 0,
    graph_bytes: Callable[[int], int] | None = None,
) -> KVCachePlan:
    """The KV cache size for one rank.

    mem_get_info() -> (free, total) bytes of the device (torch.cuda.mem_get_info); profile_peak()
    runs the profile forward and returns its peak increase over the memory allocated before it.
    Both are only called on CUDA when neither override is set. sampler_bytes: the sampler's
    peak (sampler_peak_bytes); graph_bytes(profiled peak): the CUDA graph pool's estimate
    (graph_pool_bytes), None without graphs.
    """

    def plan(num_blocks: int, source: str, peak: int | None = None,
             total: int | None = None, graphs: int = 0) -> KVCachePlan:
        return KVCachePlan(num_blocks, num_blocks * bytes_per_block, bytes_per_block,
                           weights_bytes, peak, total, source,
                           sampler_bytes if peak is not None else 0, graphs)

    if config.num_gpu_blocks_override is not None:
        return _checked(plan(config.num_gpu_blocks_override, "num_gpu_blocks_override"), config)
    if config.kv_cache_memory is not None:
        return _checked(plan(config.kv_cache_memory // bytes_per_block, "kv_cache_memory"),
                        config)
    if device_type != "cuda":
        return _checked(plan(CPU_KV_CACHE_MEMORY // bytes_per_block, "cpu default"), config)
    if mem_get_info is None or profile_peak is None:
        raise ValueError("sizing the KV cache on CUDA needs mem_get_info and profile_peak")
    free_before, total = mem_get_info()
    peak = profile_peak()
    graphs = graph_bytes(peak) if graph_bytes is not None else 0
    kv = kv_bytes_from_utilization(total, config.gpu_memory_utilization, total - free_before,
                                   peak, sampler_bytes, graphs)
    blocks = max(kv, 0) // bytes_per_block
    if blocks > MAX_AUTO_KV_BLOCKS:
        logger.info("KV cache capped at %d blocks (the memory left holds %d): the engine core "
                    "keeps one Python object per block", MAX_AUTO_KV_BLOCKS, blocks)
        blocks = MAX_AUTO_KV_BLOCKS
    result = plan(blocks, "gpu_memory_utilization", peak, total, graphs)
    if result.num_blocks < 2:
        raise ValueError(
            f"no room for the KV cache: gpu_memory_utilization={config.gpu_memory_utilization} of "
            f"{total / MiB:.0f} MiB is {total * config.gpu_memory_utilization / MiB:.0f} MiB, but "
            f"{(total - free_before) / MiB:.0f} MiB are already in use (weights "
            f"{weights_bytes / MiB:.0f} MiB), the profile run of max_num_batched_tokens "
            f"needs {peak / MiB:.0f} MiB more (the sampler {sampler_bytes / MiB:.0f} MiB) and "
            f"the CUDA graphs about {graphs / MiB:.0f} MiB; raise --gpu-memory-utilization, "
            "lower --max-num-batched-tokens or --max-num-seqs, use more tensor-parallel ranks, "
            "--enforce-eager, or free the GPU"
        )
    return result


def _checked(plan: KVCachePlan, config: EngineConfig) -> KVCachePlan:
    if plan.num_blocks < 2:
        if plan.source == "num_gpu_blocks_override":
            budget = f"num_gpu_blocks_override={config.num_gpu_blocks_override}"
        else:
            budget = f"kv_cache_memory={config.kv_cache_memory or CPU_KV_CACHE_MEMORY} bytes"
        raise ValueError(
            f"{budget} gives {plan.num_blocks} blocks of {plan.bytes_per_block} bytes; "
            "need at least 2 (block 0 is the null block)"
        )
    return plan


def weights_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers (tied tensors counted once)."""
    seen: set[int] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


@torch.inference_mode()
def profile_forward(model: LlamaForCausalLM, num_tokens: int, max_model_len: int,
                    max_num_seqs: int, block_size: int, device: torch.device) -> None:
    """One forward of num_tokens tokens (sequences of up to max_model_len, as the scheduler may
    plan them) plus the logits of up to max_num_seqs rows, on a 2-block scratch KV cache: every
    token writes into block 1 and every context reads block 1 again, so the attention does the
    work of the real lengths without a real-size cache."""
    from workers.attention.reference import AttentionMetadata

    lens: list[int] = []
    left = num_tokens
    while left > 0:
        lens.append(min(left, max_model_len))
        left -= lens[-1]
    qsl = np.zeros(len(lens) + 1, dtype=np.int32)
    qsl[1:] = np.cumsum(lens)
    seq_lens = np.asarray(lens, dtype=np.int32)
    width = -(-max(lens) // block_size)
    positions = np.concatenate([np.arange(n) for n in lens])
    model.allocate_kv_cache(2, block_size)

    def t(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dtype)

    meta = AttentionMetadata(
        slot_mapping=t(block_size + positions % block_size, torch.int64),
        query_start_loc=t(qsl, torch.int32),
        seq_lens=t(seq_lens, torch.int32),
        block_table=torch.ones((len(lens), width), dtype=torch.int32, device=device),
        query_start_loc_np=qsl,
        seq_lens_np=seq_lens,
        max_query_len=max(lens),
        max_seq_len=max(lens),
    )
    ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    hidden = model(ids, t(positions, torch.int64), meta)
    model.compute_logits(hidden[: min(max_num_seqs, num_tokens)])
    del hidden, meta
    model.allocate_kv_cache(0, block_size)  # drop the scratch cache before sizing the real one


def cuda_profile_peak(model: LlamaForCausalLM, num_tokens: int, max_model_len: int,
                      max_num_seqs: int, block_size: int, device: torch.device) -> int:
    """Peak memory the profile forward adds over what is allocated before it (CUDA)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    profile_forward(model, num_tokens, max_model_len, max_num_seqs, block_size, device)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    return max(peak, 0)


def plan_for_model(model: LlamaForCausalLM, config: EngineConfig, device: torch.device,
                   block_size: int, max_model_len: int, rank: int,
                   graph_shapes: tuple[int, int] | None = None,
                   lora_bytes: int = 0) -> KVCachePlan:
    """A loaded model's KV cache sizing on this rank (what the model runner allocates),
    logged once. graph_shapes: (number of CUDA graphs, the largest one's token count), None
    when this rank captures none. lora_bytes: the LoRA slot buffers, already allocated (on
    CUDA they are part of the memory in use when the sizing measures it)."""
    from workers.sample.peak_memory import sampler_peak_bytes

    budget = config.max_num_batched_tokens or default_max_batched_tokens(device.type)
    rows = config.max_num_seqs * (1 + config.num_speculative_tokens)  # drafts are sampled too

    def graph_bytes(peak: int) -> int:
        if graph_shapes is None:
            return 0
        return graph_pool_bytes(peak, budget, *graph_shapes)

    plan = plan_kv_cache(
        config,
        device_type=device.type,
        bytes_per_block=model.kv_cache_bytes_per_block(block_size),
        weights_bytes=weights_bytes(model),
        mem_get_info=lambda: torch.cuda.mem_get_info(device),
        profile_peak=lambda: cuda_profile_peak(model, budget, max_model_len,
                                               config.max_num_seqs, block_size, device),
        sampler_bytes=sampler_peak_bytes(rows, model.cfg.vocab_size, model.dtype.itemsize),
        graph_bytes=graph_bytes,
    )
    plan.lora_bytes = lora_bytes
    logger.info("%s", plan.log_line(rank, str(device)))
    return plan
