"""Through the real engine (dummy:tiny, TP=1, a small KV cache): the admission gate removes the
preemptions of a thrashing workload without changing a token, the engine core writes the
scheduler trace with wall times, and a replay of that trace through the scheduler alone makes
the recorded decisions step by step."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import pytest

from engine_core.sched.replay import load_trace, replay
from launch.llm import LLM
from protocol.messages import SamplingParams
from tests.helpers.procs import wait_no_descendants

BLOCKS = 10  # 9 usable blocks of 16 tokens; each request's whole sequence needs 4-5
OUT = 40


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    shared = [rng.randrange(3, 30000) for _ in range(16)]  # one block every prompt shares
    return [shared + [rng.randrange(3, 30000) for _ in range(rng.randrange(4, 20))]
            for _ in range(8)]


def _run(trace: Path, gate: bool) -> tuple[list[list[int]], dict[str, float]]:
    sp = SamplingParams(max_tokens=OUT, temperature=0.0, ignore_eos=True)
    with LLM(
        "dummy:tiny",
        1,
        load_tokenizer=False,
        startup_timeout_s=120,
        num_gpu_blocks_override=BLOCKS,
        max_num_batched_tokens=32,
        debug_invariants=True,
        scheduler_reserve_full_isl=gate,
        scheduler_trace=str(trace),
    ) as llm:
        outs = llm.generate(_prompts(), sp, use_tqdm=False, timeout_s=300)
        assert all(o.finish_reason == "length" for o in outs), [o.error for o in outs]
        stats = _settled_stats(llm)
    return [o.token_ids for o in outs], stats


def _settled_stats(llm: LLM, timeout_s: float = 60.0) -> dict[str, float]:
    """The stats once the engine has nothing left to step: the last outputs reach the caller
    before the step that tells the ranks to forget those requests, so a read right after
    generate() may come before that step (a loaded machine makes it likely)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = llm.get_stats()
        if not (stats["num_running"] or stats["num_waiting"] or stats["num_handles_to_forget"]):
            return stats
        assert time.monotonic() < deadline, f"engine not idle after {timeout_s} s: {stats}"
        time.sleep(0.05)


def _records(path: Path, kind: str) -> list[dict[str, Any]]:
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in recs if r["type"] == kind]


@pytest.mark.slow  # two engines (one process each beside the core)
def test_gate_and_trace_through_the_engine(tmp_path: Path) -> None:
    try:
        off_trace, on_trace = tmp_path / "off.jsonl", tmp_path / "on.jsonl"
        tokens_off, stats_off = _run(off_trace, gate=False)
        tokens_on, stats_on = _run(on_trace, gate=True)
        print(f"\npreemptions: {stats_off['num_preemptions']:.0f} without the gate, "
              f"{stats_on['num_preemptions']:.0f} with it")
        assert tokens_on == tokens_off
        assert stats_off["num_preemptions"] > 0 and stats_on["num_preemptions"] == 0
        for path, stats in ((off_trace, stats_off), (on_trace, stats_on)):
            steps = _records(path, "step")
            # the health ping's get_stats counts every step; the trace holds each one
            assert len(steps) == stats["num_steps"]
            assert sum(r["preemptions"] for r in steps) == stats["num_preemptions"]
            assert all(r["wall_s"] is not None and r["wall_s"] > 0 for r in steps)
            assert len(_records(path, "arrival")) == 8
            assert sorted(r["output_len"] for r in _records(path, "finish")) == [OUT] * 8
            res = replay(load_trace(str(path)))
            assert len(res.replayed) == len(steps)
            assert res.mismatches == []
    finally:
        assert wait_no_descendants(10) == []
