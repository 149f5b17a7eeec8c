"""Sliding-window and hybrid models through the whole engine: greedy tokens equal transformers.

Two tiny random checkpoints with a window of 8 tokens and block size 4, so every prompt but the
shortest is longer than the window and windowed layers give blocks back while they decode:
- Mistral-style: ``sliding_window`` on every layer (one KV cache group, all windowed);
- Qwen2-style hybrid: ``use_sliding_window`` with a ``layer_types`` list alternating sliding
  and full attention over 4 layers (two groups of two layers sharing cache tensors).
Each runs at TP=1 with defaults, at TP=2 with a tiny token budget (chunked prefill), a second
identical round (prefix-cache hits, the hybrid one a fixed point over both groups) and a KV cache
too small for the batch (preemption), and with the Triton kernel under the interpreter.
"""

from __future__ import annotations

import random

import pytest

from launch import LLM, SamplingParams
from tests.helpers.procs import wait_no_descendants
from tests.helpers.tiny_llama import hf_greedy_refs, make_tiny_hf_llama

MAX_NEW = 12
VOCAB = 256
WINDOW = 8

MODELS = {
    "mistral": dict(arch="mistral", sliding_window=WINDOW),
    "qwen2-hybrid": dict(
        arch="qwen2", num_hidden_layers=4, use_sliding_window=True, sliding_window=WINDOW,
        max_window_layers=0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention",
                     "full_attention"],
    ),
}


# KV blocks for the preemption cases: windowed layers hold so few blocks that the all-windowed
# model needs a much smaller cache than the hybrid one (whose full-attention group holds every
# block) before requests preempt each other
PREEMPTION_BLOCKS = {"mistral": 10, "qwen2-hybrid": 24}


def _prompts() -> list[list[int]]:
    rng = random.Random(11)
    shared = [rng.randrange(VOCAB) for _ in range(21)]
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (3, 9, 17, 30, 41)]
    prompts += [shared + [rng.randrange(VOCAB) for _ in range(n)] for n in (2, 11)]
    prompts.append(shared[:16])  # entirely inside another prompt's cached blocks
    return prompts


@pytest.fixture(scope="module", params=list(MODELS))
def hf_model(request, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str, list, list]:
    name = request.param
    path = make_tiny_hf_llama(str(tmp_path_factory.mktemp(name)), **MODELS[name])
    prompts = _prompts()
    refs = hf_greedy_refs(path, prompts, MAX_NEW)
    return name, path, prompts, refs


CASES = {
    "tp1": dict(tensor_parallel_size=1, block_size=4),
    "tp2-chunked-prefix-preemption": dict(
        tensor_parallel_size=2,
        block_size=4,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        num_gpu_blocks_override=0,  # PREEMPTION_BLOCKS[model]
        debug_invariants=True,
    ),
    "tp1-torch-chunked": dict(
        tensor_parallel_size=1, block_size=4, max_num_batched_tokens=16,
        attention_backend="torch", debug_invariants=True,
    ),
    "tp1-triton-chunked-preemption": dict(
        tensor_parallel_size=1, block_size=4, max_num_batched_tokens=16, max_num_seqs=4,
        num_gpu_blocks_override=0, attention_backend="triton", device="cpu",
        debug_invariants=True,
    ),
}


# The Triton interpreter runs the kernels in Python: a case takes minutes on a loaded 2-core
# machine. Its limits only catch a hang, so they are generous: they must hold on a slow box.
INTERPRETED_TIMEOUT_S = 900


@pytest.mark.timeout(2 * INTERPRETED_TIMEOUT_S + 120)
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_equal_transformers(hf_model, case: str, monkeypatch) -> None:
    name, path, prompts, refs = hf_model
    opts = CASES[case]
    if "num_gpu_blocks_override" in opts:
        opts = dict(opts, num_gpu_blocks_override=PREEMPTION_BLOCKS[name])
    if opts.get("attention_backend") == "triton":
        pytest.importorskip("triton", reason="the triton package is not installed")
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # inherited by the worker processes
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    limit = INTERPRETED_TIMEOUT_S if opts.get("attention_backend") == "triton" else 180
    try:
        with LLM(model=path, **opts) as llm:
            first = llm.generate(prompts, params, use_tqdm=False, timeout_s=limit)
            second = llm.generate(prompts, params, use_tqdm=False, timeout_s=limit)
            stats = llm.stop_profile().stats
    finally:
        left = wait_no_descendants(10)
    assert left == [], f"processes outlived the engine: {left}"
    for i, ref in enumerate(refs):
        assert first[i].finish_reason == "length", first[i].error
        assert first[i].token_ids == ref, f"{name} prompt {i} (len {len(prompts[i])}) first"
        assert second[i].token_ids == ref, f"{name} prompt {i} (len {len(prompts[i])}) second"
    assert stats["prefix_cache_hits"] > 0
    if "preemption" in case:
        assert stats["num_preemptions"] > 0, stats
