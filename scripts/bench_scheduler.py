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
  ... --kv-groups hybrid:64        # KV cache groups: full (default), hybrid:W (one full and one
                                   # W-token sliding-window group) or window:W (all windowed)
  ... --compare-groups [--window 64] [--rounds 5]
        # single full-attention group vs hybrid (full + window), interleaved fresh processes
  python scripts/bench_scheduler.py --kv-blocks-at 8192 [--window 4096]
        # KV blocks (and MiB at Mistral-7B's shape) held at that context, windowed vs full
  ... --kv-events                  # KV cache events on (published over ipc://, no subscriber)
  ... --compare-events [--rounds 5]
        # events off vs on, interleaved fresh processes; medians of us_per_step
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
from engine_core.sched.scheduler import Scheduler  # noqa: E402
from protocol.codec import Encoder, pack  # noqa: E402
from protocol.config import EngineConfig  # noqa: E402
from protocol.messages import ModelRunnerOutput, SamplingParams  # noqa: E402

VOCAB = 32000


def kv_groups(spec: str) -> list | None:
    """--kv-groups: full -> None (one full-attention group, the default), hybrid:W -> one full
    and one W-token window group (two layers), window:W -> one window group."""
    if spec == "full":
        return None
    from protocol.kv_cache_spec import kv_cache_groups

    kind, _, w = spec.partition(":")
    if kind == "hybrid":
        return kv_cache_groups([0, int(w)])
    if kind == "window":
        return kv_cache_groups([int(w)])
    raise SystemExit(f"--kv-groups: expected full, hybrid:W or window:W, got {spec!r}")


def fake_model_output(sched: Scheduler, step_id: int, rng: random.Random) -> ModelRunnerOutput:
    """One token for every running request whose known tokens are all computed."""
    handles = [r.handle for r in sched.running if r.num_computed_tokens >= r.num_tokens]
    toks = [rng.randrange(100, VOCAB) for _ in handles]
    return ModelRunnerOutput(
        step_id=step_id, rank=0, req_handles=pack(handles), sampled_token_ids=pack(toks)
    )


class SchedulerBench:
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
        groups = kv_groups(args.kv_groups)
        extra = {"kv_cache_groups": groups} if groups else {}  # a "before" tree has no groups
        self.sched = Scheduler(cfg, args.num_blocks, args.max_model_len, args.max_batched,
                               **extra)  # type: ignore[arg-type]
        self.n_added = 0
        self.encoder = Encoder()
        self.sched_us: list[float] = []
        self.update_us: list[float] = []
        self.add_us: list[float] = []
        self.frame_bytes: list[int] = []
        self.running: list[int] = []
        self.events_per_step: list[int] = []
        self.publisher = None
        if getattr(args, "kv_events", False):
            # the engine core's wiring (engine_core/kv_cache/events.py attach_kv_events): the
            # pool reports to the collector, end_step() hands the batch to the publisher thread
            from engine_core.kv_cache.events import KVEventPublisher
            from protocol.kv_events import KVEventsConfig

            self._events_dir = tempfile.TemporaryDirectory()
            ev_cfg = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                    endpoint=f"ipc://{self._events_dir.name}/events")
            self.publisher = KVEventPublisher(ev_cfg, 16)
            self.sched.kv_cache_manager.block_pool.events = self.publisher.collector

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
        n_events = 0
        if self.publisher is not None:
            n_events = len(self.publisher.collector.events)
            self.publisher.end_step()  # timed: the core calls it once per step
        t3 = time.perf_counter_ns()
        if record:
            self.events_per_step.append(n_events)
            self.sched_us.append((t1 - t0) / 1e3)
            self.update_us.append((t3 - t2) / 1e3)
            self.frame_bytes.append(len(self.encoder.encode(so)))
            self.running.append(len(sched.running))


def run(args: argparse.Namespace) -> dict[str, object]:
    b = SchedulerBench(args)
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
    if b.publisher is not None:
        b.publisher.close()
    return {
        "case": "mixed" if args.mixed else f"decode{args.num_requests}",
        "kv_groups": args.kv_groups,
        "freed_by_window": sum(getattr(b.sched.kv_cache_manager, "num_freed_by_window", [0])),
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
        "kv_events": b.publisher is not None,
        "events_per_step": round(statistics.mean(b.events_per_step), 2),
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


def compare_events(args: argparse.Namespace, passthrough: list[str]) -> dict[str, object]:
    """KV cache events off against on, each round both as fresh processes, interleaved so they
    share the machine's drift; medians over the rounds."""
    script = os.path.abspath(__file__)
    us: dict[str, list[float]] = {"off": [], "on": []}
    events = 0.0
    for _ in range(args.rounds):
        for name in ("off", "on"):
            cmd = [sys.executable, script, *passthrough, "--json"]
            if name == "on":
                cmd.append("--kv-events")
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True)
            res = json.loads(proc.stdout.strip().splitlines()[-1])
            us[name].append(res["us_per_step"])
            if name == "on":
                events = res["events_per_step"]
    med = {k: statistics.median(v) for k, v in us.items()}
    return {
        "case": "mixed" if args.mixed else f"decode{args.num_requests}",
        "rounds": args.rounds,
        "off_us_per_step": round(med["off"], 1),
        "on_us_per_step": round(med["on"], 1),
        "on_vs_off": round(med["on"] / med["off"], 3),
        "events_per_step": events,
        "us_per_step_by_round": us,
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }


