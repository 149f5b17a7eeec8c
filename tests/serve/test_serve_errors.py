"""Bad requests get OpenAI-style errors with the engine's own messages, while a concurrent
stream completes unharmed; a dead engine is a 503 (and an `error` event mid-stream)."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from serve_helpers import ROOT, Server, make_tokenizer_dir, serve

openai = pytest.importorskip("openai")

KEY = "sekrit"
AUTH = {"Authorization": f"Bearer {KEY}"}
ENGINE = ["--model", "dummy:micro", "--kv-cache-memory", "16M"]
GOOD = {"model": "dummy:micro", "prompt": [5, 6, 7], "max_tokens": 4}

# (body overrides, expected message fragment): the README's failure table, row by row
ENGINE_ROWS: list[tuple[dict[str, Any], str]] = [
    ({"prompt": [5] * 1025}, "prompt has 1025 tokens, more than max_model_len 1024"),
    ({"prompt": []}, "prompt is empty: at least one token is needed"),
    ({"prompt": [[]]}, "prompt is empty: at least one token is needed"),
    ({"prompt": [5, 512]}, "token id 512 is outside the vocabulary [0, 512)"),
    ({"prompt": [-1, 5]}, "token id -1 is outside the vocabulary [0, 512)"),
    ({"prompt": [5, 2**31]}, "prompt token ids are not int32 values"),
    ({"temperature": -0.5}, "temperature must be >= 0"),
    ({"top_p": 0.0}, "top_p must be in (0, 1]"),
    ({"top_p": 1.5}, "top_p must be in (0, 1]"),
    ({"top_k": -2}, "top_k must be -1 or 0 (off) or a positive integer"),
    ({"max_tokens": 0}, "max_tokens must be >= 1"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens (5) must be <= max_tokens (2)"),
    ({"max_tokens": "many"}, "max_tokens"),
    ({"n": 0}, "n must be in"),
]
# JSON that the json module writes but strict parsers do not: NaN and Infinity literals
RAW_ROWS: list[tuple[bytes, str]] = [
    (b'{"prompt": [5, 6], "temperature": NaN}', "temperature must be a finite number"),
    (b'{"prompt": [5, 6], "temperature": Infinity}', "temperature must be a finite number"),
    (b'{"prompt": [5, 6], "top_p": NaN}', "top_p must be in (0, 1]"),
    (b'{"prompt": [5, 6], "max_tokens": ', "malformed JSON"),
    (b'[1, 2, 3]', "must be a JSON object"),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tok = make_tokenizer_dir(str(tmp_path_factory.mktemp("tok")))
    log_dir = str(tmp_path_factory.mktemp("log"))
    with serve(*ENGINE, "--tokenizer", tok, "--api-key", KEY, log_dir=log_dir) as s:
        yield s


def check_error(r: httpx.Response, status: int, fragment: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status
    assert fragment in err["message"], err["message"]


def test_bad_requests_beside_a_stream(server: Server) -> None:
    url = server.base_url + "/v1/completions"
    stream_body = {"model": "dummy:micro", "prompt": [5, 6, 7], "max_tokens": 300,
                   "temperature": 0, "ignore_eos": True, "stream": True,
                   "request_id": "dup-1", "return_token_ids": True}
    checks: list[Any] = []

    def post(body: dict[str, Any]) -> httpx.Response:
        return httpx.post(url, json=body, headers=AUTH, timeout=30)

    # the duplicate id first, while the stream's request is surely in flight
    checks.append(lambda: check_error(post(GOOD | {"request_id": "dup-1"}), 400,
                                      "already in flight"))
    for over, frag in ENGINE_ROWS:
        checks.append(lambda over=over, frag=frag: check_error(post(GOOD | over), 400, frag))
    for raw, frag in RAW_ROWS:
        checks.append(lambda raw=raw, frag=frag: check_error(
            httpx.post(url, content=raw, headers=AUTH | {"Content-Type": "application/json"},
                       timeout=30), 400, frag))
    checks += [
        lambda: check_error(httpx.post(url, content=b"prompt=hi", headers=AUTH | {
            "Content-Type": "application/x-www-form-urlencoded"}, timeout=30), 400,
            "Content-Type must be application/json"),
        lambda: check_error(post(GOOD | {"model": "gpt-9"}), 404, "does not exist"),
        lambda: check_error(httpx.post(url, json=GOOD, timeout=30), 401, "Unauthorized"),
        lambda: check_error(httpx.post(url, json=GOOD, timeout=30,
                                       headers={"Authorization": "Bearer wrong"}), 401,
                            "Unauthorized"),
        lambda: check_error(httpx.post(server.base_url + "/v1/chat/completions", json={
            "model": "dummy:micro"}, headers=AUTH, timeout=30), 400, "messages"),
    ]
    tokens: list[int] = []
    events = 0
    with httpx.stream("POST", url, json=stream_body, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for line in lines:
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            events += 1
            chunk = json.loads(data)
            assert "error" not in chunk, chunk
            tokens += chunk["choices"][0]["token_ids"]
            if checks:  # one bad request between every two chunks of the stream
                checks.pop(0)()
            last = chunk
        else:
            pytest.fail("stream ended without [DONE]")
    assert not checks, f"{len(checks)} checks did not run while the stream was open"
    assert len(tokens) == 300 and last["choices"][0]["finish_reason"] == "length"


def test_openai_client_exceptions(server: Server) -> None:
    c = openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=30)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="dummy:micro", prompt=[5, 6], max_tokens=4, top_p=2.0)
    assert "top_p must be in (0, 1]" in e.value.body["message"]  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="nope", prompt=[5, 6], max_tokens=4)
    bad = openai.OpenAI(base_url=server.base_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    # health and metrics stay open without the key
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
    assert httpx.get(server.base_url + "/metrics", timeout=10).status_code == 200
    c.close()
    bad.close()


def _worker_pid(server: Server) -> int:
    for pid in server.engine_pids():
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"workers" in f.read().split(b"\0"):
                return pid
    raise AssertionError("no worker process found")


def test_dead_engine_is_503(tmp_path: Any) -> None:
    with serve(*ENGINE, log_dir=str(tmp_path)) as server:
        url = server.base_url + "/v1/completions"
        body = {"prompt": [5, 6, 7], "max_tokens": 1000, "temperature": 0, "ignore_eos": True,
                "stream": True}
        datas: list[str] = []
        with httpx.stream("POST", url, json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    datas.append(line[6:])
                    if len(datas) == 1:  # the stream is live: kill a rank under it
                        os.kill(_worker_pid(server), signal.SIGKILL)
        assert datas[-1] == "[DONE]"
        err = json.loads(datas[-2])["error"]
        assert err["code"] == 503 and "worker" in err["message"], err
        deadline = time.monotonic() + 30
        while httpx.get(server.base_url + "/health", timeout=10).status_code != 503:
            assert time.monotonic() < deadline, "health never became 503"
            time.sleep(0.1)
        check_error(httpx.post(url, json=GOOD, timeout=30), 503, "the engine is dead")
        check_error(httpx.get(server.base_url + "/health", timeout=10), 503, "engine is dead")


# an absolute path anywhere in a body (a source file, the server's checkout)
ABS_PATH = re.compile(r"(?:^|[\s\"'(=:])/[\w.@~-]+/")


def _no_internals(text: str) -> None:
    for s in ("Traceback", 'File "', ".py", ROOT):
        assert s not in text, (s, text)
    assert not ABS_PATH.search(text), text


def test_dead_engine_bodies_carry_no_traceback(tmp_path: Any,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # a worker that raises: the engine's dead_reason is its whole traceback, with source paths
    monkeypatch.setenv("TANDEM_FAULT_INJECT", "raise@step=3,rank=0")
    with serve(*ENGINE, log_dir=str(tmp_path)) as server:
        monkeypatch.delenv("TANDEM_FAULT_INJECT")
        url = server.base_url + "/v1/completions"
        body = {"prompt": [5, 6, 7], "max_tokens": 64, "temperature": 0, "ignore_eos": True}
        with httpx.stream("POST", url, json=body | {"stream": True}, timeout=60) as r:
            assert r.status_code in (200, 503), r.read()
            text = r.read().decode()
        _no_internals(text)
        if r.status_code == 200:  # died mid-stream: an error event, then [DONE]
            datas = [ln[6:] for ln in text.splitlines() if ln.startswith("data: ")]
            assert datas[-1] == "[DONE]", text
            err = json.loads(datas[-2])["error"]
        else:
            err = json.loads(text)["error"]
        assert err["code"] == 503 and "a worker process failed" in err["message"], err
        deadline = time.monotonic() + 30
        while httpx.get(server.base_url + "/health", timeout=10).status_code != 503:
            assert time.monotonic() < deadline, "health never became 503"
            time.sleep(0.1)
        answers = [httpx.post(url, json=body, timeout=30),
                   httpx.post(url, json=body | {"stream": True}, timeout=30),
                   httpx.get(server.base_url + "/health", timeout=10),
                   httpx.get(server.base_url + "/census", timeout=10)]
        for a in answers:
            check_error(a, 503, "the engine is dead: a worker process failed")
            _no_internals(a.text)
        # the server's log is where the detail went
        deadline = time.monotonic() + 10
        while "injected fault" not in server.log():
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.1)
        assert "Traceback" in server.log()
