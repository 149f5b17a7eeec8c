"""Greedy tokens with --scheduling-policy continuum equal transformers' generate, at TP=1 and
TP=2 under KV pressure: two turns per job, the second extending the first's context (the pin's
prefix hit), with the block-pool invariants checked after every step."""

from __future__ import annotations

import random

import pytest

from launch import LLM, SamplingParams
from tests.helpers.procs import wait_no_descendants
from tests.helpers.tiny_llama import hf_greedy_refs, make_tiny_hf_llama

MAX_NEW = 8
VOCAB = 256


@pytest.fixture(scope="module")
def refs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list, list, list, list]:
    path = make_tiny_hf_llama(str(tmp_path_factory.mktemp("tiny-llama")))
    rng = random.Random(11)
    first = [[rng.randrange(VOCAB) for _ in range(n)] for n in (9, 14, 21, 6)]
    ref1 = hf_greedy_refs(path, first, MAX_NEW)
    second = [p + r + [rng.randrange(VOCAB) for _ in range(3)] for p, r in zip(first, ref1,
                                                                                strict=True)]
    return path, first, ref1, second, hf_greedy_refs(path, second, MAX_NEW)


@pytest.mark.parametrize("tp", [1, 2])
def test_continuum_greedy_tokens_equal_transformers(refs, tp: int) -> None:
    path, first, ref1, second, ref2 = refs
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    jobs = [f"job-{i}" for i in range(len(first))]
    try:
        with LLM(model=path, tensor_parallel_size=tp, scheduling_policy="continuum",
                 block_size=4, max_num_batched_tokens=16, max_num_seqs=3,
                 num_gpu_blocks_override=16, debug_invariants=True) as llm:
            out1 = llm.generate(first, params, use_tqdm=False, timeout_s=120, job_id=jobs,
                                tool_name=["grep"] * len(jobs))
            out2 = llm.generate(second, params, use_tqdm=False, timeout_s=120, job_id=jobs,
                                is_last_step=True)
            stats = llm.stop_profile().stats
    finally:
        left = wait_no_descendants(10)
    assert left == [], f"processes outlived the engine: {left}"
    for i in range(len(first)):
        assert out1[i].token_ids == ref1[i], f"job {i} turn 1"
        assert out2[i].token_ids == ref2[i], f"job {i} turn 2"
    assert stats["continuum_pins_created"] > 0, stats
    assert stats["continuum_pin_hits"] + stats["continuum_pressure_releases"] > 0, stats
    assert stats["continuum_pins"] == 0 and stats["continuum_pinned_blocks"] == 0, stats
