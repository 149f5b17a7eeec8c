"""Tandem servers as replicas behind the real vllm-router binary: regular mode (completions,
streamed and not), P/D mode (one prefill and one decode server; greedy tokens equal one
engine's, the decode engine loads the prompt's KV instead of computing it) and kv_aware routing
fed by Tandem's KV cache events (a request goes to the replica holding its prefix).

Two servers serve every test (both P/D capable, both publishing events; the first at TP=1,
the second at TP=2, so P/D runs 1 -> 2 and 2 -> 1); each router is started and stopped by its
test. Skipped where the vllm-router binary is absent.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.serve.router_helpers import ROUTER, events_config, router
from tests.serve.serve_helpers import Server, free_port, make_tokenizer_dir, metric, serve

pytestmark = [
    pytest.mark.slow,  # two engines and a router
    pytest.mark.skipif(ROUTER is None, reason="the vllm-router binary is not installed "
                       "(pip install vllm-router==0.1.17, linux x86_64 wheels only)"),
]

MODEL = "tiny"
Replica = tuple[Server, str, str]  # the server, its event endpoint, its replay endpoint
ENGINE = ["--model", "dummy:tiny", "--dtype", "float32", "--kv-cache-memory", "16M",
          "--max-model-len", "512", "--served-model-name", MODEL,
          "--kv-transfer-config", '{"kv_role": "kv_both"}']


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Replica]]:
    tok = make_tokenizer_dir(str(tmp_path_factory.mktemp("tok")))
    logs = str(tmp_path_factory.mktemp("logs"))
    ports = [(free_port(), free_port()) for _ in range(2)]
    with serve(*ENGINE, "--tokenizer", tok, "--kv-events-config", events_config(*ports[0]),
               log_dir=logs) as s1, \
         serve(*ENGINE, "--tokenizer", tok, "--kv-events-config", events_config(*ports[1]),
               "--nproc-per-node", "2", log_dir=logs) as s2:
        yield [(s, f"tcp://127.0.0.1:{ev}", f"tcp://127.0.0.1:{rp}")
               for s, (ev, rp) in zip((s1, s2), ports, strict=True)]


def prompt_tokens(s: Server) -> float:
    return metric(httpx.get(s.base_url + "/metrics", timeout=10).text, "vllm:prompt_tokens_total")


def complete(url: str, prompt: list[int] | str, **extra: object) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True} | extra
    body = {k: v for k, v in body.items() if v is not None}  # None: leave the field out
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_regular_mode(servers: list[Replica], tmp_path: object) -> None:
    (s1, _, _), (s2, _, _) = servers
    prompt = [(i * 7919) % 31000 + 300 for i in range(40)]
    want = complete(s1.base_url, prompt)["choices"][0]["token_ids"]
    with router("--worker-urls", s1.base_url, s2.base_url, "--policy", "round_robin",
                log_dir=str(tmp_path)) as url:
        for _ in range(2):  # round robin: one to each server
            assert complete(url, prompt)["choices"][0]["token_ids"] == want
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True, "stream": True}
        got: list[int] = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    got += json.loads(line[6:])["choices"][0].get("token_ids") or []
        assert got == want


@pytest.mark.parametrize("direction", ["tp1-to-tp2", "tp2-to-tp1"])
def test_pd_mode(servers: list[Replica], tmp_path: object, direction: str) -> None:
    (s1, _, _), (s2, _, _) = servers
    prefill, decode = (s1, s2) if direction == "tp1-to-tp2" else (s2, s1)
    seed = 104729 if direction == "tp1-to-tp2" else 7919  # a prompt neither server holds
    prompt = [(i * seed) % 31000 + 200 for i in range(75)]
    # one engine's tokens, from the prefill server: the decode server must not hold the prompt
    want = complete(prefill.base_url, prompt)["choices"][0]["token_ids"]
    loaded = metric(httpx.get(decode.base_url + "/metrics", timeout=10).text,
                    "tandem:kv_loaded_tokens_total")
    with router("--vllm-pd-disaggregation", "--prefill", prefill.base_url, "--decode",
                decode.base_url, "--policy", "round_robin", log_dir=str(tmp_path)) as url:
        out = complete(url, prompt, max_tokens=8)
    assert out["choices"][0]["token_ids"] == want
    text = httpx.get(decode.base_url + "/metrics", timeout=10).text
    # the decode engine pulled all but the last prompt token (recomputed to sample the first)
    assert metric(text, "tandem:kv_loaded_tokens_total") - loaded == len(prompt) - 1


def test_kv_aware_follows_the_prefix(servers: list[Replica],
                                     tmp_path: object) -> None:
    (s1, e1, r1), (s2, e2, r2) = servers
    with router("--worker-urls", s1.base_url, s2.base_url, "--policy", "kv_aware",
                "--kv-event-source", f"{s1.base_url}={e1}",
                "--kv-event-source", f"{s2.base_url}={e2}",
                "--kv-event-replay-source", f"{s1.base_url}={r1}",
                "--kv-event-replay-source", f"{s2.base_url}={r2}",
                "--kv-event-block-size", "16", "--kv-event-model", MODEL,
                log_dir=str(tmp_path)) as url:
        # each server computes its own prefix, sent to it directly: only its events tell the
        # router where the prefix is
        prefixes = {s1: "the quick brown fox jumps over the lazy dog " * 8,
                    s2: "hello world, how are you today? " * 10}
        for s, p in prefixes.items():
            complete(s.base_url, p, max_tokens=1)
        # the engine publishes a step's events after answering it: give the router's
        # subscriber a moment (a settle time, not a measured threshold)
        time.sleep(1.0)
        for s, p in prefixes.items():
            before = {x: prompt_tokens(x) for x in (s1, s2)}
            # no return_token_ids: vllm-router 0.1.17 credits no prefix to a request carrying a
            # field it does not know (it cannot tell whether the field changes the KV)
            out = complete(url, p + "and then it runs home", max_tokens=1,
                           return_token_ids=None)
            after = {x: prompt_tokens(x) for x in (s1, s2)}
            assert after[s] > before[s], "the router sent the request away from its prefix"
            assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16
