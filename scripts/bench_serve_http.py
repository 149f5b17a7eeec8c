"""bench_serve.py --base-url: the same timed arrivals against an OpenAI-compatible server.

Every request is a streamed POST /v1/completions with a token-id prompt, `ignore_eos` and
`stream_options.include_usage` (vLLM honours both), one asyncio task per request. A chunk that
carries choices is a token arrival (TTFT, ITL); the output token count comes from the usage
chunk (the number of chunks when the server sends none).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
from typing import Any

from bench_common import make_prompts, sampling_params, scheduler_summary, start_llm
from openai_http import Target, get_json, request
from serve_load import Record, arrival_offsets, run_load, run_one, summarize

DEFAULT_VOCAB = 32000


def _headers(args: argparse.Namespace) -> dict[str, str]:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


async def _one(target: Target, body: dict[str, Any], headers: dict[str, str],
               timeout_s: float) -> Record:
    rec = Record(sent=time.perf_counter())
    chunks = 0
    usage: int | None = None
    done = False

    def on_event(data: bytes) -> None:
        nonlocal chunks, usage, done
        if data == b"[DONE]":
            done = True
            return
        obj = json.loads(data)
        if "error" in obj:
            err = obj["error"]
            rec.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
            return
        if obj.get("choices"):
            rec.token_times.append(time.perf_counter())
            chunks += 1
        if obj.get("usage"):
            usage = int(obj["usage"]["completion_tokens"])

    try:
        status, raw = await asyncio.wait_for(
            request(target, "POST", "/v1/completions", body, headers, on_event), timeout_s
        )
        if status != 200:
            rec.error = f"HTTP {status}: {raw[:300].decode(errors='replace')}"
        elif not done and rec.error is None:
            rec.error = "stream ended without [DONE]"
    except (OSError, asyncio.TimeoutError, ValueError) as e:
        rec.error = f"{type(e).__name__}: {e}"
    rec.num_tokens = usage if usage is not None else chunks
    rec.done = time.perf_counter()
    return rec


async def _load(args: argparse.Namespace, target: Target, model: str,
                prompts: list[Any]) -> tuple[list[Record], float]:
    headers = _headers(args)

    def body(prompt: Any) -> dict[str, Any]:
        return {
            "model": model, "prompt": prompt, "max_tokens": args.output_len,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True},
        }

    rng = random.Random(args.seed + 1)
    vocab = args.vocab_size or DEFAULT_VOCAB
    for _ in range(args.num_warmup):
        warm = [rng.randrange(10, vocab) for _ in range(8)]
        await _one(target, body(warm), headers, args.timeout_s)
    offsets = arrival_offsets(len(prompts), args.request_rate, args.burstiness, args.seed)
    gate = asyncio.Semaphore(args.max_concurrency or len(prompts))

    async def job(prompt: Any, at: float) -> Record:
        delay = at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        async with gate:  # waits while --max-concurrency requests are in flight
            return await _one(target, body(prompt), headers, args.timeout_s)

    start = time.perf_counter()
    tasks = [job(p, start + off) for p, off in zip(prompts, offsets, strict=True)]
    records = await asyncio.gather(*tasks)
    return list(records), time.perf_counter() - start


async def _model_info(args: argparse.Namespace, target: Target) -> tuple[str, dict[str, Any]]:
    models = await get_json(target, "/v1/models", _headers(args))
    entries = models.get("data") or []
    if args.served_model_name:
        name = args.served_model_name
        entry = next((m for m in entries if m.get("id") == name), {})
    elif entries:
        name, entry = entries[0]["id"], entries[0]
    else:
        raise SystemExit(f"{args.base_url}/v1/models lists no model; pass --served-model-name")
    return name, entry


def run_http(args: argparse.Namespace) -> dict[str, Any]:
    target = Target.parse(args.base_url)
    model, entry = asyncio.run(_model_info(args, target))
    vocab = args.vocab_size or DEFAULT_VOCAB
    if args.prompts_file:
        raise SystemExit("--base-url takes token-id prompts only (drop --prompts-file)")
    prompts = make_prompts(args, vocab)
    records, wall = asyncio.run(_load(args, target, model, prompts))
    res: dict[str, Any] = {
        "base_url": args.base_url,
        "served_model_name": model,
        "model_root": entry.get("root"),
        "num_prompts": len(prompts),
        "input_len": args.input_len,
        "output_len": args.output_len,
        "request_rate": None if math.isinf(args.request_rate) else args.request_rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
    }
    res |= summarize(records, wall, args.slo)
    errors = [r.error for r in records if r.error is not None]
    if errors:
        res["first_error"] = errors[0]
    if args.with_python_api:
        py = _python_api(args, prompts)
        res["python_api"] = py
        if py["output_tokens_per_s"] > 0:
            res["http_over_python_throughput"] = (
                res["output_tokens_per_s"] / py["output_tokens_per_s"]
            )
    return res


def _python_api(args: argparse.Namespace, prompts: list[Any]) -> dict[str, Any]:
    """The same prompts, arrivals and sampling through LLM.generate_stream, in this process."""
    llm = start_llm(args)
    try:
        params = sampling_params(args)
        rng = random.Random(args.seed + 1)
        for _ in range(args.num_warmup):
            run_one(llm, [rng.randrange(10, llm.info.vocab_size) for _ in range(8)], params,
                    args.timeout_s)
        before = llm.get_stats()
        records, wall = run_load(llm, prompts, params, args)
        after = llm.get_stats()
    finally:
        llm.shutdown()
    out: dict[str, Any] = {"model": args.model, "tensor_parallel_size": args.tensor_parallel_size}
    out |= summarize(records, wall, args.slo)
    out |= scheduler_summary(args, before, after)
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in out.items()}
