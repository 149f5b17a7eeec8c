"""image_url sources: data: URLs, file:// under the allowed path only, bounded http(s)."""

from __future__ import annotations

import asyncio
import base64
import http.server
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from launch.multimodal.image import ImageError
from launch.multimodal.media import fetch_image_url, load_image_url, parse_data_url
from launch.multimodal.options import MultiModalOptions

BODY = b"\x89PNG fake image bytes" * 10


def test_data_urls() -> None:
    url = "data:image/png;base64," + base64.b64encode(BODY).decode()
    assert parse_data_url(url, 10_000) == BODY
    assert parse_data_url("data:image/png,%89PNG", 100) == b"\x89PNG"
    with pytest.raises(ImageError, match="invalid base64"):
        parse_data_url("data:image/png;base64,@@@@", 100)
    with pytest.raises(ImageError, match="not an image"):
        parse_data_url("data:text/html;base64,AAAA", 100)
    with pytest.raises(ImageError, match="over the limit of 10 bytes"):
        parse_data_url(url, 10)
    with pytest.raises(ImageError, match="no ','"):
        parse_data_url("data:image/png;base64", 10)
    with pytest.raises(ImageError, match="unsupported image URL scheme 'ftp'"):
        load_image_url("ftp://x/y.png", MultiModalOptions())


def test_local_files_only_under_the_allowed_path(tmp_path: Path) -> None:
    allowed = tmp_path / "media"
    allowed.mkdir()
    (allowed / "a.png").write_bytes(BODY)
    secret = tmp_path / "secret.png"
    secret.write_bytes(b"secret")
    os.symlink(secret, allowed / "escape.png")
    os.symlink(allowed / "a.png", allowed / "inside.png")
    opts = MultiModalOptions(allowed_local_media_path=str(allowed))
    assert load_image_url(f"file://{allowed}/a.png", opts) == BODY
    assert load_image_url(f"file://{allowed}/inside.png", opts) == BODY
    for url in (f"file://{allowed}/escape.png", f"file://{secret}",
                f"file://{allowed}/../secret.png"):
        with pytest.raises(ImageError, match="outside the allowed") as e:
            load_image_url(url, opts)
        assert str(tmp_path) not in str(e.value)
    with pytest.raises(ImageError, match="readable regular file"):
        load_image_url(f"file://{allowed}/missing.png", opts)
    with pytest.raises(ImageError, match="not allowed"):
        load_image_url(f"file://{allowed}/a.png", MultiModalOptions())
    with pytest.raises(ImageError, match="over the limit"):
        load_image_url(f"file://{allowed}/a.png",
                       MultiModalOptions(allowed_local_media_path=str(allowed),
                                         media_max_bytes=5))


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path == "/ok.png":
            self._send(BODY, len(BODY))
        elif self.path == "/big.png":  # lies about its length: no Content-Length at all
            self.send_response(200)
            self.end_headers()
            for _ in range(100):
                self.wfile.write(b"x" * 1000)
        elif self.path == "/declared.png":
            self._send(b"", 10**9)
        elif self.path == "/slow.png":  # drips a byte at a time past the deadline
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            try:
                for _ in range(1000):
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(0.05)
            except OSError:
                pass
        elif self.path == "/redirect.png":
            self.send_response(302)
            self.send_header("Location", "http://elsewhere.invalid/x.png")
            self.end_headers()
        else:
            self.send_error(404)

    def _send(self, body: bytes, length: int) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(length))
        self.end_headers()
        try:
            self.wfile.write(body)
        except OSError:
            pass

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.daemon_threads = True
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_http_fetch(server: str) -> None:
    opts = MultiModalOptions(media_fetch_timeout=2.0, media_max_bytes=50_000)
    assert load_image_url(f"{server}/ok.png", opts) == BODY
    with pytest.raises(ImageError, match="over the limit of 50000 bytes"):
        load_image_url(f"{server}/big.png", opts)
    with pytest.raises(ImageError, match="over the limit"):
        load_image_url(f"{server}/declared.png", opts)
    with pytest.raises(ImageError, match="HTTP 404"):
        load_image_url(f"{server}/nothing.png", opts)
    only = MultiModalOptions(allowed_media_domains=("127.0.0.1",))
    with pytest.raises(ImageError, match="not in the allowed media domains"):
        load_image_url(f"{server}/redirect.png", only)
    with pytest.raises(ImageError, match="not in the allowed media domains"):
        load_image_url("http://example.com/a.png", only)


def test_http_slow_response_times_out(server: str) -> None:
    opts = MultiModalOptions(media_fetch_timeout=0.5)
    start = time.monotonic()
    with pytest.raises(ImageError, match="took over 0.5 s"):
        load_image_url(f"{server}/slow.png", opts)
    assert time.monotonic() - start < 2.0
    start = time.monotonic()
    with pytest.raises(ImageError, match="took over 0.5 s"):
        asyncio.run(fetch_image_url(f"{server}/slow.png", opts))
    assert time.monotonic() - start < 2.0


def test_unreachable_host_says_no_address() -> None:
    with pytest.raises(ImageError, match="could not be reached") as e:
        load_image_url("http://127.0.0.1:1/x.png", MultiModalOptions(media_fetch_timeout=1.0))
    assert "127.0.0.1" not in str(e.value)