def compare_groups(args: argparse.Namespace, passthrough: list[str]) -> dict[str, object]:
    """One full-attention group against a hybrid model (one full + one --window group), each
    round both variants as fresh processes, interleaved so they share the machine's drift."""
    script = os.path.abspath(__file__)
    variants = {"single": "full", "hybrid": f"hybrid:{args.window}"}
    us: dict[str, list[float]] = {k: [] for k in variants}
    freed = 0
    for _ in range(args.rounds):
        for name, spec in variants.items():
            cmd = [sys.executable, script, *passthrough, "--kv-groups", spec, "--json"]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True)
            res = json.loads(proc.stdout.strip().splitlines()[-1])
            us[name].append(res["us_per_step"])
            if name == "hybrid":
                freed = res["freed_by_window"]
    med = {k: statistics.median(v) for k, v in us.items()}
    return {
        "case": "mixed" if args.mixed else f"decode{args.num_requests}",
        "window": args.window,
        "rounds": args.rounds,
        "single_us_per_step": round(med["single"], 1),
        "hybrid_us_per_step": round(med["hybrid"], 1),
        "hybrid_vs_single": round(med["hybrid"] / med["single"], 3),
        "hybrid_freed_by_window": freed,  # the window group really gave blocks back
        "us_per_step_by_round": us,
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }


# Mistral-7B's KV shape (32 layers, 8 KV heads of 128, bf16): bytes of K+V per token and layer
MISTRAL_7B_KV_BYTES_PER_TOKEN_LAYER = 2 * 8 * 128 * 2
MISTRAL_7B_LAYERS = 32


def kv_blocks_at(args: argparse.Namespace) -> dict[str, object]:
    """One request grown to --kv-blocks-at tokens of context (chunked prefill of the prompt,
    then decodes) in a windowed model and a full-attention model of the same shape: the KV
    blocks each holds at the end."""
    from protocol.kv_cache_spec import kv_cache_groups

    context = args.kv_blocks_at
    bs = 16
    out: dict[str, object] = {"context": context, "window": args.window, "block_size": bs}
    for name, windows in (("full", [0]), ("windowed", [args.window])):
        cfg = EngineConfig(block_size=bs, max_num_seqs=1)
        sched = Scheduler(cfg, context // bs + 64, context + 64, args.max_batched,
                          kv_cache_groups=kv_cache_groups(windows))
        prompt = [100 + i % 1000 for i in range(context - 64)]
        sched.add_request(Request("r", prompt, SamplingParams(max_tokens=64, ignore_eos=True),
                                  None, 0.0))
        rng = random.Random(0)
        kvm = sched.kv_cache_manager
        held = 0
        while sched.has_unfinished_requests():
            so = sched.schedule()
            req = sched.running[0] if sched.running else None
            if req is not None and req.num_computed_tokens >= context - 1:
                held = kvm.num_held_blocks  # the blocks holding the context's KV now
            sched.update_from_output(so, fake_model_output(sched, so.step_id, rng))
        block_bytes = bs * MISTRAL_7B_KV_BYTES_PER_TOKEN_LAYER * MISTRAL_7B_LAYERS
        out[f"{name}_blocks"] = held
        out[f"{name}_mib_mistral7b"] = round(held * block_bytes / 2**20, 1)
        out[f"{name}_freed_by_window"] = sum(kvm.num_freed_by_window)
    out["windowed_vs_full"] = round(out["windowed_blocks"] / out["full_blocks"], 3)  # type: ignore[operator]
    return out


def run_replay(args: argparse.Namespace) -> dict[str, object]:
    from engine_core.sched.replay import load_trace, replay

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
    p.add_argument("--kv-groups", default="full", metavar="SPEC",
                   help="full | hybrid:W | window:W (KV cache groups of the model)")
    p.add_argument("--compare-groups", action="store_true",
                   help="single full-attention group vs hybrid:--window, interleaved rounds")
    p.add_argument("--window", type=int, default=64, help="sliding window (--compare-groups, "
                   "--kv-blocks-at; default 64 there, 4096 for --kv-blocks-at)")
    p.add_argument("--kv-blocks-at", type=int, default=0, metavar="TOKENS",
                   help="KV blocks held at this context, windowed vs full attention")
    p.add_argument("--kv-events", action="store_true", help="KV cache events on")
    p.add_argument("--compare-events", action="store_true",
                   help="KV cache events off vs on, interleaved rounds")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.kv_blocks_at:
        if "--window" not in sys.argv:
            args.window = 4096  # Mistral-7B's window
        res = kv_blocks_at(args)
    elif args.compare_groups:
        passthrough: list[str] = []
        argv = sys.argv[1:]
        i = 0
        while i < len(argv):  # the case's own flags go to every child
            a = argv[i]
            if a in ("--rounds", "--window", "--kv-groups"):
                i += 2
                continue
            if a not in ("--compare-groups", "--json") and not a.startswith(
                    ("--rounds=", "--window=", "--kv-groups=")):
                passthrough.append(a)
            i += 1
        res = compare_groups(args, passthrough)
    elif args.compare_events:
        passthrough = []
        argv = sys.argv[1:]
        i = 0
        while i < len(argv):  # the case's own flags go to every child
            a = argv[i]
            if a == "--rounds":
                i += 2
                continue
            if a not in ("--compare-events", "--kv-events", "--json") and not a.startswith(
                    "--rounds="):
                passthrough.append(a)
            i += 1
        res = compare_events(args, passthrough)
    elif args.replay:
        res = run_replay(args)
    elif args.compare_trace:
        if not args.before_ref:
            p.error("--compare-trace needs --before-ref REV")
        skip = {"--compare-trace", "--json"}
        passthrough = []
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
