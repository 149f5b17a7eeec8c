"""A small asyncio HTTP/1.1 client for OpenAI-compatible servers (stdlib only), for benchmarks.

One connection per request, `Connection: close`, so nothing is shared between requests and the
client adds as little work as it can per token: a streamed response is read chunk by chunk
(chunked transfer encoding, a Content-Length, or until EOF) and every server-sent event's
`data:` payload is handed to a callback the moment its event is complete.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit


@dataclass(frozen=True)
class Target:
    host: str
    port: int
    tls: bool
    prefix: str  # path before /v1/..., e.g. "" or "/proxy"

    @classmethod
    def parse(cls, base_url: str) -> Target:
        """'http://127.0.0.1:8000' or 'http://host:8000/v1' (the /v1 is dropped)."""
        u = urlsplit(base_url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        tls = u.scheme == "https"
        path = u.path.rstrip("/")
        if path.endswith("/v1"):
            path = path[: -len("/v1")]
        return cls(u.hostname, u.port or (443 if tls else 80), tls, path)


async def request(
    target: Target,
    method: str,
    path: str,
    body: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
    on_event: Callable[[bytes], None] | None = None,
) -> tuple[int, bytes]:
    """Send one request; returns (status, body). With `on_event`, the body is parsed as
    server-sent events as it arrives and each `data:` payload goes to on_event (the returned
    body is then empty)."""
    payload = json.dumps(body).encode() if body is not None else b""
    ctx = ssl.create_default_context() if target.tls else None
    reader, writer = await asyncio.open_connection(target.host, target.port, ssl=ctx,
                                                   limit=1 << 20)
    try:
        lines = [
            f"{method} {target.prefix}{path} HTTP/1.1",
            f"Host: {target.host}:{target.port}",
            "Connection: close",
            "Accept: text/event-stream" if on_event else "Accept: application/json",
        ]
        if body is not None:
            lines += ["Content-Type: application/json", f"Content-Length: {len(payload)}"]
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + payload)
        await writer.drain()
        status_line = await reader.readline()
        parts = status_line.split()
        if len(parts) < 2:
            raise ConnectionError(f"bad status line {status_line!r}")
        status = int(parts[1])
        hdrs: dict[str, str] = {}
        while True:
            line = await reader.readline()
            if line in (b"\r\n", b"\n", b""):
                break
            name, _, value = line.decode("latin-1").partition(":")
            hdrs[name.strip().lower()] = value.strip()
        sse = _SSE(on_event) if on_event is not None and status == 200 else None
        collected: list[bytes] = []
        feed = sse.feed if sse is not None else collected.append
        if "chunked" in hdrs.get("transfer-encoding", "").lower():
            while True:
                size_line = await reader.readline()
                size = int(size_line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    break
                feed(await reader.readexactly(size))
                await reader.readexactly(2)  # the chunk's CRLF
        elif "content-length" in hdrs:
            feed(await reader.readexactly(int(hdrs["content-length"])))
        else:
            while data := await reader.read(65536):
                feed(data)
        if sse is not None:
            sse.feed(b"\n\n")  # a last event without its blank line
        return status, b"".join(collected)
    finally:
        writer.close()


class _SSE:
    """Split a byte stream into server-sent events; hand on each `data:` field."""

    def __init__(self, on_event: Callable[[bytes], None]) -> None:
        self.on_event = on_event
        self.buf = b""

    def feed(self, data: bytes) -> None:
        # joined before normalising, so a CRLF split across two chunks is still seen
        self.buf = (self.buf + data).replace(b"\r\n", b"\n")
        while True:
            end = self.buf.find(b"\n\n")
            if end < 0:
                return
            event, self.buf = self.buf[:end], self.buf[end + 2 :]
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    self.on_event(line[5:].strip())


async def get_json(target: Target, path: str, headers: dict[str, str] | None = None) -> Any:
    status, body = await request(target, "GET", path, headers=headers)
    if status != 200:
        raise ConnectionError(f"GET {path}: HTTP {status}: {body[:200]!r}")
    return json.loads(body)
