"""Greedy tokens of the whole engine equal transformers' generate for Qwen3, Qwen3-MoE (one dense
layer via mlp_only_layers) and Mixtral: tiny random checkpoints saved with save_pretrained (fp32),
at TP=1 with default options and at TP=2 under chunked prefill, prefix-cache hits and
preemption; Qwen3-MoE also on the Triton path (attention and the fused MoE kernels) on CPU
tensors under the Triton interpreter."""

from __future__ import annotations

import random

import pytest

from launch import LLM, SamplingParams
from tests.helpers.procs import wait_no_descendants
from tests.helpers.tiny_llama import hf_greedy_refs, make_tiny_hf_llama

MAX_NEW = 10
VOCAB = 256
FAMILIES = {
    "qwen3": dict(arch="qwen3", head_dim=24),
    "qwen3_moe": dict(arch="qwen3_moe", mlp_only_layers=[0], norm_topk_prob=True),
    "mixtral": dict(arch="mixtral"),
}
PRESSURE = dict(tensor_parallel_size=2, block_size=4, max_num_batched_tokens=16, max_num_seqs=4,
                num_gpu_blocks_override=20, debug_invariants=True)
CASES = [("qwen3", "tp1"), ("qwen3", "tp2-pressure"), ("qwen3_moe", "tp1"),
         ("qwen3_moe", "tp2-pressure"), ("mixtral", "tp1"), ("mixtral", "tp2-pressure"),
         ("qwen3_moe", "tp2-triton-pressure")]
OPTIONS = {"tp1": dict(tensor_parallel_size=1), "tp2-pressure": PRESSURE,
           "tp2-triton-pressure": dict(PRESSURE, attention_backend="triton", device="cpu")}


def _prompts() -> list[list[int]]:
    rng = random.Random(11)
    shared = [rng.randrange(VOCAB) for _ in range(13)]
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (1, 5, 17, 30)]
    prompts += [shared + [rng.randrange(VOCAB) for _ in range(n)] for n in (2, 9)]
    prompts.append(shared[:8])
    return prompts


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, list, list]]:
    out = {}
    prompts = _prompts()
    for name, kw in FAMILIES.items():
        path = make_tiny_hf_llama(str(tmp_path_factory.mktemp(name)), **kw)
        out[name] = (path, prompts, hf_greedy_refs(path, prompts, MAX_NEW))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("family,case", CASES, ids=[f"{f}-{c}" for f, c in CASES])
def test_greedy_tokens_equal_transformers(models, family: str, case: str, monkeypatch) -> None:
    path, prompts, refs = models[family]
    if "triton" in case:
        pytest.importorskip("triton", reason="the triton package is not installed")
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # inherited by the worker processes
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    try:
        with LLM(model=path, **OPTIONS[case]) as llm:
            first = llm.generate(prompts, params, use_tqdm=False, timeout_s=180)
            second = llm.generate(prompts, params, use_tqdm=False, timeout_s=180)
            stats = llm.stop_profile().stats
    finally:
        left = wait_no_descendants(10)
    assert left == [], f"processes outlived the engine: {left}"
    for i, ref in enumerate(refs):
        assert first[i].finish_reason == "length", first[i].error
        assert first[i].token_ids == ref, f"prompt {i} (len {len(prompts[i])}) first round"
        assert second[i].token_ids == ref, f"prompt {i} (len {len(prompts[i])}) second round"
    assert stats["prefix_cache_hits"] > 0
    if "pressure" in case:
        assert stats["num_preemptions"] > 0, stats
