"""KV cache sizing: the gpu_memory_utilization arithmetic with stubbed device figures, the
overrides, the CPU default, and the profile forward itself (run on CPU)."""

from __future__ import annotations

import pytest
import torch

from protocol.config import CPU_KV_CACHE_MEMORY, EngineConfig
from workers.model.loader import load_model
from workers.runner.memory_profile import (
    kv_bytes_from_utilization,
    plan_kv_cache,
    profile_forward,
    weights_bytes,
)

GiB = 1024**3
MiB = 1024**2
PER_BLOCK = 2 * MiB  # e.g. Llama-3-8B at bf16: 2 (K,V) * 16 tokens * 8 heads * 128 * 32 layers * 2


def _never() -> tuple[int, int]:
    raise AssertionError("the device must not be queried here")


def test_utilization_arithmetic_hand_computed() -> None:
    # 80 GiB device, 0.9 -> 72 GiB usable; 17 GiB in use after loading (16 weights + 1 context),
    # 3 GiB peak in the profile run: 72 - 17 - 3 = 52 GiB of KV.
    assert kv_bytes_from_utilization(80 * GiB, 0.9, 17 * GiB, 3 * GiB) == 52 * GiB


def test_cuda_plan_uses_stubbed_queries() -> None:
    calls: list[str] = []

    def mem_get_info() -> tuple[int, int]:
        calls.append("mem")
        return 63 * GiB, 80 * GiB  # free, total: 17 GiB in use

    def profile() -> int:
        calls.append("profile")
        return 3 * GiB

    plan = plan_kv_cache(EngineConfig(), device_type="cuda", bytes_per_block=PER_BLOCK,
                         weights_bytes=16 * GiB, mem_get_info=mem_get_info,
                         profile_peak=profile)
    assert calls == ["mem", "profile"]  # free memory is read before the profile run
    assert plan.source == "gpu_memory_utilization"
    assert plan.num_blocks == 52 * GiB // PER_BLOCK == 26624
    assert plan.kv_bytes == 52 * GiB
    assert (plan.peak_activation_bytes, plan.total_bytes) == (3 * GiB, 80 * GiB)
    line = plan.log_line(0, "cuda:0")
    for part in ("rank 0 on cuda:0", "weights 16384.0 MiB", "peak activations 3072.0 MiB",
                 "KV cache 53248.0 MiB", "26624 blocks"):
        assert part in line


def test_utilization_rounds_down_to_whole_blocks() -> None:
    plan = plan_kv_cache(EngineConfig(gpu_memory_utilization=0.5), device_type="cuda",
                         bytes_per_block=3 * MiB, weights_bytes=GiB,
                         mem_get_info=lambda: (9 * GiB, 10 * GiB),
                         profile_peak=lambda: 100 * MiB)
    # 5 GiB - 1 GiB - 100 MiB = 4 GiB - 100 MiB = 3996 MiB -> 1332 blocks of 3 MiB
    assert plan.num_blocks == 1332


def test_overrides_beat_utilization_and_skip_the_profile() -> None:
    plan = plan_kv_cache(EngineConfig(num_gpu_blocks_override=100, kv_cache_memory=GiB),
                         device_type="cuda", bytes_per_block=PER_BLOCK, weights_bytes=0,
                         mem_get_info=_never, profile_peak=lambda: int(_never()[0]))
    assert (plan.num_blocks, plan.source) == (100, "num_gpu_blocks_override")
    plan = plan_kv_cache(EngineConfig(kv_cache_memory=GiB), device_type="cuda",
                         bytes_per_block=PER_BLOCK, weights_bytes=0, mem_get_info=_never,
                         profile_peak=lambda: int(_never()[0]))
    assert (plan.num_blocks, plan.source) == (512, "kv_cache_memory")


def test_cpu_keeps_the_fixed_budget() -> None:
    plan = plan_kv_cache(EngineConfig(), device_type="cpu", bytes_per_block=32768,
                         weights_bytes=0, mem_get_info=_never)
    assert plan.num_blocks == CPU_KV_CACHE_MEMORY // 32768 == 8192
    assert plan.source == "cpu default" and plan.peak_activation_bytes is None
    assert "peak activations not profiled" in plan.log_line(1, "cpu")


def test_no_room_says_what_to_do() -> None:
    with pytest.raises(ValueError, match="gpu-memory-utilization"):
        plan_kv_cache(EngineConfig(gpu_memory_utilization=0.2), device_type="cuda",
                      bytes_per_block=PER_BLOCK, weights_bytes=16 * GiB,
                      mem_get_info=lambda: (63 * GiB, 80 * GiB), profile_peak=lambda: 3 * GiB)
    with pytest.raises(ValueError, match="need at least 2"):
        plan_kv_cache(EngineConfig(kv_cache_memory=PER_BLOCK), device_type="cpu",
                      bytes_per_block=PER_BLOCK, weights_bytes=0)


