"""Scheduler-only benchmark: schedule() + update_from_output() with a fake model.

The fake model returns one token per request whose prompt (and earlier outputs) is fully
computed, like a real worker; its ModelRunnerOutput is built outside the timed region.

  python scripts/bench_scheduler.py --num-requests 256          # all decoding
  python scripts/bench_scheduler.py --mixed                     # 3 new 512-token prompts/step
  ... --json   -> last stdout line is one JSON object (us_per_step, schedule_us, update_us)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine_core.request import Request  # noqa: E402
from engine_core.scheduler import Scheduler  # noqa: E402
from protocol.codec import Encoder, pack  # noqa: E402
from protocol.config import EngineConfig  # noqa: E402
from protocol.messages import ModelRunnerOutput, SamplingParams  # noqa: E402

VOCAB = 32000


def fake_model_output(sched: Scheduler, step_id: int, rng: random.Random) -> ModelRunnerOutput:
    """One token for every running request whose known tokens are all computed."""
    handles = [r.handle for r in sched.running if r.num_computed_tokens >= r.num_tokens]
    toks = [rng.randrange(100, VOCAB) for _ in handles]
    return ModelRunnerOutput(
        step_id=step_id, rank=0, req_handles=pack(handles), sampled_token_ids=pack(toks)
    )


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        cfg = EngineConfig(
            block_size=16,
            max_num_seqs=args.max_num_seqs,
            enable_prefix_caching=True,
            prefix_hash=args.prefix_hash,
        )
        self.sched = Scheduler(cfg, args.num_blocks, args.max_model_len, args.max_batched)
        self.n_added = 0
        self.encoder = Encoder()
        self.sched_us: list[float] = []
        self.update_us: list[float] = []
        self.add_us: list[float] = []
        self.frame_bytes: list[int] = []
        self.running: list[int] = []

    def add(self, n: int, prompt_len: int, max_tokens: int) -> None:
        t0 = time.perf_counter_ns()
        for _ in range(n):
            prompt = [self.rng.randrange(100, VOCAB) for _ in range(prompt_len)]
            sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            self.sched.add_request(Request(f"req-{self.n_added}", prompt, sp, None, time.time()))
            self.n_added += 1
        self.last_add_us = (time.perf_counter_ns() - t0) / 1e3

    def step(self, record: bool) -> None:
        sched = self.sched
        t0 = time.perf_counter_ns()
        so = sched.schedule()
        t1 = time.perf_counter_ns()
        mo = fake_model_output(sched, so.step_id, self.rng)  # not timed
        t2 = time.perf_counter_ns()
        sched.update_from_output(so, mo)
        t3 = time.perf_counter_ns()
        if record:
            self.sched_us.append((t1 - t0) / 1e3)
            self.update_us.append((t3 - t2) / 1e3)
            self.frame_bytes.append(len(self.encoder.encode(so)))
            self.running.append(len(sched.running))


def run(args: argparse.Namespace) -> dict[str, object]:
    b = Bench(args)
    if args.gc_freeze:
        gc.freeze()  # what a long-running engine does after start-up: older objects not rescanned
    if args.mixed:
        for i in range(args.warmup + args.steps):
            b.add(3, 512, args.max_tokens)
            if i >= args.warmup:
                b.add_us.append(b.last_add_us)
            b.step(record=i >= args.warmup)
    else:
        b.add(args.num_requests, args.prompt_len, 1 << 30)
        # warm up until every request is decoding, then a few more steps
        warm = 0
        while any(not r.output_token_ids for r in b.sched.running) or (
            len(b.sched.running) < args.num_requests
        ):
            b.step(record=False)
            warm += 1
        for _ in range(args.warmup):
            b.step(record=False)
        for _ in range(args.steps):
            b.step(record=True)
    total = [s + u for s, u in zip(b.sched_us, b.update_us, strict=True)]
    stats = b.sched.get_stats()
    return {
        "case": "mixed" if args.mixed else f"decode{args.num_requests}",
        "us_per_step": round(statistics.median(total), 1),
        "schedule_us": round(statistics.median(b.sched_us), 1),
        "update_us": round(statistics.median(b.update_us), 1),
        "p90_us_per_step": round(sorted(total)[int(0.9 * len(total))], 1),
        "add_us_per_step": round(statistics.median(b.add_us), 1) if b.add_us else 0.0,
        "median_running": statistics.median(b.running),
        "median_frame_bytes": statistics.median(b.frame_bytes),
        "steps_measured": len(total),
        "kv_usage": round(stats["kv_usage"], 3),
        "num_preemptions": stats["num_preemptions"],
        "prefix_hash": args.prefix_hash,
        "gc_freeze": args.gc_freeze,
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--mixed", action="store_true", help="3 new 512-token prompts per step")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64, help="outputs per request (--mixed)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-batched", type=int, default=2048, help="max_num_batched_tokens")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--num-blocks", type=int, default=20001, help="including the null block")
    p.add_argument("--prefix-hash", default="sha256", choices=["sha256", "fast"])
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gc-freeze", action="store_true", help="gc.freeze() before the run")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    res = run(args)
    if args.json:
        print(json.dumps(res))
    else:
        for k, v in res.items():
            print(f"{k:>20}: {v}")


if __name__ == "__main__":
    main()
