"""LoRA through the whole engine: the LLM API, the engine core process and real worker ranks
(gloo at TP=2) running the tiny HF Llama of tests/helpers/lora.py with its three PEFT adapters
(ranks 8/16/32, rsLoRA, q/v only, rank and alpha patterns). Greedy tokens must equal peft's
(`PeftModel`, unmerged, float32) for base-model and adapter requests mixed in one generate()
call, under chunked prefill (a 16-token budget), prefix-cache hits and preemption (a 20-block
KV cache), with fewer adapter slots than adapters (max_loras 2 and 1: skipped admissions, slot
reloads), at TP=1 and TP=2. The scheduler trace shows the per-step adapter budget holding; the
prefix cache keeps the base model's and each adapter's KV apart, and an adapter reloaded under
its name with new weights serves them, not stale KV."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine_core.sched.replay import load_trace, replay
from launch import LLM, LoRARequest, SamplingParams
from tests.helpers.lora import LoRAWorld
from tests.helpers.procs import wait_no_descendants

pytestmark = pytest.mark.timeout(300)

MAX_NEW = 8
# the runner tests' prompts (their peft references are shared), lengths 5..19: the longer
# ones take two chunks of the 16-token budget
PROMPTS = [[(7 * i + 3 * j + 1) % 256 for j in range(5 + 2 * i)] for i in range(8)]
# prompt 6's first 12 tokens and a tail, under prompt 6's adapter (its KV may be shared) and
# under another adapter (it may not)
PROMPTS += [PROMPTS[6][:12] + [9, 8, 7], PROMPTS[6][:12] + [9, 8, 7]]
LORAS = [0, 1, 2, 3, 1, 2, 3, 0, 3, 2]  # 0: the base model, i: adapter i (world.adapters[i-1])
# chunked prefill, prefix caching (on by default) and a KV cache too small for the batch
PRESSURE = dict(block_size=4, max_num_batched_tokens=16, max_num_seqs=8,
                num_gpu_blocks_override=20)
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


def _requests(world: LoRAWorld, loras: list[int]) -> list[LoRARequest | None]:
    return [LoRARequest(f"a{i}", i, world.adapters[i - 1]) if i else None for i in loras]


def _engine(world: LoRAWorld, **options: Any) -> LLM:
    return LLM(world.base, enable_lora=True, dtype="float32", max_lora_rank=32,
               debug_invariants=True, load_tokenizer=False, startup_timeout_s=120, **options)


def _generate(llm: LLM, world: LoRAWorld, prompts: list[list[int]], loras: list[int]) -> list:
    outs = llm.generate(prompts, GREEDY, lora_request=_requests(world, loras), use_tqdm=False,
                        timeout_s=120)
    for o in outs:
        assert o.finish_reason == "length", o.error
    return outs


def _mixed_rounds(llm: LLM, world: LoRAWorld) -> dict[str, float]:
    """The mixed batch twice (the second round finds the first's KV where it survived);
    every request's tokens equal peft's. Returns the engine's stats after."""
    want = world.expected(PROMPTS, LORAS, MAX_NEW)
    for rnd in range(2):
        outs = _generate(llm, world, PROMPTS, LORAS)
        for i, o in enumerate(outs):
            assert o.token_ids == want[i], f"round {rnd}, prompt {i}, adapter {LORAS[i]}"
    stats = llm.get_stats()
    assert stats["num_preemptions"] > 0, stats
    assert stats["prefix_cache_hits"] > 0, stats
    return stats


def _repeat_hits(llm: LLM, world: LoRAWorld, lora: int) -> None:
    """A prompt sent twice with an adapter: the second run reads the first's KV."""
    p = PROMPTS[7]
    (want,) = world.expected([p], [lora], MAX_NEW)
    first, second = (_generate(llm, world, [p], [lora])[0] for _ in range(2))
    assert first.token_ids == second.token_ids == want
    assert second.metrics.num_cached_tokens > 0


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_tp1_two_slots_for_three_adapters(lora_world: LoRAWorld, tmp_path: Path) -> None:
    """max_loras 2 with three adapters queued: tokens equal peft's, and the scheduler trace
    shows no step running three adapters, every request finishing, and replays to the same
    decisions."""
    trace = tmp_path / "trace.jsonl"
    try:
        with _engine(lora_world, max_loras=2, scheduler_trace=str(trace), **PRESSURE) as llm:
            # registered up front, so the requests reach the scheduler together, in order,
            # and the three adapters compete from the first steps on
            for i, path in enumerate(lora_world.adapters, start=1):
                llm.add_lora(LoRARequest(f"a{i}", i, path))
            stats = _mixed_rounds(llm, lora_world)
            _repeat_hits(llm, lora_world, 2)
        assert stats["lora_skips"] > 0 and stats["lora_evictions"] > 0, stats
    finally:
        assert wait_no_descendants(10) == []
    recs = _records(trace)  # complete: the engine core closed it at shutdown
    adapter = {r["rid"]: r.get("lora", [None, 0])[1] for r in recs if r["type"] == "arrival"}
    assert sorted(set(adapter.values())) == [0, 1, 2, 3]
    kinds = []
    for r in recs:
        if r["type"] == "step":
            ran = {adapter[rid] for rid, kind, _ in r["decisions"] if kind != "preempted"}
            kinds.append(len(ran - {0}))
    assert kinds and max(kinds) == 2, kinds  # the budget was reached, never passed
    finishes = {r["rid"]: r["reason"] for r in recs if r["type"] == "finish"}
    assert finishes == dict.fromkeys(adapter, "length")
    # the scheduler alone, fed the trace (adapters, hashes and all), decides the same
    res = replay(load_trace(str(trace)))
    assert len(res.replayed) == len(kinds) and res.mismatches == []


@pytest.mark.slow  # two worker ranks
def test_tp2_three_adapters_in_one_batch(lora_world: LoRAWorld) -> None:
    """TP=2 (padded heads and MLP rows: each rank holds its slice of every adapter) with a
    slot for every adapter, two steps in flight (async scheduling)."""
    try:
        with _engine(lora_world, tensor_parallel_size=2, max_loras=3, async_scheduling=True,
                     **PRESSURE) as llm:
            _mixed_rounds(llm, lora_world)
            _repeat_hits(llm, lora_world, 3)
    finally:
        assert wait_no_descendants(10) == []


# ------------------------------------------------- one slot: reloads, prefix-cache isolation


@pytest.fixture(scope="module")
def one_slot(lora_world: LoRAWorld) -> Iterator[LLM]:
    """TP=1, one adapter slot and one host copy per rank: every change of adapter reloads the
    slot (and reads the adapter again). A KV cache large enough that nothing is evicted."""
    try:
        with _engine(lora_world, max_loras=1, max_cpu_loras=1, block_size=4) as llm:
            yield llm
    finally:
        assert wait_no_descendants(10) == []


def test_one_slot_for_three_adapters(one_slot: LLM, lora_world: LoRAWorld) -> None:
    before = one_slot.get_stats()
    want = lora_world.expected(PROMPTS, LORAS, MAX_NEW)
    outs = _generate(one_slot, lora_world, PROMPTS, LORAS)
    assert [o.token_ids for o in outs] == want
    stats = one_slot.get_stats()
    # three adapters through one slot: at least two of them pushed another one out
    assert stats["lora_evictions"] - before["lora_evictions"] >= 2, stats


def test_prefix_cache_keeps_adapters_apart(one_slot: LLM, lora_world: LoRAWorld) -> None:
    p = [(5 * j + 2) % 256 for j in range(22)]
    want = dict(zip(range(4), lora_world.expected([p] * 4, [0, 1, 2, 3], MAX_NEW), strict=True))

    def run(lora: int) -> tuple[list[int], int]:
        (o,) = _generate(one_slot, lora_world, [p], [lora])
        assert o.token_ids == want[lora], f"adapter {lora}"
        return o.token_ids, o.metrics.num_cached_tokens

    run(0)
    assert run(0)[1] > 0  # the base model's KV of p is cached
    assert run(1)[1] == 0  # ... and not used for an adapter
    assert run(1)[1] > 0  # adapter 1's own KV is
    assert run(2)[1] == 0  # ... and not used for another adapter
    assert run(0)[1] > 0  # the base model's is still there


def test_reloaded_adapter_serves_its_new_weights(one_slot: LLM, lora_world: LoRAWorld,
                                                 tmp_path: Path) -> None:
    """Unloaded and loaded again under the same name, id and directory whose files changed:
    the new weights run, and the KV cached for the old ones is not reused."""
    p = PROMPTS[5]
    want = lora_world.expected([p, p], [1, 3], MAX_NEW)
    path = tmp_path / "m"
    shutil.copytree(lora_world.adapters[0], path)
    lora = LoRARequest("m", 11, str(path))
    one_slot.add_lora(lora)
    outs = [one_slot.generate([p], GREEDY, lora_request=lora, use_tqdm=False)[0]
            for _ in range(2)]
    assert [o.token_ids for o in outs] == [want[0]] * 2
    assert outs[1].metrics.num_cached_tokens > 0
    one_slot.remove_lora("m")
    shutil.rmtree(path)
    shutil.copytree(lora_world.adapters[2], path)  # adapter 3's weights under m's name
    one_slot.add_lora(lora)
    out = one_slot.generate([p], GREEDY, lora_request=lora, use_tqdm=False)[0]
    assert out.token_ids == want[1]
    assert out.metrics.num_cached_tokens == 0
    one_slot.remove_lora("m")
