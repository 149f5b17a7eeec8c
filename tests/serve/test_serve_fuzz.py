"""Hostile and sloppy bodies against a real server: every answer 2xx or 4xx in the OpenAI error
shape, never a 5xx or a hang; the server is healthy after and a reference request's tokens are
unchanged. A bounded run of scripts/fuzz_http.py (its --count and --max-seconds), plus the
specific inputs that once took the engine down or answered 500."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from serve_helpers import ROOT, Server, make_tokenizer_dir, serve

sys.path.insert(0, os.path.join(ROOT, "scripts"))
from fuzz_http import check_error_shape, fuzz  # noqa: E402

MAX_BYTES = 65536
ENGINE = ["--model", "dummy:micro", "--kv-cache-memory", "16M", "--max-model-len", "256",
          "--max-request-bytes", str(MAX_BYTES)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tok = make_tokenizer_dir(str(tmp_path_factory.mktemp("tok")))
    with serve(*ENGINE, "--tokenizer", tok, log_dir=str(tmp_path_factory.mktemp("log"))) as s:
        yield s


def post(server: Server, route: str, body: Any) -> httpx.Response:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.base_url + route, content=raw, timeout=60,
                      headers={"Content-Type": "application/json"})


def refused(r: httpx.Response, status: int, fragment: str, param: str | None = None) -> None:
    assert r.status_code == status, r.text
    assert check_error_shape(r), r.text
    err = r.json()["error"]
    assert fragment in err["message"], err["message"]
    if param is not None:
        assert err["param"] == param, err


CMPL = {"model": "dummy:micro", "prompt": [5, 6, 7], "max_tokens": 2}
CHAT = {"model": "dummy:micro", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize(("route", "over", "fragment", "param"), [
    ("/v1/completions", {"top_k": 2**31}, "top_k must be <= 2147483647", "top_k"),
    ("/v1/completions", {"top_k": 4624082051456263061}, "top_k must be <=", "top_k"),
    ("/v1/completions", {"max_tokens": 10**30}, "must be <= max_model_len", "max_tokens"),
    ("/v1/completions", {"max_tokens": 257}, "must be <= max_model_len (256)", "max_tokens"),
    ("/v1/completions", {"min_tokens": 2**40, "max_tokens": 2}, "min_tokens", "min_tokens"),
    ("/v1/completions", {"priority": 2**70}, "priority must be an integer", "priority"),
    ("/v1/completions", {"seed": 2**64}, "seed must be a 64-bit integer", "seed"),
    ("/v1/completions", {"stop_token_ids": [2**33]}, "stop_token_ids", "stop_token_ids"),
    ("/v1/completions", {"n": 10**30}, "n must be in", "n"),
    ("/v1/completions", {"logprobs": 21}, "logprobs must be in [0, 20]", "logprobs"),
    ("/v1/completions", {"logit_bias": {"99999": 1}}, "not a token id", "logit_bias"),
    ("/v1/completions", {"logit_bias": {"5": 1e9}}, "finite number", "logit_bias"),
    ("/v1/completions", {"stop": ["x"] * 65}, "at most 64 allowed", "stop"),
    ("/v1/completions", {"stop": "y" * 1025}, "stop[0] is 1025 characters", "stop"),
    ("/v1/completions", {"request_id": "r" * 257}, "request_id must be 1 to 256", "request_id"),
    ("/v1/completions", {"prompt": "\ud800abc"}, "lone surrogate", "prompt"),
    ("/v1/completions", {"prompt": "a" * 60000}, "characters long", "prompt"),
    ("/v1/chat/completions", {"max_completion_tokens": 0}, "max_completion_tokens must be >= 1",
     "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]},
     "messages[0].role: unknown role", "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]},
     "needs content", "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\udfff"}]},
     "messages[0].content: string holds a lone surrogate", "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "content[0]", "messages"),
])
def test_field_refused(server: Server, route: str, over: dict[str, Any], fragment: str,
                       param: str) -> None:
    refused(post(server, route, (CMPL if route == "/v1/completions" else CHAT) | over), 400,
            fragment, param)


def test_body_bounds(server: Server) -> None:
    big = b'{"prompt": "' + b"a" * MAX_BYTES + b'"}'
    refused(post(server, "/v1/completions", big), 413, "--max-request-bytes")
    deep = b'{"prompt": ' + b"[" * 10000 + b"1" + b"]" * 10000 + b"}"
    refused(post(server, "/v1/completions", deep), 400, "nested deeper")
    refused(post(server, "/v1/completions", b'{"prompt": ' + b"[" * 40 + b"1" + b"]" * 40 + b"}"),
            400, "nested deeper", "prompt")


def test_n_choices_with_wrapping_seed(server: Server) -> None:
    # choice j uses (seed + j) mod 2**64: the top seed is valid for every choice
    r = post(server, "/v1/completions", CMPL | {"n": 3, "seed": 2**64 - 1, "temperature": 1.0})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 3


def test_fuzz_bounded(server: Server) -> None:
    res = fuzz(server.base_url, count=400, model="dummy:micro", seed=1234, concurrency=4,
               max_request_bytes=MAX_BYTES, max_seconds=40, server_pid=server.proc.pid)
    assert res["failures"] == [], res
    assert res["n_5xx"] == 0 and res["timeouts"] == 0 and res["bad_error_shape"] == 0, res
    assert res["engine_deaths"] == 0 and res["reference_tokens_identical"], res
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
    m = httpx.get(server.base_url + "/metrics", timeout=10).text
    running = [ln for ln in m.splitlines() if ln.startswith("tandem:num_requests_running")]
    assert running and float(running[0].rsplit(" ", 1)[1]) == 0.0, running  # no orphans
