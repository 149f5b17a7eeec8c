"""Greedy tokens with images, through the whole engine, equal transformers' generate (fp32).

Tiny random Qwen2-VL and Qwen2.5-VL checkpoints; prompts with 0 to 3 images of different
sizes, given as vLLM takes them (prompt ids with one image pad per image, and the images). At
TP=1 with defaults, and at TP=2 with an 8-token budget (chunks end inside images), a
12-embedding encoder budget, block size 4 and too little KV for the batch (preemption). Each
engine runs the prompts twice: the second round hits the prefix cache and the encoder cache.
"""

from __future__ import annotations

import pytest

from launch import LLM, SamplingParams
from tests.helpers.procs import wait_no_descendants
from tests.helpers.tiny_vl import (
    END,
    FAMILIES,
    IMAGE,
    START,
    hf_greedy_with_images,
    make_tiny_hf_vl,
    vl_cases,
    vl_expanded,
    vl_images,
)

MAX_NEW = 8





@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    hf = make_tiny_hf_vl(path, request.param)
    cases = vl_cases(1, 2)
    refs = [hf_greedy_with_images(hf, vl_expanded(ids, imgs), imgs, MAX_NEW)
            for ids, imgs in cases]
    assert refs[1] != refs[2], "the random model ignores its images"
    return path, cases, refs


CASES = {
    "tp1-defaults": dict(tensor_parallel_size=1),
    "tp2-chunks-inside-images-preemption": dict(
        tensor_parallel_size=2, block_size=4, max_num_batched_tokens=8,
        max_num_encoder_input_tokens=12, encoder_cache_size=24, max_num_seqs=3,
        num_gpu_blocks_override=14, debug_invariants=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_with_images_equal_transformers(checkpoint, case: str) -> None:
    path, cases, refs = checkpoint
    prompts = [{"prompt_token_ids": ids, "multi_modal_data": {"image": imgs}}
               for ids, imgs in cases]
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    try:
        with LLM(model=path, **CASES[case]) as llm:
            llm.start_profile(torch_profiler=False)
            first = llm.generate(prompts, params, use_tqdm=False, timeout_s=180)
            second = llm.generate(prompts, params, use_tqdm=False, timeout_s=180)
            stats = llm.stop_profile().stats
    finally:
        wait_no_descendants()
    for round_ in (first, second):
        assert [o.token_ids for o in round_] == refs
    # the second round re-encodes nothing that stayed cached, and hits the prefix cache
    assert stats["prefix_cache_hits"] > 0
    assert stats["encoder_cache_hits"] > 0
    distinct = 5  # a[0], b[0], a[1], a[2], b[1]
    assert distinct <= stats["encoder_cache_misses"] < 2 * distinct + 1


def test_an_image_read_by_eight_requests_runs_the_encoder_once(tmp_path) -> None:
    path = str(tmp_path / "vl")
    make_tiny_hf_vl(path, "qwen2_vl")
    img = vl_images(3)[1]
    prompts = [{"prompt_token_ids": [5 + i, START, IMAGE, END, 30 + i],
                "multi_modal_data": {"image": img}} for i in range(8)]
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    try:
        with LLM(model=path) as llm:
            llm.start_profile(torch_profiler=False)
            outs = llm.generate(prompts, params, use_tqdm=False, timeout_s=120)
            stats = llm.stop_profile().stats
    finally:
        wait_no_descendants()
    assert all(len(o.token_ids) == 2 for o in outs)
    assert stats["encoder_runs"] == 1 and stats["encoder_cache_hits"] == 7
