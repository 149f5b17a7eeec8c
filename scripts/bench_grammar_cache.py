"""Compiled-grammar memory under a hostile client: one new JSON schema per request.

Sends --count requests, each with a schema no earlier request used (about 60 KB compiled each
with the test tokenizer), and samples the resident memory (RSS) of every process as it goes:
the frontend and, with --serve, the engine core and every worker rank. With a bounded cache
(--structured-outputs-cache-mb) RSS stops growing once the cache is full; with a huge one it
grows by the grammars' size per request in every process.

    python scripts/bench_grammar_cache.py --cache-mb 16 --json            # the cache alone
    python scripts/bench_grammar_cache.py --serve --cache-mb 16 --json    # a TP=2 server

Reports per process: RSS after the first request, after 2/3 of them and at the end (KiB), and
the growth over the last third as a share of the growth before it ("plateau": 0 is flat);
plus the cache's bytes and evictions and every output's validity against its schema.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_common import emit_json  # noqa: E402

PATTERNS = ["^[a-z ]{1,40}$", "^[a-z ]{2,40}$", "^[0-9]{1,12}$"]


def schema(i: int) -> dict[str, Any]:
    """The i-th distinct schema: three patterned strings under names no other schema uses
    (patterns, not maxLength: xgrammar 0.2.8 lets a maxLength string hold raw control bytes,
    which no JSON parser takes)."""
    names = [f"f{i}_{j}" for j in range(len(PATTERNS))]
    props = {n: {"type": "string", "pattern": p} for n, p in zip(names, PATTERNS, strict=True)}
    return {"type": "object", "additionalProperties": False, "required": names,
            "properties": props}


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def children(pid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    rest = f.read().decode(errors="replace").rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(rest[1]) == pid and rest[0] != "Z":
                out.append(int(name))
    return out


def summarize(samples: dict[str, list[int]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, s in samples.items():
        first, fill, last = s[0], s[len(s) * 2 // 3], s[-1]
        out[f"{name}_rss_first_kb"] = float(first)
        out[f"{name}_rss_two_thirds_kb"] = float(fill)
        out[f"{name}_rss_last_kb"] = float(last)
        out[f"{name}_plateau"] = (last - fill) / max(1, fill - first)
    return out


def run_unit(args: argparse.Namespace) -> dict[str, float]:
    """The frontend's cache in this process: compile, wait, release, as a request would."""
    from launch.structured import FrontendGrammars
    from launch.tokenizer import load_tokenizer
    from protocol.config import EngineConfig
    from protocol.messages import SamplingParams
    from protocol.structured import StructuredOutputsParams

    tok = load_tokenizer(args.tokenizer)
    grammars = FrontendGrammars(tok, 32000, EngineConfig(structured_outputs_cache_mb=args.cache_mb))
    samples: list[int] = []
    t0 = time.perf_counter()
    for i in range(args.count):
        sp = SamplingParams(structured_outputs=StructuredOutputsParams(json=schema(i)))
        grammars.prepare([sp])
        samples.append(rss_kb(os.getpid()))
    assert grammars.cache is not None
    out = summarize({"frontend": samples})
    out["compile_ms_mean"] = (time.perf_counter() - t0) / args.count * 1e3
    out["cache_bytes"] = float(grammars.cache.size_bytes)
    out["cache_grammars"] = float(len(grammars.cache))
    out["cache_evictions"] = float(grammars.cache.evictions)
    return out


def run_serve(args: argparse.Namespace) -> dict[str, float]:
    import httpx
    import jsonschema

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    log = tempfile.NamedTemporaryFile(prefix="bench_grammar_cache", suffix=".log", delete=False)
    proc = subprocess.Popen(
        [sys.executable, "-m", "launch", "serve", "--port", str(port), "--model", args.model,
         "--tokenizer", args.tokenizer, "--nproc-per-node", str(args.tp),
         "--kv-cache-memory", "64M", "--served-model-name", "m"]
        + (["--structured-outputs-cache-mb", str(args.cache_mb)] if args.cache_mb >= 0 else []),
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start; see {log.name}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        core = children(proc.pid)
        pids = {"frontend": proc.pid}
        pids |= {f"engine{i}": p for i, p in enumerate(sorted(core + [
            g for c in core for g in children(c)]))}
        samples: dict[str, list[int]] = {name: [] for name in pids}
        valid = stopped = 0
        t0 = time.perf_counter()
        with httpx.Client(timeout=120) as client:
            for i in range(args.count):
                s = schema(i)
                rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}
                r = client.post(url + "/v1/completions", json={
                    "model": "m", "prompt": "the quick brown fox", "max_tokens": 160,
                    "temperature": 0.0, "response_format": rf})
                r.raise_for_status()
                stopped += r.json()["choices"][0]["finish_reason"] == "stop"
                try:
                    jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), s)
                    valid += 1
                except (ValueError, jsonschema.ValidationError) as e:
                    if os.environ.get("BENCH_DEBUG"):
                        print("invalid:", repr(r.json()["choices"][0]["text"]), str(e)[:200])
                for name, pid in pids.items():
                    samples[name].append(rss_kb(pid))
        out = summarize(samples)
        out["request_ms_mean"] = (time.perf_counter() - t0) / args.count * 1e3
        out["stopped_outputs"] = float(stopped)  # the rest ran out of max_tokens
        out["valid_outputs"] = float(valid)
        return out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--count", type=int, default=600)
    p.add_argument("--cache-mb", type=int, default=16,
                   help="the cache budget in MiB; with --serve, -1 passes no flag (a build "
                   "without the option)")
    p.add_argument("--serve", action="store_true", help="a real server (TP=--tp), over HTTP")
    p.add_argument("--model", default="dummy:tiny")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer directory (default: a small byte-level BPE made here)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.tokenizer is None:
        from tests.serve.serve_helpers import make_tokenizer_dir

        args.tokenizer = make_tokenizer_dir(tempfile.mkdtemp(prefix="bench_tok"))
    result = {"count": float(args.count), "cache_mb": float(args.cache_mb)}
    result |= run_serve(args) if args.serve else run_unit(args)
    if args.json:
        emit_json(result)
    else:
        for k, v in result.items():
            print(f"{k:32s} {v:,.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
