"""The per-step scheduler trace: what a step record holds, and a replay through the scheduler
alone (engine_core/sched/replay.py, bench_scheduler.py --replay) that makes the same
decisions step by step."""

from __future__ import annotations

import io
import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from engine_core.request import RequestStatus
from engine_core.sched.replay import read_trace, replay
from engine_core.sched.scheduler import Scheduler
from engine_core.sched.trace import SchedulerTrace, trace_header
from tests.engine_core.fake_worker import (
    FakeWorker,
    make_request,
    make_scheduler,
    next_token,
    run_async_to_completion,
    run_to_completion,
    tokens_of,
)

ROOT = Path(__file__).resolve().parents[3]
BS = 4


def traced(**cfg: Any) -> tuple[Scheduler, io.BytesIO]:
    s = make_scheduler(
        num_blocks=cfg.pop("num_blocks", 24),
        max_num_batched_tokens=16,
        block_size=BS,
        eos_token_id=13,
        **cfg,
    )
    buf = io.BytesIO()
    s.trace = SchedulerTrace(buf, trace_header(s))
    return s, buf


def add_workload(s: Scheduler, seed: int = 1) -> None:
    """Shared prefixes (prefix hits), EOS on some requests (stops), more KV than the cache
    holds (preemptions)."""
    rng = random.Random(seed)
    shared = [rng.randrange(10, 99) for _ in range(8)]
    for i in range(12):
        prompt = shared[: rng.randrange(0, 9)] + [
            rng.randrange(10, 99) for _ in range(rng.randrange(2, 30))
        ]
        eos = 13 if i % 3 == 0 else None
        lora = i % 4 if s.lora is not None else 0  # with LoRA: three adapters and the base
        s.add_request(make_request(f"r{i}", prompt, max_tokens=rng.randrange(4, 30), eos=eos,
                                   lora=lora))


def model(tokens: list[int]) -> int:
    """The fake worker's model, with EOS (13) at every 9th position, so requests stop."""
    return 13 if len(tokens) % 9 == 0 else next_token(tokens)


def lines(buf: io.BytesIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in buf.getvalue().splitlines()]


def on_step(k: int, s: Scheduler) -> None:
    """Arrivals and aborts between steps, as the engine core's frontend poll makes them."""
    if k == 4:
        s.finish_requests(["r3", "r7"], RequestStatus.FINISHED_ABORTED)
    if k == 6:
        s.add_request(make_request("late", [20, 21, 22] * 5, max_tokens=12))


def record(async_scheduling: bool, **cfg: Any) -> tuple[io.BytesIO, dict[str, list[int]], float]:
    s, buf = traced(async_scheduling=async_scheduling, **cfg)
    add_workload(s)
    w = FakeWorker(BS, model=model)
    if async_scheduling:
        outs = run_async_to_completion(s, w, on_step=on_step)
    else:
        outs = {}
        for k in range(10_000):  # run_to_completion, with on_step's arrivals and aborts
            if not s.has_unfinished_requests():
                break
            so = s.schedule()
            on_step(k, s)
            for o in s.update_from_output(so, w.step(so)) + s.take_outputs():
                outs.setdefault(o.request_id, []).append(o)
    preemptions = s.get_stats()["num_preemptions"]
    s.close()
    return buf, {k: tokens_of(v) for k, v in outs.items()}, preemptions


