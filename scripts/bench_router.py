"""Tandem replicas behind the real vllm-router: which routing policy keeps a multi-turn chat on
the replica that holds its history?

N servers (default 2, dummy:tiny with a small made-up tokenizer, as the tests build it), each
publishing KV cache events, behind `vllm-router` with each policy in turn (fresh servers and a
fresh router per policy, so no policy inherits another's cache). The workload: several
conversations that share a system prompt; each turn appends a user message to the history and
the reply to it, so every turn's prompt extends the last one. Conversations run concurrently,
turns within one in order, every request streamed (TTFT = time to the first chunk).

  python scripts/bench_router.py                       # 2 replicas, 3 policies
  ... --replicas 3 --conversations 16 --turns 6 --policies kv_aware,round_robin

Per policy: requests/s and tokens/s over the whole run, TTFT median and p99, and the prefix-hit
rate from the servers' vllm:prefix_cache_hits / _queries counters (after minus before, summed
over replicas); for kv_aware also the mean prefix the router credited per decision (from its
debug log). The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from typing import Any

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from bench_common import emit_json, percentile  # noqa: E402

from tests.serve.router_helpers import ROUTER, events_config, router  # noqa: E402
from tests.serve.serve_helpers import free_port, make_tokenizer_dir, metric, serve  # noqa: E402

MODEL = "tiny"
WORDS = ("the quick brown fox jumps over lazy dog hello world how are you today and then it "
         "runs home again while we talk about cats dogs birds trees rivers stones").split()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--model", default="dummy:tiny")
    p.add_argument("--policies", default="round_robin,cache_aware,kv_aware")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-words", type=int, default=64, help="shared system prompt")
    p.add_argument("--first-words", type=int, default=96, help="each conversation's opening")
    p.add_argument("--turn-words", type=int, default=16, help="user words per later turn")
    p.add_argument("--max-tokens", type=int, default=16, help="reply tokens per turn")
    p.add_argument("--kv-cache-memory", default="32M", help="per replica")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=120.0, help="per request")
    p.add_argument("--log-dir", default=None, help="keep server and router logs here")
    p.add_argument("--json", action="store_true", help="(the JSON line is always printed)")
    return p.parse_args(argv)


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def chat_turn(url: str, messages: list[dict[str, str]], args: argparse.Namespace
              ) -> tuple[float, str]:
    """One streamed chat request: (TTFT s, reply text). Only fields the router knows: it
    credits no prefix to a body carrying one it does not. With ignore_eos every reply is
    max_tokens tokens long."""
    body = {"model": MODEL, "messages": messages, "max_tokens": args.max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    ttft = 0.0
    text: list[str] = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body,
                      timeout=args.timeout_s) as r:
        if r.status_code != 200:
            raise RuntimeError(f"chat request failed: {r.status_code} {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            delta = (ev.get("choices") or [{}])[0].get("delta") or {}
            if isinstance(delta.get("content"), str):  # a token's chunk (its text may be "")
                if not ttft:
                    ttft = time.perf_counter() - t0
                text.append(delta["content"])
    return ttft or time.perf_counter() - t0, "".join(text)


def conversation(url: str, seed: int, system: str, args: argparse.Namespace,
                 ttfts: list[float], errors: list[str]) -> None:
    rng = random.Random(seed)
    messages = [{"role": "system", "content": system},
                {"role": "user", "content": words(rng, args.first_words)}]
    try:
        for _ in range(args.turns):
            ttft, reply = chat_turn(url, messages, args)
            ttfts.append(ttft)
            messages += [{"role": "assistant", "content": reply},
                         {"role": "user", "content": words(rng, args.turn_words)}]
    except Exception as e:  # noqa: BLE001 - reported in the JSON, the run goes on
        errors.append(f"{type(e).__name__}: {e}")


def prefix_counters(base_urls: list[str]) -> tuple[float, float]:
    hits = queries = 0.0
    for u in base_urls:
        text = httpx.get(u + "/metrics", timeout=10).text
        hits += metric(text, "vllm:prefix_cache_hits_total")
        queries += metric(text, "vllm:prefix_cache_queries_total")
    return hits, queries


def run_policy(policy: str, args: argparse.Namespace, tok: str, log_dir: str) -> dict[str, Any]:
    engine = ["--model", args.model, "--dtype", "float32", "--kv-cache-memory",
              args.kv_cache_memory, "--max-model-len", str(args.max_model_len),
              "--served-model-name", MODEL, "--tokenizer", tok]
    with ExitStack() as stack:
        servers, sources = [], []
        for _ in range(args.replicas):
            ev = free_port()
            servers.append(stack.enter_context(serve(
                *engine, "--kv-events-config", events_config(ev, free_port()),
                log_dir=log_dir)))
            sources.append(f"tcp://127.0.0.1:{ev}")
        urls = [s.base_url for s in servers]
        extra: list[str] = []
        if policy == "kv_aware":
            for u, src in zip(urls, sources, strict=True):
                extra += ["--kv-event-source", f"{u}={src}"]
            extra += ["--kv-event-block-size", "16", "--kv-event-model", MODEL]
        with router("--worker-urls", *urls, "--policy", policy, *extra,
                    log_dir=log_dir) as url:
            rng = random.Random(args.seed)
            system = words(rng, args.system_words)
            h0, q0 = prefix_counters(urls)
            ttfts: list[float] = []
            errors: list[str] = []
            threads = [threading.Thread(target=conversation, args=(
                url, args.seed * 1000 + i, system, args, ttfts, errors), daemon=True)
                for i in range(args.conversations)]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join(args.timeout_s * args.turns)
            wall = time.perf_counter() - t0
            if any(t.is_alive() for t in threads):
                errors.append("a conversation did not finish in time")
            time.sleep(0.5)  # the engines' counters reach /metrics with their next report
            h1, q1 = prefix_counters(urls)
            log_path = os.path.join(log_dir, f"router-{url.rsplit(':', 1)[1]}.log")
    out: dict[str, Any] = {
        "requests": len(ttfts), "errors": len(errors),
        "req_per_s": len(ttfts) / wall, "wall_s": wall,
        "output_tok_per_s": len(ttfts) * args.max_tokens / wall,
        "ttft_median_ms": statistics.median(ttfts) * 1e3 if ttfts else None,
        "ttft_p99_ms": percentile(ttfts, 99) * 1e3 if ttfts else None,
        "prefix_hit_rate": (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0,
    }
    if errors:
        out["first_error"] = errors[0][:300]
    if policy == "kv_aware":
        log = re.sub(r"\x1b\[[0-9;]*m", "", open(log_path, errors="replace").read())
        credited = [int(m) for m in re.findall(r"credited_prefix_tokens=(\d+)", log)]
        out["credited_prefix_tokens_mean"] = statistics.mean(credited) if credited else 0.0
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    if ROUTER is None:
        raise SystemExit("the vllm-router binary is not installed (pip install vllm-router)")
    policies = [p for p in args.policies.split(",") if p]
    res: dict[str, Any] = {"replicas": args.replicas, "conversations": args.conversations,
                           "turns": args.turns, "model": args.model}
    with tempfile.TemporaryDirectory(prefix="bench-router-") as tmp:
        log_dir = args.log_dir or tmp
        tok = make_tokenizer_dir(os.path.join(tmp, "tok"))
        for policy in policies:
            for k, v in run_policy(policy, args, tok, log_dir).items():
                res[f"{policy}_{k}"] = v
    return res


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # so the servers and the router are stopped on the way out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminated)
    emit_json(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
