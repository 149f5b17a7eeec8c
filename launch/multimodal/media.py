"""The bytes behind a chat ``image_url`` part: ``data:`` URLs, ``file://`` and ``http(s)://``.

- ``data:image/...;base64,...``: decoded here (bounded before decoding);
- ``file://``: only when ``--allowed-local-media-path`` is set, and only for a file whose real
  path (symlinks resolved) is below that directory's real path;
- ``http://`` / ``https://``: fetched with a limit on the whole fetch's time and on its bytes
  (a body that passes the limit is cut off, whatever Content-Length said), optionally only from
  ``--allowed-media-domains`` (redirects included).

The fetch blocks: the server runs it in a thread (``fetch_image_url``), never on the event loop.
Every failure is an ImageError whose message names what was wrong with the URL, never a local
path, a resolved address or a traceback.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from launch.multimodal.errors import ImageError
from launch.multimodal.options import MultiModalOptions

__all__ = ["fetch_image_url", "load_image_url", "parse_data_url", "read_local_file",
           "read_http"]

CHUNK = 64 * 1024


def load_image_url(url: str, options: MultiModalOptions) -> bytes:
    """The encoded image ``url`` names (blocking); ImageError for every failure."""
    if not isinstance(url, str) or not url:
        raise ImageError("image_url.url must be a non-empty string")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return parse_data_url(url, options.media_max_bytes)
    if scheme == "file":
        return read_local_file(url, options.allowed_local_media_path, options.media_max_bytes)
    if scheme in ("http", "https"):
        return read_http(url, options.media_fetch_timeout, options.media_max_bytes,
                         options.allowed_media_domains)
    raise ImageError(f"unsupported image URL scheme {scheme[:20]!r}: expected data:, http(s):// "
                     "or file://")


async def fetch_image_url(url: str, options: MultiModalOptions) -> bytes:
    """load_image_url off the event loop; the whole fetch is bounded by the fetch timeout."""
    # a data: URL is already in memory; decoding a large one is still CPU work for a thread
    limit = options.media_fetch_timeout + 1.0
    try:
        return await asyncio.wait_for(asyncio.to_thread(load_image_url, url, options), limit)
    except TimeoutError:
        raise ImageError(f"fetching the image took over {options.media_fetch_timeout} s") \
            from None


def parse_data_url(url: str, max_bytes: int) -> bytes:
    """The bytes of a ``data:[<mime>][;base64],<payload>`` URL with an image (or no) type."""
    head, sep, payload = url.partition(",")
    if not sep:
        raise ImageError("malformed data URL: no ',' before the payload")
    meta = head[len("data:"):].split(";")
    mime = meta[0].strip().lower()
    if mime and not mime.startswith("image/") and mime != "application/octet-stream":
        raise ImageError(f"data URL of type {mime[:40]!r} is not an image")
    if len(payload) > (max_bytes + 2) // 3 * 4 + 4:  # the base64 text of max_bytes bytes
        raise ImageError(f"image data is over the limit of {max_bytes} bytes")
    if "base64" in (m.strip().lower() for m in meta[1:]):
        try:
            data = base64.b64decode(payload.strip(), validate=True)
        except (binascii.Error, ValueError):
            raise ImageError("malformed data URL: invalid base64 payload") from None
    else:
        data = urllib.parse.unquote_to_bytes(payload)
    if len(data) > max_bytes:
        raise ImageError(f"image data is over the limit of {max_bytes} bytes")
    return data


def read_local_file(url: str, allowed_dir: str, max_bytes: int) -> bytes:
    if not allowed_dir:
        raise ImageError("file:// image URLs are not allowed (the server has no "
                         "--allowed-local-media-path)")
    parsed = urllib.parse.urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise ImageError("file:// image URLs must name a local file")
    root = os.path.realpath(allowed_dir)
    path = os.path.realpath(urllib.parse.unquote(parsed.path))
    # the real path, so a symlink inside the directory that points out of it is refused
    if os.path.commonpath([root, path]) != root:
        raise ImageError("file:// image URL is outside the allowed local media path")
    if not os.path.isfile(path):  # before open(): a FIFO or a device would block or never end
        raise ImageError("file:// image URL does not name a readable regular file")
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError:
        raise ImageError("file:// image URL cannot be read") from None
    if len(data) > max_bytes:
        raise ImageError(f"image file is over the limit of {max_bytes} bytes")
    return data


class _CheckedRedirects(urllib.request.HTTPRedirectHandler):
    """Redirects only to http(s), and only to allowed hosts when a list is set."""

    def __init__(self, domains: tuple[str, ...]) -> None:
        self.domains = domains

    def redirect_request(self, req: Any, fp: Any, code: int, msg: str, headers: Any,
                         newurl: str) -> Any:
        _check_http_url(newurl, self.domains)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _check_http_url(url: str, domains: tuple[str, ...]) -> None:
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ImageError("image URL must be http(s) with a host")
    if domains and parsed.hostname.lower() not in domains:
        raise ImageError(f"image URL host {parsed.hostname[:100]!r} is not in the allowed "
                         "media domains")


def read_http(url: str, timeout: float, max_bytes: int, domains: tuple[str, ...] = ()) -> bytes:
    _check_http_url(url, domains)
    deadline = time.monotonic() + timeout
    opener = urllib.request.build_opener(_CheckedRedirects(domains))
    req = urllib.request.Request(url, headers={"User-Agent": "tandem", "Accept": "image/*"})
    try:
        with opener.open(req, timeout=timeout) as resp:
            declared = resp.headers.get("Content-Length")
            if declared is not None and declared.isdigit() and int(declared) > max_bytes:
                raise ImageError(f"image at the URL is over the limit of {max_bytes} bytes")
            chunks: list[bytes] = []
            got = 0
            while True:
                if time.monotonic() > deadline:
                    raise ImageError(f"fetching the image took over {timeout} s")
                chunk = resp.read1(CHUNK)  # what has arrived, not a full CHUNK
                if not chunk:
                    break
                got += len(chunk)
                if got > max_bytes:
                    raise ImageError(f"image at the URL is over the limit of {max_bytes} bytes")
                chunks.append(chunk)
    except ImageError:
        raise
    except urllib.error.HTTPError as e:
        raise ImageError(f"fetching the image failed: HTTP {e.code}") from None
    except TimeoutError:
        raise ImageError(f"fetching the image took over {timeout} s") from None
    except urllib.error.URLError as e:
        if isinstance(e.reason, TimeoutError):
            raise ImageError(f"fetching the image took over {timeout} s") from None
        raise ImageError("fetching the image failed: the URL could not be reached") from None
    except (OSError, ValueError) as e:
        raise ImageError(f"fetching the image failed: {type(e).__name__}") from None
    return b"".join(chunks)
