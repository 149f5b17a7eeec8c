"""Greedy tokens of the whole engine (real processes, sockets, gloo) equal transformers' generate.

One tiny random Llama saved with save_pretrained (fp32). The engine runs it at TP=1 with default
options and at TP=2 with a tiny token budget (chunked prefill), block size 4 (prefix-cache hits on
shared prefixes and on a second identical round) and a KV cache too small for the batch
(preemption by recompute); the TP=2 case again with async scheduling and with n-gram
speculative decoding. Every case must reproduce the reference tokens exactly.
"""

from __future__ import annotations

import random

import pytest

from launch import LLM, SamplingParams
from tests.helpers.procs import wait_no_descendants
from tests.helpers.tiny_llama import hf_greedy_refs, make_tiny_hf_llama

MAX_NEW = 12
VOCAB = 256


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(VOCAB) for _ in range(13)]
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (1, 5, 17, 30)]
    prompts += [shared + [rng.randrange(VOCAB) for _ in range(n)] for n in (2, 9)]
    prompts.append(shared[:8])  # entirely inside another prompt's cached blocks
    prompts.append([5, 9, 2, 7] * 5)  # repetitive: the n-gram proposer has drafts to verify
    return prompts


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list, list]:
    path = make_tiny_hf_llama(str(tmp_path_factory.mktemp("tiny-llama")))
    prompts = _prompts()
    return path, prompts, hf_greedy_refs(path, prompts, MAX_NEW)


CASES = {
    "tp1-defaults": dict(tensor_parallel_size=1),
    "tp2-chunked-prefix-preemption": dict(
        tensor_parallel_size=2,
        block_size=4,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        num_gpu_blocks_override=20,
        debug_invariants=True,
    ),
}
# the same pressure with async scheduling (two steps in flight) and with n-gram speculation
CASES["tp2-async-chunked-prefix-preemption"] = dict(
    CASES["tp2-chunked-prefix-preemption"], async_scheduling=True
)
CASES["tp2-spec-chunked-prefix-preemption"] = dict(
    CASES["tp2-chunked-prefix-preemption"], speculative_ngram=2, num_speculative_tokens=3
)
CASES["tp1-spec"] = dict(tensor_parallel_size=1, speculative_ngram=3, num_speculative_tokens=4)
# The Triton attention backend (the CUDA path's kernels), on CPU tensors under the Triton
# interpreter: the same pressure, and drafts.
CASES["tp2-triton-chunked-prefix-preemption"] = dict(
    CASES["tp2-chunked-prefix-preemption"], attention_backend="triton", device="cpu"
)
CASES["tp1-triton-spec"] = dict(CASES["tp1-spec"], attention_backend="triton", device="cpu")


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_equal_transformers(hf_model, case: str, monkeypatch) -> None:
    path, prompts, refs = hf_model
    if CASES[case].get("attention_backend") == "triton":
        pytest.importorskip("triton", reason="the triton package is not installed")
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # inherited by the worker processes
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    try:
        with LLM(model=path, **CASES[case]) as llm:
            first = llm.generate(prompts, params, use_tqdm=False, timeout_s=120)
            second = llm.generate(prompts, params, use_tqdm=False, timeout_s=120)
            stats = llm.stop_profile().stats
    finally:
        left = wait_no_descendants(10)
    assert left == [], f"processes outlived the engine: {left}"
    for i, ref in enumerate(refs):
        assert first[i].finish_reason == "length", first[i].error
        assert first[i].token_ids == ref, f"prompt {i} (len {len(prompts[i])}) first round"
        assert second[i].token_ids == ref, f"prompt {i} (len {len(prompts[i])}) second round"
    assert stats["prefix_cache_hits"] > 0
    if case.startswith("tp2"):
        assert stats["num_preemptions"] > 0, stats
    if "spec" in case:
        assert stats["spec_num_draft_tokens"] > 0, stats