def test_profile_forward_runs_and_leaves_the_model_usable() -> None:
    model, cfg = load_model("dummy:micro", 0, 1, torch.float32, torch.device("cpu"))
    # 3 sequences: 1024 + 1024 + 52 tokens at max_model_len 1024
    profile_forward(model, 2100, cfg.max_position_embeddings, 8, 16, torch.device("cpu"))
    assert weights_bytes(model) > 0
    model.allocate_kv_cache(4, 16)
    assert model.layers[0].self_attn.k_cache.shape[0] == 4


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU: sizes the KV cache from the device's memory")
def test_gpu_memory_utilization_on_the_device() -> None:
    from workers.parallel.distributed import DistEnv
    from workers.runner.model_runner import ModelRunner

    config = EngineConfig(model="dummy:qwen2-0.5b", dtype="bfloat16", max_model_len=4096,
                          max_num_batched_tokens=4096, gpu_memory_utilization=0.9)
    dist = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cuda", 0),
                   backend="nccl")
    runner = ModelRunner(config, dist)
    runner.load_model()
    plan = runner.plan_kv_cache()
    assert runner.model is not None and plan.peak_activation_bytes is not None
    runner.model.allocate_kv_cache(plan.num_blocks, config.block_size)
    free, total = torch.cuda.mem_get_info()
    # What is in use now plus the profile's peak is what utilization allows, within 5% of KV.
    slack = 0.9 * total - (total - free) - plan.peak_activation_bytes
    assert abs(slack) <= 0.05 * plan.kv_bytes, (slack, plan)


def test_sampler_peak_and_graph_pool_come_out_of_the_kv_cache() -> None:
    from workers.runner.memory_profile import GRAPH_OVERHEAD_BYTES, graph_pool_bytes
    from workers.sample.peak_memory import sampler_peak_bytes
    from workers.sample.sampler import TOP_P_CANDIDATES

    # Counted here from the sampler's code, not from the module under test: at 256 rows of
    # Llama 3's 128,256-token vocabulary with bf16 logits, every option on, min-p's masking
    # holds these [rows, vocab] tensors at once (bytes per element):
    rows, vocab = 256, 128_256
    alive = {
        "logits in the model dtype (bf16)": 2,
        "logits.float()": 4,
        "logits[rand_rows] (the random rows gathered)": 4,
        "x after temperature and top-k/top-p": 4,
        "softmax(x) in min-p": 4,
        "probs < threshold (bool)": 1,
        "x.masked_fill(...)": 4,
    }
    full_vocab = rows * vocab * sum(alive.values())
    # top-k/top-p candidates, [rows, 1024]: float32 values, int64 indices, float32
    # probabilities, cumulative sums and mass-before, a bool mask, one masked copy of values
    candidates = rows * TOP_P_CANDIDATES * (4 + 8 + 4 + 4 + 4 + 1 + 4)
    peak = sampler_peak_bytes(rows, vocab, 2)
    assert full_vocab + candidates <= peak <= full_vocab + 2 * candidates
    assert round(peak / GiB, 2) == 0.71  # the README's figure
    assert sampler_peak_bytes(0, vocab, 2) == 0
    # 35 graphs, the largest 256 tokens, from a 2 GiB profile peak at 8192 tokens
    graphs = graph_pool_bytes(2 * GiB, 8192, 35, 256)
    assert graphs == 2 * GiB // 32 + 35 * GRAPH_OVERHEAD_BYTES
    assert graph_pool_bytes(2 * GiB, 8192, 0, 256) == 0
    assert graph_pool_bytes(2 * GiB, 8192, 1, 16384) == 2 * GiB + GRAPH_OVERHEAD_BYTES

    cfg = EngineConfig(gpu_memory_utilization=0.9)

    def plan(sampler: int):
        return plan_kv_cache(cfg, device_type="cuda", bytes_per_block=PER_BLOCK,
                             weights_bytes=16 * GiB,
                             mem_get_info=lambda: (63 * GiB, 80 * GiB),
                             profile_peak=lambda: 3 * GiB, sampler_bytes=sampler,
                             graph_bytes=lambda p: p // 4)
    # 72 - 17 - max(3, 1) - 0.75 GiB
    small = plan(1 * GiB)
    assert small.kv_bytes == int(51.25 * GiB) and small.graph_bytes == 3 * GiB // 4
    # the sampler's peak beats the forward's: 72 - 17 - 4 - 0.75
    big = plan(4 * GiB)
    assert big.kv_bytes == int(50.25 * GiB) and big.sampler_bytes == 4 * GiB
    assert "sampler peak 4096.0 MiB" in big.log_line(0, "cuda:0")
