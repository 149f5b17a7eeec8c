"""P/D over HTTP: `python -m launch pd` (a prefill server, a decode server and the proxy), driven
with the real `openai` client, streaming and not: the proxied answer equals the prefill
server's own (one engine), the decode side reports the pulled prompt as cached tokens, the
prefill server answers kv_transfer_params at the top level as vLLM does, /metrics shows the
transfers, and a proxy whose prefill server is gone falls back to the decode server's own
prefill. Nothing outlives the test.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.helpers.procs import descendants, pid_alive
from tests.serve.serve_helpers import ROOT, free_port, metric

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow  # two engines behind a proxy

PROMPT = [(i * 7919) % 31000 + 300 for i in range(75)]
MAX_BODY = 256 * 1024  # given to pd, which gives it to its servers and its proxy


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict]]:
    port = free_port()
    logs = str(tmp_path_factory.mktemp("pd-logs"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "launch", "pd", "--prefill-tp", "1", "--decode-tp", "1",
         "--port", str(port), "--log-dir", logs, "--model", "dummy:tiny", "--dtype", "float32",
         "--kv-cache-memory", "16M", "--max-model-len", "512",
         "--max-request-bytes", str(MAX_BODY)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    kids: list[int] = []
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, f"pd exited with {proc.returncode}"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the P/D set did not come up"
            time.sleep(0.3)
        kids = descendants(proc.pid)
        yield url, httpx.get(url + "/pd/backends").json()
    finally:
        kids = kids or descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        deadline = time.monotonic() + 15
        while any(pid_alive(p) for p in kids) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [p for p in kids if pid_alive(p)]
        for p in left:
            os.kill(p, signal.SIGKILL)
        assert not left, f"processes outlived pd: {left}"


def test_proxy_streams_what_one_engine_generates(pd) -> None:
    url, backends = pd
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    # the reference: the prefill server alone, no P/D
    ref = httpx.post(backends["prefill"][0] + "/v1/completions", timeout=60, json={
        "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True}).json()["choices"][0]["token_ids"]
    extra = {"return_token_ids": True, "ignore_eos": True}
    full = client.completions.create(model="dummy:tiny", prompt=PROMPT, max_tokens=8,
                                     temperature=0, extra_body=extra)
    assert full.choices[0].model_extra["token_ids"] == ref
    assert full.usage.prompt_tokens_details.cached_tokens == len(PROMPT) - 1
    tokens, usage = [], None
    stream = client.completions.create(model="dummy:tiny", prompt=PROMPT, max_tokens=8,
                                       temperature=0, stream=True, extra_body=extra,
                                       stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices:
            tokens += chunk.choices[0].model_extra.get("token_ids") or []
        if chunk.usage is not None:
            usage = chunk.usage
    assert tokens == ref
    assert usage is not None and usage.prompt_tokens_details.cached_tokens == len(PROMPT) - 1
    assert httpx.get(url + "/pd/backends").json()["fallbacks"] == 0
    text = httpx.get(backends["decode"][0] + "/metrics").text
    assert metric(text, "tandem:kv_transfers_total") == 2
    assert metric(text, "tandem:kv_transfer_bytes_total") > 0
    assert metric(text, "tandem:kv_transfer_seconds_count") == 2
    assert metric(text, "tandem:kv_transfer_failed_total") == 0


def test_prefill_answer_carries_kv_transfer_params(pd) -> None:
    _, backends = pd
    r = httpx.post(backends["prefill"][0] + "/v1/completions", timeout=60, json={
        "prompt": PROMPT[:40], "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 200
    params = r.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_num_tokens"] == 40 and params["tp_size"] == 1
    assert {"remote_engine_id", "remote_block_ids", "remote_host", "remote_port",
            "remote_request_id"} <= set(params)
    # a malformed value is a 400 naming the field
    bad = httpx.post(backends["prefill"][0] + "/v1/completions", timeout=60, json={
        "prompt": PROMPT[:40], "max_tokens": 1, "kv_transfer_params": {"tp_size": "two"}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "kv_transfer_params"


def test_proxy_falls_back_to_the_decode_servers_prefill(pd) -> None:
    from launch.proxy.app import PDProxy, build_app

    _, backends = pd
    proxy = PDProxy([f"http://127.0.0.1:{free_port()}"], backends["decode"])  # nobody there

    async def run() -> dict:
        await proxy.start()
        try:
            transport = httpx.ASGITransport(app=build_app(proxy))
            async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as c:
                r = await c.post("/v1/completions", timeout=60, json={
                    "prompt": PROMPT[:30], "max_tokens": 4, "temperature": 0,
                    "return_token_ids": True, "ignore_eos": True})
                return r.json()
        finally:
            await proxy.stop()

    body = asyncio.run(run())
    assert len(body["choices"][0]["token_ids"]) == 4
    assert proxy.num_fallbacks == 1


def test_proxy_refuses_what_its_servers_would(pd) -> None:
    """pd gives its servers' --max-request-bytes to its proxy, which refuses a larger body, a
    too-deep one and one that is not JSON itself (tests/serve/test_proxy_bounds.py shows with
    recording upstreams that such a body is never forwarded)."""
    url, backends = pd
    before = metric(httpx.get(backends["prefill"][0] + "/metrics").text,
                    "tandem:prompt_tokens_total")
    big = {"prompt": "a" * MAX_BODY, "max_tokens": 1}
    r = httpx.post(url + "/v1/completions", json=big, timeout=60)
    assert r.status_code == 413 and str(MAX_BODY) in r.json()["error"]["message"], r.text
    deep = b'{"prompt": [1], "x": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    for content in (deep, b"prompt=1"):
        r = httpx.post(url + "/v1/completions", content=content, timeout=60,
                       headers={"Content-Type": "application/json"})
        assert r.status_code == 400, r.text
        assert "Traceback" not in r.text and ".py" not in r.text
    after = metric(httpx.get(backends["prefill"][0] + "/metrics").text,
                   "tandem:prompt_tokens_total")
    assert after == before
