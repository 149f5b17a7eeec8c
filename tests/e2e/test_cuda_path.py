"""The CUDA path as a whole (Triton attention, CUDA graphs for decode steps, pinned staging)
against transformers' generate on the same weights. Skips where no GPU is present; CI has none,
so these run on the GPU machines a session is lent."""

from __future__ import annotations

import random

import pytest
import torch

from launch import LLM, SamplingParams
from tests.helpers.procs import wait_no_descendants
from tests.helpers.tiny_llama import hf_greedy_refs, hf_greedy_steps, make_tiny_hf_llama

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MAX_NEW = 12


def _prompts() -> list[list[int]]:
    rng = random.Random(11)
    shared = [rng.randrange(256) for _ in range(20)]
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (1, 3, 17, 40, 90)]
    prompts += [shared + [rng.randrange(256) for _ in range(n)] for n in (2, 9)]
    prompts.append([5, 9, 2, 7] * 6)  # repetitive: drafts to verify
    return prompts


@pytest.fixture(scope="module")
def hf_case(tmp_path_factory: pytest.TempPathFactory):
    path = make_tiny_hf_llama(str(tmp_path_factory.mktemp("cuda-llama")))
    return path, hf_greedy_refs(path, _prompts(), MAX_NEW)


CASES = {
    "graphs": dict(),
    "eager": dict(enforce_eager=True),
    # 31 usable blocks of 4 tokens hold the longest prompt's 102 tokens (the engine caps a
    # request at the KV capacity) but not every request at once: preemption and chunks
    "graphs-pressure": dict(block_size=4, max_num_batched_tokens=16, max_num_seqs=4,
                            num_gpu_blocks_override=32, debug_invariants=True),
    "graphs-spec": dict(speculative_ngram=3, num_speculative_tokens=3),
    # async scheduling on CUDA overlaps each rank's host work with its device by default
    # (worker overlap): graphed and eager steps, and under KV pressure (preemption, chunks)
    "graphs-async": dict(async_scheduling=True),
    "eager-async": dict(async_scheduling=True, enforce_eager=True),
    "graphs-async-pressure": dict(block_size=4, max_num_batched_tokens=16, max_num_seqs=4,
                                  num_gpu_blocks_override=32, debug_invariants=True,
                                  async_scheduling=True),
    "torch-backend": dict(attention_backend="torch", enforce_eager=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_cuda_greedy_tokens_equal_transformers(hf_case, case: str) -> None:
    path, refs = hf_case
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    try:
        with LLM(model=path, device="cuda", dtype="float32", **CASES[case]) as llm:
            outs = llm.generate(_prompts(), params, use_tqdm=False, timeout_s=300)
    finally:
        left = wait_no_descendants(10)
    assert left == [], f"processes outlived the engine: {left}"
    for i, ref in enumerate(refs):
        assert outs[i].token_ids == ref, f"prompt {i}"


# bf16 against transformers in bf16 on the same GPU: the two round at different points (fused
# kernels, float32 accumulation in the attention), so logits differ by a few bf16 ulps of a
# logit of magnitude ~10-30 (ulp 0.06-0.125). Measured on CPU (torch backend vs transformers,
# both bf16): at most 0.073 in the chosen token's logprob over 64 steps.
BF16_LOGPROB_TOL = 0.15
BF16_NEW = 6  # short runs: a bf16 near-tie late in a long run may rightly go either way


@pytest.fixture(scope="module")
def hf_bf16_case(hf_case):
    path, _ = hf_case
    return path, hf_greedy_steps(path, _prompts(), BF16_NEW, torch.bfloat16, "cuda")


@pytest.mark.parametrize("case", ["graphs", "eager", "graphs-spec"])
def test_cuda_bf16_matches_transformers_bf16(hf_bf16_case, case: str) -> None:
    """Greedy tokens equal transformers' in bf16 up to the first step where transformers'
    own top-2 logits are closer than twice the tolerance (there a rounding difference may pick
    either, and the runs then rightly diverge); every compared token's logprob within
    BF16_LOGPROB_TOL. At least one token per prompt must be compared on average, so the check
    is not vacuous (the tiny model's 256-token vocabulary has near-ties often: on CPU 14 of
    its 48 steps come before a prompt's first one, and only 1 of 8 prompts has none)."""
    path, refs = hf_bf16_case
    params = SamplingParams(max_tokens=BF16_NEW, temperature=0.0, ignore_eos=True, logprobs=True)
    try:
        with LLM(model=path, device="cuda", dtype="bfloat16", **CASES[case]) as llm:
            assert llm.info.dtype == "bfloat16"
            outs = llm.generate(_prompts(), params, use_tqdm=False, timeout_s=300)
    finally:
        left = wait_no_descendants(10)
    assert left == [], f"processes outlived the engine: {left}"
    compared = 0
    for i, (tokens, logprobs, gaps) in enumerate(refs):
        got, got_lp = outs[i].token_ids, outs[i].logprobs
        assert got_lp is not None
        for j, want in enumerate(tokens):
            assert abs(got_lp[j] - logprobs[j]) <= BF16_LOGPROB_TOL, (i, j, got_lp[j], logprobs[j])
            if gaps[j] < 2 * BF16_LOGPROB_TOL:
                break
            assert got[j] == want, f"prompt {i} step {j}: {got} vs {tokens}"
            compared += 1
    assert compared >= len(refs), f"only {compared} tokens compared over {len(refs)} prompts"


def test_cuda_auto_dtype_runs_real_shape_presets_in_bf16() -> None:
    with LLM(model="dummy:smollm2-135m", device="cuda", max_model_len=256,
             max_num_seqs=8) as llm:
        assert llm.info.dtype == "bfloat16"
        outs = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True),
                            use_tqdm=False, timeout_s=300)
    assert len(outs[0].token_ids) == 4
