"""Soak test: N requests with random lengths, shared prefixes and random aborts through the LLM API.

Reports lost requests (submitted but never finished, or finished with an error), leaked KV blocks
after everything is done, and the RSS growth of every process (frontend, engine core, each worker)
between the 20% and the 100% mark. `--json` prints the figures as the last line.

    python scripts/soak.py --n 10000 --json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from launch.llm import LLM  # noqa: E402
from protocol.messages import SamplingParams  # noqa: E402


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def process_rss(llm: LLM) -> dict[str, int]:
    out = {"frontend": rss_kib(os.getpid())}
    for c in llm.group.children:
        out[c.name] = rss_kib(c.proc.pid)
    return out


class Workload:
    """Random prompts: half start with one of a few shared prefixes (prefix-cache traffic)."""

    def __init__(self, rng: random.Random, vocab: int, max_prompt: int, max_out: int) -> None:
        self.rng = rng
        self.vocab = vocab
        self.max_prompt = max_prompt
        self.max_out = max_out
        self.prefixes = [self._tokens(rng.randrange(16, 64)) for _ in range(8)]

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(3, self.vocab) for _ in range(n)]

    def request(self) -> tuple[list[int], SamplingParams]:
        rng = self.rng
        tail = self._tokens(rng.randrange(1, self.max_prompt))
        prompt = rng.choice(self.prefixes) + tail if rng.random() < 0.5 else tail
        sp = SamplingParams(
            max_tokens=rng.randrange(1, self.max_out + 1),
            temperature=rng.choice([0.0, 0.8]),
            seed=rng.randrange(1 << 30),
        )
        return prompt, sp


def run_wave(
    llm: LLM, batch: list[tuple[list[int], SamplingParams]], rng: random.Random, abort_frac: float
) -> dict[str, int]:
    """One wave of concurrent requests; some are aborted right after their first event."""
    to_abort = {i for i in range(len(batch)) if rng.random() < abort_frac}
    counts: dict[str, int] = {}
    finished: set[int] = set()
    try:
        for ev in llm.generate_stream([p for p, _ in batch], [s for _, s in batch], timeout_s=600):
            if ev.index in to_abort and ev.finish_reason is None:
                to_abort.discard(ev.index)
                llm.abort([ev.request_id])
            if ev.finish_reason is not None:
                finished.add(ev.index)
                key = ev.finish_reason if ev.finish_reason != "error" else "error"
                counts[key] = counts.get(key, 0) + 1
                if ev.finish_reason == "error":
                    print(f"request error: {ev.error}", file=sys.stderr)
    except TimeoutError:
        pass
    counts["lost"] = len(batch) - len(finished) + counts.get("error", 0)
    return counts


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=10_000)
    ap.add_argument("--model", default="dummy:micro")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--wave", type=int, default=64, help="concurrent requests per wave")
    ap.add_argument("--abort-frac", type=float, default=0.10)
    ap.add_argument("--max-prompt", type=int, default=200)
    ap.add_argument("--max-out", type=int, default=24)
    # A bounded KV cache saturates the prefix cache (block-hash map) before the 20% mark, so
    # RSS growth measures leaks rather than the cache filling up (it has num_blocks entries).
    ap.add_argument("--num-gpu-blocks", type=int, default=2048, help="KV capacity (0: default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    rng = random.Random(args.seed)
    opts = {}
    if args.num_gpu_blocks:
        opts["num_gpu_blocks_override"] = args.num_gpu_blocks
    t0 = time.monotonic()
    totals: dict[str, int] = {}
    rss_20: dict[str, int] | None = None
    with LLM(args.model, args.tp, load_tokenizer=False, **opts) as llm:
        work = Workload(rng, llm.info.vocab_size, args.max_prompt, args.max_out)
        done = 0
        mark_20 = max(1, args.n // 5)
        while done < args.n:
            batch = [work.request() for _ in range(min(args.wave, args.n - done))]
            for k, v in run_wave(llm, batch, rng, args.abort_frac).items():
                totals[k] = totals.get(k, 0) + v
            done += len(batch)
            if rss_20 is None and done >= mark_20:
                rss_20 = process_rss(llm)
            if not args.json:
                print(f"\r{done}/{args.n} {totals}", end="", file=sys.stderr, flush=True)
        rss_end = process_rss(llm)
        health = llm.health()
        leaked = round(health.kv_usage * (llm.info.num_blocks - 1))
        assert rss_20 is not None
        growth = {k: 100.0 * (rss_end[k] - rss_20[k]) / max(1, rss_20[k]) for k in rss_end}
    result = {
        "requests": args.n,
        "lost_requests": totals.get("lost", 0),
        "leaked_blocks": leaked,
        "rss_growth_pct": max(growth.values()),
        "finish_reasons": {k: v for k, v in totals.items() if k != "lost"},
        "rss_kib_at_20pct": rss_20,
        "rss_kib_at_100pct": rss_end,
        "rss_growth_pct_per_process": {k: round(v, 2) for k, v in growth.items()},
        "engine_steps": health.steps,
        "wall_s": round(time.monotonic() - t0, 1),
    }
    print(file=sys.stderr)
    if args.json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    res = main()
    ok = res["lost_requests"] == 0 and res["leaked_blocks"] == 0 and res["rss_growth_pct"] <= 5
    sys.exit(0 if ok else 1)
