"""Fuzz an OpenAI-compatible server with hostile and sloppy request bodies.

Bodies come from the server's own request schemas (pydantic's JSON schema of CompletionRequest,
ChatCompletionRequest, TokenizeRequest, DetokenizeRequest), with fields swapped for values
from a hostile list (huge and negative integers, NaN/inf, wrong types, unknown roles, empty and
missing fields, surrogates and control characters, deep nesting), plus raw bodies (invalid
JSON, wrong content types, oversized bodies). Every answer must be 2xx, or 4xx in the OpenAI
error shape; a stream must end in [DONE]. /health is checked as it goes, and a reference
greedy request must give the same tokens before and after.

    python scripts/fuzz_http.py --base-url http://127.0.0.1:8000 --count 5000 --json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROUTES = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]
HOSTILE: list[Any] = [
    2**31 - 1, 2**31, -(2**31) - 1, 2**63, 2**64 - 1, 2**64, 10**30, -(10**30), -1, 0, 1,
    math.nan, math.inf, -math.inf, 1e308, -0.0, 0.5, "", "x" * 5000, "\ud800", "a\udfffb",
    "\x00\x01\x1f\x7f", "😀" * 50, None, True, False, [], {}, [None], [[1, 2], "a"],
    {"a": {"b": {"c": [1]}}}, [2**40], ["\ud83d"], {"\ud800": 1}, "12", "NaN",
]
ROLES = ["system", "user", "assistant", "tool", "developer", "robot", "", "USER", None, 5]


@dataclass
class Tally:
    sent: int = 0
    status: dict[str, int] = field(default_factory=dict)
    n_5xx: int = 0
    timeouts: int = 0
    bad_shape: int = 0
    health_failures: int = 0
    failures: list[str] = field(default_factory=list)

    def fail(self, what: str) -> None:
        if len(self.failures) < 20:
            self.failures.append(what[:400])


class BodyMaker:
    """Random bodies from the request schemas, with hostile values mixed in."""

    def __init__(self, rng: random.Random, model: str, max_request_bytes: int) -> None:
        from launch.serve.schemas import (
            ChatCompletionRequest,
            CompletionRequest,
            DetokenizeRequest,
            TokenizeRequest,
        )

        self.rng = rng
        self.model = model
        self.max_request_bytes = max_request_bytes
        self.schemas = {
            "/v1/completions": CompletionRequest.model_json_schema(),
            "/v1/chat/completions": ChatCompletionRequest.model_json_schema(),
            "/tokenize": TokenizeRequest.model_json_schema(),
            "/detokenize": DetokenizeRequest.model_json_schema(),
        }

    def value(self, schema: dict[str, Any], defs: dict[str, Any], depth: int = 0) -> Any:
        r = self.rng
        if "$ref" in schema:
            return self.value(defs[schema["$ref"].rsplit("/", 1)[1]], defs, depth)
        if "anyOf" in schema:
            return self.value(r.choice(schema["anyOf"]), defs, depth)
        t = schema.get("type")
        if t == "integer":
            return r.choice([0, 1, 2, 4, 8, r.randint(-5, 600)])
        if t == "number":
            return r.choice([0.0, 0.5, 1.0, r.uniform(-1, 2)])
        if t == "boolean":
            return r.random() < 0.5
        if t == "string":
            return r.choice(["hello", "the quick brown fox", "", "\u00e9t\u00e9", "a\nb"])
        if t == "null":
            return None
        if t == "array":
            n = r.choice([0, 1, 2, 3]) if depth < 4 else 0
            return [self.value(schema.get("items", {}), defs, depth + 1) for _ in range(n)]
        if t == "object":
            return self.obj(schema, defs, depth + 1)
        return r.choice(HOSTILE[:20])

    def obj(self, schema: dict[str, Any], defs: dict[str, Any], depth: int) -> dict[str, Any]:
        r = self.rng
        out: dict[str, Any] = {}
        required = set(schema.get("required", []))
        for name, sub in schema.get("properties", {}).items():
            if name in required or r.random() < 0.35:
                out[name] = self.value(sub, defs, depth)
        if "role" in out:
            out["role"] = r.choice(ROLES)
        return out

    def body(self, route: str) -> dict[str, Any]:
        r = self.rng
        schema = self.schemas[route]
        defs = schema.get("$defs", {})
        body = self.obj(schema, defs, 0)
        body["model"] = self.model if r.random() < 0.9 else r.choice(HOSTILE)
        if route.startswith("/v1/"):
            # keep valid bodies cheap to run: a few tokens, few choices
            body["max_tokens"] = r.choice([1, 2, 4, 8])
            body["n"] = r.choice([1, 1, 1, 2, 3])
            if route == "/v1/chat/completions":
                body.pop("max_completion_tokens", None)
                body["messages"] = [{"role": "user", "content": "hello there"}] + [
                    {"role": r.choice(ROLES), "content": self.value({}, defs)}
                    for _ in range(r.choice([0, 0, 1, 2]))
                ]
            elif "prompt" not in body or r.random() < 0.5:
                body["prompt"] = r.choice(
                    ["hello world", [1, 2, 3], [[5, 6], [7]], ["a b", "c"], [r.randint(0, 600)]]
                )
        for _ in range(r.choice([0, 1, 1, 2, 3])):  # hostile values in random fields
            keys = list(schema.get("properties", {}))
            body[r.choice(keys)] = r.choice(HOSTILE)
        if r.random() < 0.05:
            body.pop(r.choice(list(body)), None)  # a missing field, maybe a required one
        return body

    def request(self) -> tuple[str, bytes, dict[str, str]]:
        """(route, raw body, headers)."""
        r = self.rng
        route = r.choice(ROUTES)
        json_ct = {"Content-Type": "application/json"}
        x = r.random()
        if x < 0.02:
            return route, b'{"prompt": [1, 2', json_ct
        if x < 0.03:
            return route, b"prompt=hi", {"Content-Type": "application/x-www-form-urlencoded"}
        if x < 0.04:
            return route, b'{"model": 1}', {"Content-Type": "text/plain"}
        if x < 0.05:
            big = b'{"prompt": "' + b"a" * (self.max_request_bytes + 1) + b'"}'
            return route, big, json_ct
        if x < 0.06:
            n = r.choice([40, 3000, 20000])  # written by hand: json.dumps would recurse
            return route, b'{"prompt": ' + b"[" * n + b"1" + b"]" * n + b"}", json_ct
        if x < 0.07:
            return route, b"\xff\xfe not utf-8", json_ct
        body = self.body(route)
        return route, json.dumps(body).encode(), json_ct  # NaN/Infinity literals included


def check_error_shape(r: httpx.Response) -> bool:
    try:
        err = r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return (
        isinstance(err, dict)
        and set(err) == {"message", "type", "param", "code"}
        and isinstance(err["message"], str)
        and err["code"] == r.status_code
    )


def _stream_5xx(body: bytes) -> bool:
    for line in body.split(b"\n"):
        if line.startswith(b"data: {") and b'"error"' in line:
            err = json.loads(line[6:]).get("error")
            if isinstance(err, dict) and int(err.get("code") or 0) >= 500:
                return True
    return False


def send(client: httpx.Client, base: str, req: tuple[str, bytes, dict[str, str]],
         tally: Tally) -> None:
    route, raw, headers = req
    stream = b'"stream": true' in raw
    try:
        with client.stream("POST", base + route, content=raw, headers=headers) as r:
            body = r.read()
            key = str(r.status_code)
            tally.status[key] = tally.status.get(key, 0) + 1
            if r.status_code >= 500:
                tally.n_5xx += 1
                tally.fail(f"{r.status_code} {route} {raw[:300]!r} -> {body[:300]!r}")
            elif r.status_code >= 400:
                if not check_error_shape(r):
                    tally.bad_shape += 1
                    tally.fail(f"shape {route} {raw[:200]!r} -> {body[:300]!r}")
            elif stream and r.headers.get("content-type", "").startswith("text/event-stream"):
                if not body.rstrip().endswith(b"data: [DONE]"):
                    tally.bad_shape += 1
                    tally.fail(f"stream without [DONE] {route} {raw[:200]!r}")
                elif _stream_5xx(body):
                    tally.n_5xx += 1  # a 5xx error event mid-stream
                    tally.fail(f"stream error event {route} {raw[:200]!r} -> {body[-300:]!r}")
    except httpx.TimeoutException:
        tally.timeouts += 1
        tally.fail(f"timeout {route} {raw[:200]!r}")
    except httpx.HTTPError as e:
        tally.fail(f"transport {type(e).__name__} {route} {raw[:120]!r}")
        tally.timeouts += 1
    tally.sent += 1


def reference_tokens(base: str, model: str) -> list[int]:
    body = {"model": model, "prompt": [1, 2, 3, 4, 5], "max_tokens": 16, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    r = httpx.post(base + "/v1/completions", json=body, timeout=60)
    r.raise_for_status()
    return list(r.json()["choices"][0]["token_ids"])


def rss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def fuzz(base: str, count: int, model: str, seed: int = 0, concurrency: int = 4,
         timeout_s: float = 60.0, max_request_bytes: int = 8 * 1024 * 1024,
         max_seconds: float | None = None, server_pid: int | None = None) -> dict[str, Any]:
    base = base.rstrip("/").removesuffix("/v1")
    rng = random.Random(seed)
    maker = BodyMaker(rng, model, max_request_bytes)
    tally = Tally()
    ref_before = reference_tokens(base, model)
    t0 = time.monotonic()
    rss_samples: list[int] = []
    batch = max(concurrency * 8, 16)
    with httpx.Client(timeout=timeout_s) as client, ThreadPoolExecutor(concurrency) as pool:
        done = 0
        while done < count:
            if max_seconds is not None and time.monotonic() - t0 > max_seconds:
                break
            reqs = [maker.request() for _ in range(min(batch, count - done))]
            list(pool.map(lambda q: send(client, base, q, tally), reqs))
            done += len(reqs)
            try:
                ok = client.get(base + "/health", timeout=10).status_code == 200
            except httpx.HTTPError:
                ok = False
            if not ok:
                tally.health_failures += 1
                tally.fail(f"/health failed after {done} bodies")
                break
            if server_pid:
                rss_samples.append(rss_kb(server_pid))
    elapsed = time.monotonic() - t0
    ref_after = reference_tokens(base, model)
    out: dict[str, Any] = {
        "bodies": tally.sent,
        "elapsed_s": round(elapsed, 1),
        "status": dict(sorted(tally.status.items())),
        "n_5xx": tally.n_5xx,
        "timeouts": tally.timeouts,
        "bad_error_shape": tally.bad_shape,
        "engine_deaths": tally.health_failures,
        "reference_tokens_identical": ref_before == ref_after,
        "failures": tally.failures,
    }
    if len(rss_samples) >= 2:
        first = rss_samples[max(0, len(rss_samples) // 10 - 1)]  # after warm-up
        out["frontend_rss_kb_start"] = first
        out["frontend_rss_kb_end"] = rss_samples[-1]
        out["frontend_rss_growth_pct"] = round(100.0 * (rss_samples[-1] - first) / first, 2)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--count", type=int, default=1000)
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--timeout-s", type=float, default=60.0, help="per request")
    p.add_argument("--max-request-bytes", type=int, default=8 * 1024 * 1024,
                   help="the server's --max-request-bytes (oversized bodies go one past it)")
    p.add_argument("--max-seconds", type=float, default=None, help="stop sending after this")
    p.add_argument("--server-pid", type=int, default=None, help="report this process's RSS")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    base = args.base_url.rstrip("/").removesuffix("/v1")
    model = args.model or httpx.get(base + "/v1/models", timeout=30).json()["data"][0]["id"]
    res = fuzz(base, args.count, model, args.seed, args.concurrency, args.timeout_s,
               args.max_request_bytes, args.max_seconds, args.server_pid)
    ok = (res["n_5xx"] == 0 and res["timeouts"] == 0 and res["bad_error_shape"] == 0
          and res["engine_deaths"] == 0 and res["reference_tokens_identical"])
    res["ok"] = ok
    if args.json:
        print(json.dumps(res))
    else:
        for k, v in res.items():
            print(f"{k}: {v}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
