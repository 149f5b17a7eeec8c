"""The CUDA path as a whole (Triton attention, CUDA graphs for decode steps, pinned staging)
against transformers' generate on the same weights. Skips where no GPU is present; CI has none,
so these run on the GPU machines a session is lent."""

from __future__ import annotations

import random

import pytest
import torch

from launch import LLM, SamplingParams
from tests.helpers.procs import wait_no_descendants
from tests.helpers.tiny_llama import hf_greedy_refs, make_tiny_hf_llama

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
    "graphs-pressure": dict(block_size=4, max_num_batched_tokens=16, max_num_seqs=4,
                            num_gpu_blocks_override=24, debug_invariants=True),
    "graphs-spec": dict(speculative_ngram=3, num_speculative_tokens=3),
    "graphs-async": dict(async_scheduling=True),
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
