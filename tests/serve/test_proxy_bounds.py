"""The P/D proxy's body bounds, through a real `python -m launch proxy` process.

The upstream servers here are recording stubs (a thread in this process), so the test can say
exactly what the proxy forwarded: a body the proxy refused (too large, too deep, not JSON) must
never reach them. The full prefill/decode path with real engines is tests/serve/test_pd_proxy.py.
A 400 MB body is streamed from a generator, so the test itself never holds it; the proxy's peak
RSS (VmHWM) must stay far below the body's size. Nothing outlives the test.
"""

from __future__ import annotations

import json
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from tests.serve.serve_helpers import ROOT, free_port

LIMIT = 1024 * 1024  # the proxy's --max-request-bytes in this test
HUGE = 400 * 1024 * 1024
MiB = 1024 * 1024


class Upstream:
    """A fake prefill/decode server that records every POST body it is sent."""

    def __init__(self) -> None:
        self.posts: list[tuple[str, bytes]] = []
        seen = self.posts

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # /health
                self._send(200, b"")

            def do_POST(self) -> None:
                n = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(n)
                seen.append((self.path, body))
                req = json.loads(body)
                answer: dict[str, Any] = {"id": "cmpl-1", "object": "text_completion",
                                          "choices": [{"index": 0, "text": "ok",
                                                       "finish_reason": "length"}]}
                if (req.get("kv_transfer_params") or {}).get("do_remote_decode"):
                    answer["kv_transfer_params"] = {"do_remote_prefill": True}
                self._send(200, json.dumps(answer).encode())

            def _send(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Upstream:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


class Proxy:
    def __init__(self, proc: subprocess.Popen[bytes], port: int) -> None:
        self.proc = proc
        self.port = port
        self.url = f"http://127.0.0.1:{port}"

    def status_kb(self, key: str) -> int:
        """VmRSS (now) or VmHWM (peak) of the proxy process, in kB."""
        with open(f"/proc/{self.proc.pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
        raise AssertionError(f"no {key} for pid {self.proc.pid}")


@pytest.fixture(scope="module")
def upstreams() -> Iterator[tuple[Upstream, Upstream]]:
    with Upstream() as prefill, Upstream() as decode:
        yield prefill, decode


@pytest.fixture(scope="module")
def proxy(upstreams: tuple[Upstream, Upstream]) -> Iterator[Proxy]:
    prefill, decode = upstreams
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "launch", "proxy", "--prefill", prefill.url, "--decode",
         decode.url, "--port", str(port), "--max-request-bytes", str(LIMIT)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    p = Proxy(proc, port)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"the proxy exited with {proc.returncode}"
            try:
                if httpx.get(p.url + "/pd/backends", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the proxy did not come up"
            time.sleep(0.2)
        yield p
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _raw_post(port: int, headers: dict[str, str], chunks: Iterator[bytes],
              timeout_s: float = 60.0) -> tuple[int | None, bytes]:
    """POST over a raw socket, sending `chunks` until the proxy answers (or hangs up).

    Returns (status or None when the connection was reset before an answer, raw answer). A
    server that refuses a body mid-way answers and closes while the client is still sending:
    the answer is read as soon as it arrives, between chunks.
    """
    head = "POST /v1/completions HTTP/1.1\r\nHost: proxy\r\n" + "".join(
        f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    answer = b""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        s.sendall(head.encode())
        try:
            for chunk in chunks:
                if select.select([s], [], [], 0)[0]:
                    break  # the proxy answered before the body ended
                s.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass
        s.settimeout(timeout_s)
        try:
            while True:
                got = s.recv(65536)
                if not got:
                    break
                answer += got
                if b"\r\n\r\n" in answer:
                    hdr, _, rest = answer.partition(b"\r\n\r\n")
                    length = [int(line.split(b":")[1]) for line in hdr.split(b"\r\n")
                              if line.lower().startswith(b"content-length:")]
                    if length and len(rest) >= length[0]:
                        break
        except ConnectionResetError:
            pass
    if not answer.startswith(b"HTTP/1.1 "):
        return None, answer
    return int(answer.split(b" ", 2)[1]), answer


def _chunked(total: int, size: int = MiB) -> Iterator[bytes]:
    """`total` bytes of a JSON-looking body as HTTP/1.1 chunks, made one at a time."""
    block = b"x" * size
    sent = 0
    yield b"%x\r\n%s\r\n" % (len(b'{"prompt": "'), b'{"prompt": "')
    while sent < total:
        yield b"%x\r\n%s\r\n" % (size, block)
        sent += size
    yield b"0\r\n\r\n"


def test_declared_huge_body_is_413_before_reading(proxy: Proxy, upstreams) -> None:
    before = len(upstreams[0].posts) + len(upstreams[1].posts)
    # the header alone decides: nothing of the body is ever sent
    status, answer = _raw_post(proxy.port, {"Content-Type": "application/json",
                                            "Content-Length": str(HUGE)}, iter(()))
    assert status == 413, answer[:300]
    assert b"--max-request-bytes" in answer
    assert len(upstreams[0].posts) + len(upstreams[1].posts) == before


def test_streamed_huge_body_is_413_and_rss_stays_bounded(proxy: Proxy, upstreams) -> None:
    rss0 = proxy.status_kb("VmRSS")
    before = len(upstreams[0].posts) + len(upstreams[1].posts)
    status, answer = _raw_post(proxy.port, {"Content-Type": "application/json",
                                            "Transfer-Encoding": "chunked"}, _chunked(HUGE))
    peak = proxy.status_kb("VmHWM")
    print(f"proxy RSS before {rss0 / 1024:.0f} MB, peak {peak / 1024:.0f} MB, "
          f"after {proxy.status_kb('VmRSS') / 1024:.0f} MB (400 MB chunked body)")
    # the proxy stops reading at the bound: a 400 MB body never lands in its memory (generous:
    # the bound is 1 MiB; an unbounded read took the process past 2 GB)
    assert peak - rss0 < 100 * 1024, (rss0, peak)
    assert status in (413, None), answer[:300]  # None: reset while still sending, after it
    if status is not None:
        assert b"--max-request-bytes" in answer
    assert len(upstreams[0].posts) + len(upstreams[1].posts) == before
    assert httpx.get(proxy.url + "/pd/backends", timeout=10).status_code == 200


def _post(proxy: Proxy, content: bytes, ctype: str = "application/json") -> httpx.Response:
    return httpx.post(proxy.url + "/v1/completions", content=content,
                      headers={"Content-Type": ctype}, timeout=30)


def _no_traceback(r: httpx.Response) -> None:
    text = r.text
    assert "Traceback" not in text and 'File "' not in text and ".py" not in text, text


def test_deep_json_is_400_and_not_forwarded(proxy: Proxy, upstreams) -> None:
    before = len(upstreams[0].posts) + len(upstreams[1].posts)
    for depth in (64, 100_000):
        deep = b'{"prompt": "a", "x": ' + b"[" * depth + b"]" * depth + b"}"
        r = _post(proxy, deep)
        assert r.status_code == 400, r.text
        assert "nested deeper than" in r.json()["error"]["message"]
        _no_traceback(r)
    assert len(upstreams[0].posts) + len(upstreams[1].posts) == before


def test_non_json_is_400_and_not_forwarded(proxy: Proxy, upstreams) -> None:
    before = len(upstreams[0].posts) + len(upstreams[1].posts)
    for body, ctype in ((b"not json at all", "application/json"),
                        (b'["a list"]', "application/json"),
                        (b'{"prompt": "\xff\xfe"}', "application/json"),
                        (b'{"prompt": "\\ud800"}', "application/json"),
                        (b'{"prompt": "a"}', "text/plain")):
        r = _post(proxy, body, ctype)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["type"] == "BadRequestError"
        _no_traceback(r)
    assert len(upstreams[0].posts) + len(upstreams[1].posts) == before


def test_a_good_request_still_goes_through(proxy: Proxy, upstreams) -> None:
    prefill, decode = upstreams
    n_p, n_d = len(prefill.posts), len(decode.posts)
    r = _post(proxy, json.dumps({"prompt": "hello", "max_tokens": 4}).encode())
    assert r.status_code == 200, r.text
    assert len(prefill.posts) == n_p + 1 and len(decode.posts) == n_d + 1
    sent = json.loads(decode.posts[-1][1])
    assert sent["prompt"] == "hello" and sent["kv_transfer_params"] == {"do_remote_prefill": True}