def test_step_records_hold_the_decisions() -> None:
    buf, outs, preemptions = record(False)
    recs = lines(buf)
    header = recs[0]
    assert header["type"] == "header" and header["version"] == 1
    assert header["groups"] == [
        {"kind": "full_attention", "block_size": BS, "num_blocks": 24, "sliding_window": 0,
         "layer_ids": []}
    ]
    steps = [r for r in recs if r["type"] == "step"]
    assert [r["step"] for r in steps] == list(range(len(steps)))
    seqs = [r["seq"] for r in recs[1:]]
    assert len(set(seqs)) == len(seqs)
    for r in steps:
        scheduled = [d for d in r["decisions"] if d[1] != "preempted"]
        assert sum(d[2] for d in scheduled) == r["budget_used"] <= r["budget"] == 16
        assert r["preemptions"] == sum(d[1] == "preempted" for d in r["decisions"])
        assert r["running"] >= len(scheduled)
        assert r["waiting"] >= 0 and r["preempted"] >= 0
        (g,) = r["groups"]
        assert 0 <= g["free"] <= 23 and g["cached"] >= 0 and g["freed_by_window"] == 0
        assert 0 <= r["prefix_hits"] <= r["prefix_queries"]
        assert r["done_seq"] > r["seq"] and r["wall_s"] is None  # no engine core here
    assert sum(r["preemptions"] for r in steps) == preemptions > 0
    assert sum(r["prefix_hits"] for r in steps) > 0
    kinds = {d[1] for r in steps for d in r["decisions"]}
    assert kinds == {"new", "running", "preempted", "resumed"}
    assert max(r["preempted"] for r in steps) > 0
    arrivals = [r for r in recs if r["type"] == "arrival"]
    assert len(arrivals) == 13 and all(r["prompt_len"] == len(r["prompt"]) for r in arrivals)
    finishes = {r["rid"]: r for r in recs if r["type"] == "finish"}
    assert {finishes[k]["reason"] for k in ("r3", "r7")} == {"abort"}
    assert set(finishes) == set(outs)
    for rid, toks in outs.items():  # the output lengths each request ended with
        assert finishes[rid]["output_token_ids"] == toks
        assert finishes[rid]["output_len"] == len(toks)
    assert any(f["reason"] == "stop" for f in finishes.values())
    assert any(f["reason"] == "length" for f in finishes.values())


@pytest.mark.parametrize(
    "cfg",
    [
        {"async_scheduling": False},
        {"async_scheduling": True},
        {"async_scheduling": False, "scheduling_policy": "priority"},
        {"async_scheduling": False, "speculative_ngram": 2, "num_speculative_tokens": 3},
        {"async_scheduling": False, "scheduler_reserve_full_isl": True},
        {"async_scheduling": False, "enable_prefix_caching": False, "num_blocks": 40},
        {"async_scheduling": False, "enable_lora": True, "max_loras": 2},
    ],
    ids=["sync", "async", "priority", "ngram", "gate", "no-prefix-cache", "lora"],
)
def test_replay_makes_the_recorded_decisions(cfg: dict[str, Any]) -> None:
    buf, _, _ = record(**cfg)
    trace = read_trace(buf.getvalue().splitlines())
    res = replay(trace)
    assert len(res.recorded) == len(res.replayed) > 10
    assert res.mismatches == []


def test_replay_with_a_changed_scheduler_finishes_the_same_requests() -> None:
    buf, _, preemptions = record(False)
    trace = read_trace(buf.getvalue().splitlines())
    res = replay(trace, {"scheduler_reserve_full_isl": True})
    assert preemptions > 0 and res.stats["num_preemptions"] == 0
    assert res.mismatches  # the decisions differ, as they should
    assert res.stats["num_running"] == res.stats["num_waiting"] == 0


def test_trace_to_a_file_and_bench_scheduler_replay(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    s = make_scheduler(
        num_blocks=24, max_num_batched_tokens=16, block_size=BS, scheduler_trace=str(path)
    )
    assert s.trace is not None
    add_workload(s)
    run_to_completion(s, FakeWorker(BS))
    s.close()
    proc = subprocess.run(
        [sys.executable, "scripts/bench_scheduler.py", "--replay", str(path), "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["decisions_match"] is True and out["mismatched_steps"] == 0
    assert out["steps_recorded"] == out["steps_replayed"] > 10
    assert out["recorded_preemptions"] == out["num_preemptions"] > 0
