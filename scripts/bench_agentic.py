"""Agentic jobs against a small device KV pool: continuum pinning against FCFS (with and
without the host tier).

N agent jobs arrive as a Poisson process (--arrival-rate jobs/s); each runs K turns. Turn k+1's
prompt is turn k's whole context plus its answer plus a tool output of --tool-len tokens, and
between turns the job sleeps for a tool time: a short tool (uniform in --short-tools, 0.1-2 s)
with probability 1 - --long-share, else a long one (lognormal, clipped to --long-tools,
5-20 s); the tool's name is sent as the finished turn's tool_name hint. --all-long makes every
tool long, with every gap at least 3x --continuum-max-ttl (the pins cannot pay). Decoding is
greedy with fixed output lengths, so every mode must produce the same tokens (checked).
The device pool holds --device-fraction of the jobs' final KV.

The default load saturates dummy:tiny on a 2-core CPU under fcfs (48 jobs of 1-1.5k token
contexts: recomputing them costs more compute than the run has), so what a policy saves in
recompute shows in the JCT; with fewer jobs the tool sleeps alone set it and every mode ties.

Modes (fresh engine each, interleaved within each of --runs rounds): fcfs, fcfs+host,
continuum, continuum+host. Figures are medians over rounds; ratios to fcfs are medians of the
per-round ratios. Job completion time (JCT) = the job's arrival to its last turn's answer.

  python scripts/bench_agentic.py --json
  python scripts/bench_agentic.py --base-url http://localhost:8000/v1 --json  (one server)
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import build_parser, emit_json, engine_options, percentile  # noqa: E402

MODES = ("fcfs", "fcfs+host", "continuum", "continuum+host")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser(__doc__.splitlines()[0])
    g = p.add_argument_group("agentic workload")
    g.add_argument("--num-jobs", type=int, default=48)
    g.add_argument("--turns", type=int, default=4, help="turns per job (K)")
    g.add_argument("--arrival-rate", type=float, default=8.0, help="jobs per second (Poisson)")
    g.add_argument("--first-len", type=int, default=1024, help="tokens of a job's first prompt")
    g.add_argument("--tool-len", type=int, default=128, help="tool output tokens per turn (T)")
    g.add_argument("--output-len", type=int, default=32, help="answer tokens per turn")
    g.add_argument("--short-tools", default="0.1,2", help="short tool seconds: min,max")
    g.add_argument("--long-tools", default="5,20", help="long tool seconds: min,max")
    g.add_argument("--long-share", type=float, default=0.3)
    g.add_argument("--all-long", action="store_true",
                   help="every tool long, gaps >= 3x --continuum-max-ttl")
    g.add_argument("--device-fraction", type=float, default=0.3,
                   help="device KV pool as a share of the jobs' final KV")
    g.add_argument("--modes", default="fcfs,fcfs+host,continuum",
                   help=f"comma-separated, of {','.join(MODES)}")
    g.add_argument("--runs", type=int, default=3)
    g.add_argument("--base-url", default=None,
                   help="send the jobs to this OpenAI-compatible server instead (one mode)")
    g.add_argument("--timeout-s", type=float, default=600.0, help="per turn")
    args = p.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if any(m not in MODES for m in args.modes) or not args.modes:
        p.error(f"--modes: choose from {', '.join(MODES)}")
    return args


@dataclass
class Job:
    job_id: str
    arrival: float  # seconds after the start
    first: list[int]
    tools: list[tuple[str, float, list[int]]]  # per gap: tool name, sleep s, output tokens


def _lognormal_in(rng: random.Random, lo: float, hi: float) -> float:
    mu, sigma = math.log(math.sqrt(lo * hi)), math.log(hi / lo) / 4
    return min(hi, max(lo, rng.lognormvariate(mu, sigma)))


def make_jobs(args: argparse.Namespace, vocab: int) -> list[Job]:
    rng = random.Random(args.seed)
    s_lo, s_hi = (float(x) for x in args.short_tools.split(","))
    l_lo, l_hi = (float(x) for x in args.long_tools.split(","))
    if args.all_long:
        l_lo = max(l_lo, 3 * args.continuum_max_ttl)
        l_hi = max(l_hi, l_lo * 1.5)
    jobs, t = [], 0.0
    for j in range(args.num_jobs):
        t += rng.expovariate(args.arrival_rate) if j else 0.0
        tools = []
        for _ in range(args.turns - 1):
            long = args.all_long or rng.random() < args.long_share
            secs = _lognormal_in(rng, l_lo, l_hi) if long else rng.uniform(s_lo, s_hi)
            name = f"{'long' if long else 'short'}_{rng.randrange(3)}"
            tools.append((name, secs, [rng.randrange(3, vocab) for _ in range(args.tool_len)]))
        jobs.append(Job(f"job-{j}", t, [rng.randrange(3, vocab) for _ in range(args.first_len)],
                        tools))
    return jobs


def final_len(args: argparse.Namespace) -> int:
    return args.first_len + args.turns * args.output_len + (args.turns - 1) * args.tool_len


def device_blocks(args: argparse.Namespace) -> int:
    per_job = -(-final_len(args) // args.block_size)
    return max(per_job + 2, int(args.device_fraction * args.num_jobs * per_job)) + 1


def mode_options(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    opts = engine_options(args)
    opts["num_gpu_blocks_override"] = device_blocks(args)
    opts["scheduling_policy"] = "continuum" if mode.startswith("continuum") else "fcfs"
    opts["kv_offload_memory"] = (args.kv_offload_memory or 1 << 30) if "host" in mode else 0
    opts.update(kv_offload_disk=None, kv_offload_disk_size=0)
    return opts


class Turns:
    """Sends one turn and returns (answer tokens, cached prompt tokens)."""

    def __init__(self, args: argparse.Namespace, llm: Any = None) -> None:
        self.args, self.llm = args, llm
        if args.base_url:
            import openai

            self.client = openai.OpenAI(base_url=args.base_url, api_key="x")
            self.model = self.client.models.list().data[0].id

    def __call__(self, prompt: list[int], job: str, last: bool, tool: str | None
                 ) -> tuple[list[int], int]:
        a = self.args
        if self.llm is not None:
            from launch import SamplingParams

            params = SamplingParams(max_tokens=a.output_len, temperature=0.0, ignore_eos=True)
            out = self.llm.generate([prompt], params, use_tqdm=False, timeout_s=a.timeout_s,
                                    job_id=job, is_last_step=last, tool_name=tool)[0]
            if out.finish_reason == "error":
                raise RuntimeError(f"turn failed: {out.error}")
            return list(out.token_ids), out.metrics.num_cached_tokens or 0
        extra: dict[str, Any] = {"job_id": job, "is_last_step": last, "ignore_eos": True,
                                 "return_token_ids": True}
        if tool is not None:
            extra["tool_name"] = tool
        r = self.client.completions.create(model=self.model, prompt=prompt,
                                           max_tokens=a.output_len, temperature=0.0,
                                           extra_body=extra, timeout=a.timeout_s)
        choice = r.choices[0].model_dump()
        cached = ((r.usage.model_dump().get("prompt_tokens_details") or {})
                  .get("cached_tokens") or 0) if r.usage else 0
        return list(choice.get("token_ids") or []), cached


def drive(args: argparse.Namespace, jobs: list[Job], turn: Turns) -> dict[str, Any]:
    jct: dict[str, float] = {}
    answers: dict[str, list[list[int]]] = {}
    recomputed = [0]
    prompt_tokens = [0]
    latency: tuple[list[float], list[float]] = ([], [])  # first turns, later turns
    lock = threading.Lock()
    errors: list[BaseException] = []
    start = time.perf_counter()

    def run_job(job: Job) -> None:
        try:
            delay = job.arrival - (time.perf_counter() - start)
            if delay > 0:
                time.sleep(delay)
            t0 = time.perf_counter()
            ctx = list(job.first)
            outs = []
            for k in range(args.turns):
                last = k == args.turns - 1
                tool = None if last else job.tools[k][0]
                sent = time.perf_counter()
                answer, cached = turn(ctx, job.job_id, last, tool)
                with lock:
                    latency[k > 0].append(time.perf_counter() - sent)
                    recomputed[0] += len(ctx) - cached
                    prompt_tokens[0] += len(ctx)
                outs.append(answer)
                if not last:
                    _, secs, output = job.tools[k]
                    time.sleep(secs)
                    ctx = ctx + answer + output
            jct[job.job_id] = time.perf_counter() - t0
            answers[job.job_id] = outs
        except BaseException as e:  # surfaced by the main thread
            errors.append(e)

    threads = [threading.Thread(target=run_job, args=(j,), daemon=True) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(args.timeout_s * args.turns + 120)
    if errors:
        raise errors[0]
    total = time.perf_counter() - start
    vals = [jct[j.job_id] for j in jobs]
    return {
        "avg_jct_s": statistics.mean(vals),
        "p90_jct_s": percentile(vals, 90),
        "total_s": total,
        "throughput_jobs_per_s": len(jobs) / total,
        "recomputed_tokens": float(recomputed[0]),
        "prefix_hit_rate": 1.0 - recomputed[0] / max(1, prompt_tokens[0]),
        # where a job's time goes besides its tools: queueing behind other turns shows here
        "first_turn_latency_s": statistics.mean(latency[0]),
        "later_turn_latency_s": statistics.mean(latency[1]) if latency[1] else 0.0,
        "jct_per_job_s": vals,
        "answers": [answers[j.job_id] for j in jobs],
    }


STAT_KEYS = ("num_preemptions", "kv_offload_host_hits", "continuum_pins_created",
             "continuum_pins_skipped", "continuum_pin_hits", "continuum_pin_expiries",
             "continuum_pressure_releases", "continuum_tokens_saved")


def run_mode(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    if args.base_url:
        return drive(args, make_jobs(args, 32000), Turns(args))
    from launch import LLM, SamplingParams

    with LLM(args.model, tensor_parallel_size=args.tensor_parallel_size, load_tokenizer=False,
             **mode_options(args, mode)) as llm:
        llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        res = drive(args, make_jobs(args, llm.info.vocab_size), Turns(args, llm))
        stats = llm.get_stats()
    for key in STAT_KEYS:
        if key in stats:
            res[key] = stats[key]
    return res


def run(args: argparse.Namespace) -> dict[str, Any]:
    modes = ["server"] if args.base_url else args.modes
    per_mode: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for _ in range(args.runs):
        for mode in modes:
            per_mode[mode].append(run_mode(args, mode))
    res: dict[str, Any] = {
        "model": args.model, "num_jobs": args.num_jobs, "turns": args.turns,
        "arrival_rate": args.arrival_rate, "first_len": args.first_len,
        "tool_len": args.tool_len, "output_len": args.output_len,
        "all_long": args.all_long, "device_blocks": device_blocks(args),
        "device_fraction": args.device_fraction, "runs": args.runs, "modes": modes,
        "continuum_max_ttl": args.continuum_max_ttl,
    }
    first = per_mode[modes[0]][0]["answers"]
    res["outputs_match"] = all(r["answers"] == first for rs in per_mode.values() for r in rs)
    for mode, runs in per_mode.items():
        for key in runs[0]:
            if key in ("answers", "jct_per_job_s"):
                continue
            res[f"{mode}_{key}"] = statistics.median(r[key] for r in runs)
        res[f"{mode}_avg_jct_s_runs"] = [r["avg_jct_s"] for r in runs]
        res[f"{mode}_jct_per_job_s"] = runs[len(runs) // 2]["jct_per_job_s"]
    if "fcfs" in per_mode:
        for mode in modes:
            if mode == "fcfs":
                continue
            # fcfs JCT / mode JCT per round (> 1: the mode is faster), then the median
            ratios = [b["avg_jct_s"] / m["avg_jct_s"]
                      for b, m in zip(per_mode["fcfs"], per_mode[mode], strict=True)]
            res[f"{mode}_jct_speedup_vs_fcfs"] = statistics.median(ratios)
    return res


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    res = run(args)
    if args.json:
        emit_json(res)
    else:
        for mode in res["modes"]:
            print(f"{mode:>15}: avg JCT {res[f'{mode}_avg_jct_s']:.2f} s, p90 "
                  f"{res[f'{mode}_p90_jct_s']:.2f} s")
        print(f"outputs match: {res['outputs_match']}")
    return 0 if res["outputs_match"] else 1


if __name__ == "__main__":
    sys.exit(main())
