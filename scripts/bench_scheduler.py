"""Scheduler-only benchmark: schedule() + update_from_output() with a fake model.

The fake model returns one token per request whose prompt (and earlier outputs) is fully
computed, like a real worker; its ModelRunnerOutput is built outside the timed region.

  python scripts/bench_scheduler.py --num-requests 256          # all decoding
  python scripts/bench_scheduler.py --mixed                     # 3 new 512-token prompts/step
  ... --trace PATH                 # with the per-step scheduler trace written to PATH
  ... --compare-trace --before-ref REV [--rounds 5]
        # trace off vs on vs the scheduler at git revision REV, interleaved in one run
        # (each variant a fresh process per round); medians of us_per_step
  python scripts/bench_scheduler.py --replay TRACE [--replay-set KEY=VALUE ...]
        # the trace's arrivals through the scheduler alone; do the decisions match?
  ... --json   -> last stdout line is one JSON object (us_per_step, schedule_us, update_us)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

# BENCH_SCHEDULER_ROOT: import engine_core/ and protocol/ from another tree (--compare-trace's
# "before" variant runs against a git revision exported there)
sys.path.insert(
    0,
    os.environ.get("BENCH_SCHEDULER_ROOT")
    or os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
)

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
        opts: dict[str, object] = {}
        if args.trace:  # only then: a "before" tree's EngineConfig has no such field
            opts["scheduler_trace"] = args.trace
        if args.reserve_full_isl:
            opts["scheduler_reserve_full_isl"] = True
        cfg = EngineConfig(
            block_size=16,
            max_num_seqs=args.max_num_seqs,
            enable_prefix_caching=True,
            prefix_hash=args.prefix_hash,
            **opts,  # type: ignore[arg-type]
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
    if args.trace:
        b.sched.close()
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
        "steps_total": int(stats["num_steps"]),  # warm-up included (trace bytes per step)
        "kv_usage": round(stats["kv_usage"], 3),
        "num_preemptions": stats["num_preemptions"],
        "prefix_hash": args.prefix_hash,
        "gc_freeze": args.gc_freeze,
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }


def compare_trace(args: argparse.Namespace, passthrough: list[str]) -> dict[str, object]:
    """Trace off, trace on and the scheduler at --before-ref, each a fresh process, the three
    interleaved in every round so they share the machine's drift; medians over the rounds."""
    script = os.path.abspath(__file__)
    repo = os.path.dirname(os.path.dirname(script))
    us: dict[str, list[float]] = {"before": [], "off": [], "on": []}
    trace_bytes: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        before_root = os.path.join(tmp, "before")
        os.makedirs(before_root)
        archive = subprocess.run(
            ["git", "-C", repo, "archive", args.before_ref, "engine_core", "protocol"],
            capture_output=True,
            check=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", before_root], input=archive, check=True)
        trace_path = os.path.join(tmp, "trace.jsonl")
        for _ in range(args.rounds):
            for variant in ("before", "off", "on"):
                env = dict(os.environ)
                cmd = [sys.executable, script, *passthrough, "--json"]
                if variant == "before":
                    env["BENCH_SCHEDULER_ROOT"] = before_root
                if variant == "on":
                    cmd += ["--trace", trace_path]
                proc = subprocess.run(
                    cmd, env=env, capture_output=True, text=True, timeout=600, check=True
                )
                res = json.loads(proc.stdout.strip().splitlines()[-1])
                us[variant].append(res["us_per_step"])
                if variant == "on":
                    trace_bytes.append(os.path.getsize(trace_path) / res["steps_total"])
    med = {k: statistics.median(v) for k, v in us.items()}
    return {
        "case": "mixed" if args.mixed else f"decode{args.num_requests}",
        "before_ref": args.before_ref,
        "rounds": args.rounds,
        "before_us_per_step": round(med["before"], 1),
        "off_us_per_step": round(med["off"], 1),
        "on_us_per_step": round(med["on"], 1),
        "off_vs_before": round(med["off"] / med["before"], 3),
        "on_vs_off": round(med["on"] / med["off"], 3),
        "us_per_step_by_round": us,
        "trace_bytes_per_step": round(statistics.median(trace_bytes), 1),
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }


def run_replay(args: argparse.Namespace) -> dict[str, object]:
    from engine_core.scheduler_replay import load_trace, replay

    overrides: dict[str, object] = {}
    for item in args.replay_set:
        key, _, value = item.partition("=")
        overrides[key] = json.loads(value) if value else None
    trace = load_trace(args.replay)
    res = replay(trace, overrides)
    first = res.mismatches[0] if res.mismatches else None
    return {
        "replay": args.replay,
        "overrides": overrides,
        "steps_recorded": len(res.recorded),
        "steps_replayed": len(res.replayed),
        "mismatched_steps": len({m[0] for m in res.mismatches}),
        "decisions_match": not res.mismatches,
        "first_mismatch": list(first) if first else None,
        "recorded_preemptions": sum(r["preemptions"] for r in res.recorded),
        "num_preemptions": res.stats["num_preemptions"],
        "prefix_cache_hit_rate": round(res.stats["prefix_cache_hit_rate"], 4),
        "us_per_step": round(statistics.median(res.step_us), 1) if res.step_us else 0.0,
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
    p.add_argument("--trace", default=None, metavar="PATH", help="scheduler trace on, to PATH")
    p.add_argument(
        "--reserve-full-isl", action="store_true", help="the full-sequence admission gate on"
    )
    p.add_argument("--compare-trace", action="store_true", help="off vs on vs --before-ref")
    p.add_argument("--before-ref", default=None, metavar="REV", help="git revision to compare")
    p.add_argument("--rounds", type=int, default=5, help="--compare-trace rounds")
    p.add_argument("--replay", default=None, metavar="TRACE", help="replay a scheduler trace")
    p.add_argument(
        "--replay-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="EngineConfig override for --replay (JSON value), e.g. scheduling_policy=\"fcfs\"",
    )
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.replay:
        res = run_replay(args)
    elif args.compare_trace:
        if not args.before_ref:
            p.error("--compare-trace needs --before-ref REV")
        skip = {"--compare-trace", "--json"}
        passthrough: list[str] = []
        argv = sys.argv[1:]
        i = 0
        while i < len(argv):  # the case's own flags go to every child
            a = argv[i]
            if a in ("--before-ref", "--rounds", "--trace"):
                i += 2
                continue
            if a not in skip and not a.startswith(("--before-ref=", "--rounds=", "--trace=")):
                passthrough.append(a)
            i += 1
        res = compare_trace(args, passthrough)
    else:
        res = run(args)
    if args.json:
        print(json.dumps(res))
    else:
        for k, v in res.items():
            print(f"{k:>20}: {v}")


if __name__ == "__main__":
    main()
