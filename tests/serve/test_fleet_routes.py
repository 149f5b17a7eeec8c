"""What vllm-router asks of a worker, against one real server (dummy:micro, a P/D-capable
engine): /get_load, the render routes (the ids a generation runs), /get_server_info, the
router's prefill request (nulls in kv_transfer_params, X-Request-Id) answered with top-level
kv_transfer_params, and vLLM's metric names beside Tandem's."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.serve.serve_helpers import Server, make_tokenizer_dir, metric, serve

pytestmark = pytest.mark.slow  # a server subprocess

ENGINE = ["--model", "dummy:micro", "--kv-cache-memory", "16M", "--max-model-len", "256",
          "--served-model-name", "micro", "--kv-transfer-config", '{"kv_role": "kv_both"}']
MSGS = [{"role": "user", "content": "hello world, how are you"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tok = make_tokenizer_dir(str(tmp_path_factory.mktemp("tok")))
    with serve(*ENGINE, "--tokenizer", tok, log_dir=str(tmp_path_factory.mktemp("log"))) as s:
        yield s


def post(server: Server, path: str, body: dict, **headers: str) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, headers=headers, timeout=60)


def test_load_and_server_info(server: Server) -> None:
    assert httpx.get(server.base_url + "/get_load", timeout=10).json() == {"load": 0}
    info = httpx.get(server.base_url + "/get_server_info", timeout=10).json()
    assert info["kv_block_size"] == 16 and info["model_path"] == "dummy:micro"
    # no --kv-events-config: no sources
    assert httpx.get(server.base_url + "/kv_event_sources", timeout=10).json()["sources"] == []


def test_render_gives_the_ids_a_generation_runs(server: Server) -> None:
    body = {"model": "micro", "prompt": "the quick brown fox", "max_tokens": 2,
            "return_token_ids": True}
    rendered = post(server, "/v1/completions/render", body).json()
    ran = post(server, "/v1/completions", body).json()["choices"][0]["prompt_token_ids"]
    assert [r["prompt_token_ids"] for r in rendered] == [ran]
    # vllm-router reads token_ids (prompt_token_ids alone leaves a kv_aware request unscored)
    assert [r["token_ids"] for r in rendered] == [ran]
    chat = {"model": "micro", "messages": MSGS, "max_tokens": 2}
    chat_rendered = post(server, "/v1/chat/completions/render", chat).json()
    ids = chat_rendered["prompt_token_ids"]
    assert chat_rendered["token_ids"] == ids
    usage = post(server, "/v1/chat/completions", chat).json()["usage"]
    assert len(ids) == usage["prompt_tokens"]
    tok = post(server, "/tokenize", {"model": "micro", "messages": MSGS,
                                     "add_special_tokens": False}).json()["tokens"]
    assert tok == ids


def test_routers_prefill_request(server: Server) -> None:
    """vllm-router's prefill half: the client's body, max_tokens 1, nulls for what the decode
    side fills in, and the request id in a header."""
    params = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
              "remote_block_ids": None, "remote_host": None, "remote_port": None}
    body = {"model": "micro", "prompt": list(range(10, 50)), "max_tokens": 1, "min_tokens": 1,
            "stream": False, "kv_transfer_params": params}
    r = post(server, "/v1/completions", body, **{"X-Request-Id": "router-abc-1"})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["id"] == "router-abc-1"
    kv = out["kv_transfer_params"]
    assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
    assert isinstance(kv["remote_engine_id"], str) and isinstance(kv["remote_port"], int)
    assert kv["remote_block_ids"] and all(isinstance(b, int) for b in kv["remote_block_ids"])
    # a header id is checked like a body's
    bad = post(server, "/v1/completions", {"model": "micro", "prompt": [5], "max_tokens": 1},
               **{"X-Request-Id": "x" * 5000})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "request_id"


def test_vllm_metric_names(server: Server) -> None:
    post(server, "/v1/completions", {"model": "micro", "prompt": [7] * 20, "max_tokens": 3,
                                      "ignore_eos": True})
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_count",
                 "vllm:time_per_output_token_seconds_count",
                 "vllm:inter_token_latency_seconds_count",
                 "vllm:e2e_request_latency_seconds_count", "tandem:num_requests_running"):
        metric(text, name)  # present (KeyError otherwise)
    assert metric(text, "vllm:generation_tokens_total") == metric(
        text, "tandem:generation_tokens_total")
    running = [ln for ln in text.splitlines() if ln.startswith("vllm:num_requests_running{")]
    assert 'engine="0"' in running[0] and 'model_name="micro"' in running[0]
