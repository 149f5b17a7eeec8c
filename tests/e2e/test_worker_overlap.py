"""Worker overlap end to end: the same requests give the same tokens with the worker loop's
overlap on and off (async scheduling, real processes and sockets, TP=2 with checksums, so the
engine stops if two ranks ever disagree: each rank decides on its own whether a step
overlapped). One workload holds every feature whose meaning overlap must keep: greedy and
seeded sampling with logprobs, grammar-constrained requests, a KV cache small enough to
preempt, chunked prefill, and a second round whose prefixes come back from the KV offload host
tier. TP=1 runs the same features through the overlap order step by step, in one process
(tests/workers/runner/test_overlap_order.py).

On CPU every op is synchronous, so this checks correctness; the gain is measured on a GPU.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from launch import LLM, SamplingParams, StructuredOutputsParams
from tests.helpers.procs import wait_no_descendants
from tests.serve.serve_helpers import make_tokenizer_dir

CHOICES = ["the quick fox", "lazy dog", "hello world"]


def _workload() -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(3)
    shared = [rng.randrange(3, 512) for _ in range(12)]
    prompts, params = [], []
    for i in range(10):
        own = [rng.randrange(3, 512) for _ in range(rng.randrange(2, 20))]
        prompts.append(shared + own if i % 2 else own)
        kind = i % 4
        if kind == 0:
            sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
        elif kind == 1:
            sp = SamplingParams(max_tokens=10, temperature=1.0, top_k=50, seed=i,
                                logprobs=True, ignore_eos=True)
        elif kind == 2:
            sp = SamplingParams(max_tokens=12, temperature=0.9, seed=i,
                                structured_outputs=StructuredOutputsParams(choice=CHOICES))
        else:
            sp = SamplingParams(max_tokens=12, temperature=0.0, structured_outputs=(
                StructuredOutputsParams(regex=r"[a-z]{2,5}( [a-z]{1,4}){0,2}")))
        params.append(sp)
    return prompts, params


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tokenizer_dir(str(tmp_path_factory.mktemp("tok")))


def _run(tok_dir: str, tp: int, overlap: bool) -> tuple[list[Any], dict[str, float]]:
    prompts, params = _workload()
    options: dict[str, Any] = dict(
        tensor_parallel_size=tp, tokenizer=tok_dir, async_scheduling=True,
        worker_overlap=overlap, enable_checksum=tp > 1, debug_invariants=True,
        block_size=4, max_num_batched_tokens=24, max_num_seqs=6, num_gpu_blocks_override=24,
        kv_offload_memory=1 << 20)
    try:
        with LLM(model="dummy:micro", **options) as llm:
            first = llm.generate(prompts, params, use_tqdm=False, timeout_s=120)
            second = llm.generate(prompts, params, use_tqdm=False, timeout_s=120)
            stats = llm.get_stats()
    finally:
        left = wait_no_descendants(10)
    assert left == [], f"processes outlived the engine: {left}"
    return first + second, stats


def test_tokens_equal_with_overlap_on_and_off_at_tp2(tok_dir: str) -> None:
    pytest.importorskip("xgrammar")
    off, off_stats = _run(tok_dir, 2, overlap=False)
    on, on_stats = _run(tok_dir, 2, overlap=True)
    for i, (a, b) in enumerate(zip(off, on, strict=True)):
        assert a.finish_reason in ("stop", "length"), a.error
        assert b.token_ids == a.token_ids, f"request {i}"
        if a.logprobs is not None:
            assert b.logprobs == pytest.approx(a.logprobs, abs=1e-4), f"request {i}"
        if i % 10 % 4 == 2:  # the choice constraint (two rounds of ten)
            assert b.text in CHOICES, b.text
    for stats in (off_stats, on_stats):
        assert stats["num_preemptions"] > 0, stats
        assert stats["kv_offload_bytes_host_to_device"] > 0, stats
