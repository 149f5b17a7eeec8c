"""KV offload tiers end to end: greedy tokens equal transformers' generate while
the device pool is far smaller than the workload and evicted prefixes come back from the
host tier (and the disk tier).

A multi-turn chat: every conversation's next turn is its previous prompt, the reference answer
and a few new tokens, so the turns' prefixes were computed before, then pushed out of the
small device pool by the other conversations, and are restored instead of recomputed. The
turns of all conversations run as one batch, so the pool also preempts under pressure (the
victims' blocks are offloaded and restored on resume). The stats prove the path ran, and
the scheduler trace, with the tiers' counts and the workers' disk-read reports, replays through
the scheduler alone to the same decisions.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine_core.sched.replay import load_trace, replay
from launch import LLM, SamplingParams
from tests.helpers.procs import wait_no_descendants
from tests.helpers.tiny_llama import make_tiny_hf_llama

MAX_NEW = 8
VOCAB = 256
NUM_CONVS = 5
NUM_TURNS = 3
# the tiny model's KV per block (block size 4, fp32): 2 layers x K,V x 4 x 2 heads x 16 x 4 B
# = 2 KiB at TP=1 (half of it per rank at TP=2)
BLOCK_BYTES = 2048


@pytest.fixture(scope="module")
def conversations(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list, list]:
    """(model path, prompts per turn, reference answers per turn)."""
    import transformers

    path = make_tiny_hf_llama(str(tmp_path_factory.mktemp("tiny-llama")))
    model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    rng = random.Random(19)
    history = [[rng.randrange(VOCAB) for _ in range(14 + 2 * c)] for c in range(NUM_CONVS)]
    turns, refs = [], []
    with torch.no_grad():
        for _ in range(NUM_TURNS):
            prompts = [list(h) for h in history]
            answers = []
            for p in prompts:
                out = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p),
                                     dtype=torch.long), max_new_tokens=MAX_NEW,
                                     do_sample=False, pad_token_id=0)
                answers.append(out[0, len(p):].tolist())
            turns.append(prompts)
            refs.append(answers)
            for h, a in zip(history, answers, strict=True):
                h.extend(a + [rng.randrange(VOCAB) for _ in range(5)])
    assert len({tuple(a) for a in refs[0]}) > 2  # the answers depend on the context
    return path, turns, refs


BASE = dict(block_size=4, max_num_batched_tokens=32, max_num_seqs=4,
            num_gpu_blocks_override=24, debug_invariants=True)
CASES = {
    "tp1-host": dict(BASE, tensor_parallel_size=1, kv_offload_memory=128 * BLOCK_BYTES),
    "tp2-host-async": dict(BASE, tensor_parallel_size=2, async_scheduling=True,
                           kv_offload_memory=64 * BLOCK_BYTES // 2),
    # a host tier of 10 blocks: most of the workload spills to disk and is read back from it
    "tp1-host-disk": dict(BASE, tensor_parallel_size=1, kv_offload_memory=10 * BLOCK_BYTES,
                          kv_offload_disk_size=256 * (BLOCK_BYTES + 4096)),
    # the admission gate: admitted requests never preempt each other, restores still count
    "tp1-host-gate": dict(BASE, tensor_parallel_size=1, kv_offload_memory=128 * BLOCK_BYTES,
                          scheduler_reserve_full_isl=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_offloaded_prefixes_come_back(conversations, case: str, tmp_path) -> None:
    path, turns, refs = conversations
    opts = dict(CASES[case])
    if "kv_offload_disk_size" in opts:
        opts["kv_offload_disk"] = str(tmp_path / "kv")
    trace = tmp_path / "trace.jsonl"
    opts["scheduler_trace"] = str(trace)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    outs = []
    try:
        with LLM(model=path, **opts) as llm:
            for prompts in turns:
                outs.append(llm.generate(prompts, params, use_tqdm=False, timeout_s=120))
            stats = llm.stop_profile().stats
    finally:
        left = wait_no_descendants(10)
    assert left == [], f"processes outlived the engine: {left}"
    for t, (got, want) in enumerate(zip(outs, refs, strict=True)):
        for c, (o, ref) in enumerate(zip(got, want, strict=True)):
            assert o.finish_reason == "length", o.error
            assert o.token_ids == ref, f"turn {t} conversation {c}"
    assert stats["kv_offload_offloaded"] > 0, stats
    assert stats["kv_offload_host_hits"] > 0, stats
    assert stats["kv_offload_restored_tokens"] > 0, stats
    assert stats["kv_offload_bytes_host_to_device"] > 0, stats
    if "gate" in case:
        assert stats["num_preemptions"] == 0, stats
    else:
        assert stats["num_preemptions"] > 0 and stats["kv_offload_preempt_offloaded"] > 0, stats
    rec = load_trace(str(trace))
    steps = rec.steps.values()
    assert sum(r["kv_offload"]["host_hits"] for r in steps) == stats["kv_offload_host_hits"]
    res = replay(rec)
    assert res.mismatches == []
    assert res.stats["kv_offload_host_hits"] == stats["kv_offload_host_hits"]
    if "disk" in case:
        assert any("kv_load" in r for r in steps)
        assert stats["kv_offload_spilled"] > 0, stats
        assert stats["kv_offload_disk_hits"] > 0, stats
