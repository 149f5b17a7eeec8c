"""Multi-turn chat against a small device KV pool: the KV offload tiers against recompute.

N conversations take turns round-robin: turn t of every conversation, then turn t + 1 of every
conversation, ... Each turn's prompt is the conversation's whole history (every earlier prompt
and answer) plus --turn-len new tokens, so it shares a long prefix with the previous turn. One
turn is in flight at a time, so a turn's TTFT is its own prefill, not queueing. The device pool
holds --device-fraction of the live conversations' KV (default 0.2: under a quarter), so by the
time a conversation comes back the other conversations have pushed its prefix out of the device
pool: with recompute (no tier) the whole history is prefilled again; with the host tier
(--kv-offload-memory) the evicted blocks are copied back and only the new tokens are prefilled.

Each mode runs in a fresh engine, the modes interleaved within each of --runs rounds (so a
shared, noisy machine affects both alike); the figures are medians over the rounds, the speedups
medians of the per-round ratios. The greedy
tokens of every mode must be identical ("outputs_match").

  python scripts/bench_multiturn.py --json
  python scripts/bench_multiturn.py --modes recompute,host,disk --runs 3 --json
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import build_parser, emit_json, engine_options, percentile  # noqa: E402

from launch.args import parse_bytes  # noqa: E402

MODES = ("recompute", "host", "disk")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser(__doc__.splitlines()[0])
    g = p.add_argument_group("multi-turn workload")
    g.add_argument("--num-conversations", type=int, default=8)
    g.add_argument("--turns", type=int, default=4, help="turns per conversation")
    g.add_argument("--first-len", type=int, default=1024, help="tokens of the first prompt")
    g.add_argument("--turn-len", type=int, default=32, help="new user tokens per later turn")
    g.add_argument("--output-len", type=int, default=16, help="answer tokens per turn")
    g.add_argument("--device-fraction", type=float, default=0.2,
                   help="device KV pool as a share of the live conversations' KV")
    g.add_argument("--modes", default="recompute,host",
                   help=f"comma-separated, of {','.join(MODES)}")
    g.add_argument("--disk-host-memory", type=parse_bytes, default=16 << 20,
                   help="host tier of the disk mode (small, so most blocks come from disk)")
    g.add_argument("--runs", type=int, default=3, help="rounds; each runs every mode once")
    g.add_argument("--timeout-s", type=float, default=600.0, help="per turn")
    args = p.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in args.modes if m not in MODES]
    if bad or not args.modes:
        p.error(f"unknown modes {bad}; choose from {MODES}")
    return args


def final_len(args: argparse.Namespace) -> int:
    """Tokens of a conversation after its last answer."""
    return args.first_len + (args.turns - 1) * args.turn_len + args.turns * args.output_len


def device_blocks(args: argparse.Namespace) -> int:
    """The device pool: --device-fraction of every conversation's KV, at least one turn's."""
    if args.num_gpu_blocks_override:
        return args.num_gpu_blocks_override
    per_conv = -(-final_len(args) // args.block_size)
    return max(int(args.device_fraction * args.num_conversations * per_conv), per_conv + 2)


def mode_options(args: argparse.Namespace, mode: str, tmp: str) -> dict[str, Any]:
    opts = engine_options(args)
    opts["num_gpu_blocks_override"] = device_blocks(args)
    if mode == "recompute":
        opts.update(kv_offload_memory=0, kv_offload_disk=None, kv_offload_disk_size=0)
    else:
        # the host tier holds every conversation unless the flag says otherwise
        opts["kv_offload_memory"] = args.kv_offload_memory or 1 << 30
        if mode == "disk":
            # a small host tier in front: most blocks are read back from disk
            opts["kv_offload_memory"] = args.disk_host_memory
            opts["kv_offload_disk"] = args.kv_offload_disk or os.path.join(tmp, "kv")
            opts["kv_offload_disk_size"] = args.kv_offload_disk_size or 1 << 30
        else:
            opts.update(kv_offload_disk=None, kv_offload_disk_size=0)
    return opts


def one_turn(llm: Any, prompt: list[int], params: Any, timeout_s: float
             ) -> tuple[float, float, list[int]]:
    """(TTFT s, end-to-end s, answer tokens) of one request."""
    sent = time.perf_counter()
    first = None
    tokens: list[int] = []
    for ev in llm.generate_stream([prompt], params, timeout_s=timeout_s):
        if ev.new_token_ids:
            if first is None:
                first = time.perf_counter()
            tokens.extend(ev.new_token_ids)
        if ev.finish_reason == "error":
            raise RuntimeError(f"turn failed: {ev.error}")
    done = time.perf_counter()
    assert first is not None, "no token"
    return first - sent, done - sent, tokens


def run_mode(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    from launch import LLM, SamplingParams

    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="tandem-multiturn-") as tmp:
        opts = mode_options(args, mode, tmp)
        with LLM(args.model, tensor_parallel_size=args.tensor_parallel_size,
                 load_tokenizer=False, **opts) as llm:
            vocab = llm.info.vocab_size
            history = [[rng.randrange(3, vocab) for _ in range(args.first_len)]
                       for _ in range(args.num_conversations)]
            one_turn(llm, [1, 2, 3, 4], params, args.timeout_s)  # warm-up, untimed
            first_ttft: list[float] = []
            ret_ttft: list[float] = []
            answers: list[list[int]] = []
            before = llm.get_stats()
            start = time.perf_counter()
            for turn in range(args.turns):
                for conv in history:
                    if turn:
                        conv.extend(rng.randrange(3, vocab) for _ in range(args.turn_len))
                    ttft, _, answer = one_turn(llm, list(conv), params, args.timeout_s)
                    (ret_ttft if turn else first_ttft).append(ttft)
                    answers.append(answer)
                    conv.extend(answer)
            total = time.perf_counter() - start
            after = llm.get_stats()
    res: dict[str, Any] = {
        "returning_ttft_median_ms": statistics.median(ret_ttft) * 1e3,
        "returning_ttft_p99_ms": percentile(ret_ttft, 99) * 1e3,
        "first_turn_ttft_median_ms": statistics.median(first_ttft) * 1e3,
        "total_s": total,
        "answers": answers,
    }
    for key in ("prefix_cache_hits", "num_preemptions", "kv_offload_host_hits",
                "kv_offload_disk_hits", "kv_offload_restored_tokens", "kv_offload_offloaded",
                "kv_offload_spilled", "kv_offload_bytes_device_to_host",
                "kv_offload_bytes_host_to_device", "kv_offload_bytes_host_to_disk",
                "kv_offload_bytes_disk_to_host", "kv_offload_plan_s", "kv_offload_copy_s"):
        if key in after:
            res[key] = after[key] - before.get(key, 0.0)
    return res


def run(args: argparse.Namespace) -> dict[str, Any]:
    per_mode: dict[str, list[dict[str, Any]]] = {m: [] for m in args.modes}
    for _ in range(args.runs):
        for mode in args.modes:  # interleaved: both modes see the same machine
            per_mode[mode].append(run_mode(args, mode))
    blocks = device_blocks(args)
    per_conv = -(-final_len(args) // args.block_size)
    res: dict[str, Any] = {
        "model": args.model,
        "tensor_parallel_size": args.tensor_parallel_size,
        "num_conversations": args.num_conversations,
        "turns": args.turns,
        "first_len": args.first_len,
        "turn_len": args.turn_len,
        "output_len": args.output_len,
        "block_size": args.block_size,
        "device_blocks": blocks,
        # share of the live conversations' final KV that the device pool holds
        "device_fraction_of_live_kv": blocks / (args.num_conversations * per_conv),
        "runs": args.runs,
        "modes": args.modes,
    }
    answers = {m: runs[0]["answers"] for m, runs in per_mode.items()}
    res["outputs_match"] = all(
        r["answers"] == answers[args.modes[0]] for runs in per_mode.values() for r in runs)
    for mode, runs in per_mode.items():
        for key in runs[0]:
            if key == "answers":
                continue
            vals = [r[key] for r in runs]
            res[f"{mode}_{key}"] = statistics.median(vals)
            if key in ("returning_ttft_median_ms", "total_s"):
                res[f"{mode}_{key}_runs"] = vals
    base = "recompute"
    for mode in args.modes:
        if mode != base and base in args.modes:
            # ratios within each round (the modes ran back to back), then their median: a
            # noisy neighbour on a shared machine slows one round, not one mode
            for key, name in (("returning_ttft_median_ms", "returning_ttft_speedup"),
                              ("total_s", "total_time_speedup")):
                ratios = [b[key] / m[key] for b, m in zip(per_mode[base], per_mode[mode],
                                                          strict=True)]
                res[f"{mode}_{name}"] = statistics.median(ratios)
                res[f"{mode}_{name}_runs"] = ratios
    return res


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    res = run(args)
    if args.json:
        emit_json(res)
    else:
        for mode in args.modes:
            print(f"{mode:>9}: returning-turn TTFT median "
                  f"{res[f'{mode}_returning_ttft_median_ms']:.1f} ms, p99 "
                  f"{res[f'{mode}_returning_ttft_p99_ms']:.1f} ms, total "
                  f"{res[f'{mode}_total_s']:.2f} s")
        print(f"outputs match: {res['outputs_match']}")
    return 0 if res["outputs_match"] else 1


if __name__ == "__main__":
    sys.exit(main())
