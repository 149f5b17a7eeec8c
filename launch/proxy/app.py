"""The proxy's FastAPI app (see launch/proxy/__init__.py).

A body is read and checked exactly as the API server reads its own (launch/serve/body.py): at
most --max-request-bytes (413 from Content-Length before reading, or as soon as a chunked body
passes it), strict JSON, nesting bounded, valid Unicode. The proxy holds each body in memory
(it parses it to add the prefill's params), so without this bound one large POST is the
proxy's memory; and nothing it could not parse is ever forwarded. Its own error bodies name
what failed, not how: backend addresses and exception texts go to its log.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from launch.serve.body import (
    DEFAULT_MAX_REQUEST_BYTES,
    check_content_type,
    parse_json_object,
    read_body,
)
from launch.serve.errors import error_response, install_error_handlers

logger = logging.getLogger("tandem.proxy")

# headers a backend may see from the client: authentication, and what the body is
FORWARDED = ("authorization", "content-type", "x-request-id")


class PDProxy:
    def __init__(self, prefill: list[str], decode: list[str], timeout_s: float = 600.0,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> None:
        if not prefill or not decode:
            raise ValueError("the proxy needs at least one prefill and one decode server")
        if max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
        self.max_request_bytes = max_request_bytes
        self.prefill = [u.rstrip("/") for u in prefill]
        self.decode = [u.rstrip("/") for u in decode]
        self._p = itertools.cycle(self.prefill)
        self._d = itertools.cycle(self.decode)
        self.timeout_s = timeout_s
        self.client: httpx.AsyncClient | None = None
        self.num_fallbacks = 0  # requests the decode side had to prefill itself

    async def start(self) -> None:
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(self.timeout_s, connect=10.0),
                                        limits=httpx.Limits(max_connections=None))

    async def stop(self) -> None:
        if self.client is not None:
            await self.client.aclose()

    async def _prefill(self, path: str, body: dict[str, Any], headers: dict[str, str]
                       ) -> tuple[dict[str, Any] | None, Response | None]:
        """(the prefill's kv_transfer_params or None, an error response to return as is)."""
        assert self.client is not None
        p_body = dict(body, kv_transfer_params={"do_remote_decode": True}, max_tokens=1,
                      stream=False)
        p_body.pop("stream_options", None)
        if "max_completion_tokens" in p_body:
            p_body["max_completion_tokens"] = 1
        url = next(self._p) + path
        try:
            r = await self.client.post(url, json=p_body, headers=headers)
        except httpx.HTTPError as e:
            logger.warning("prefill server %s failed (%s): the decode server prefills", url, e)
            return None, None
        if 400 <= r.status_code < 500:  # the request itself is wrong: the client hears why
            return None, Response(r.content, r.status_code,
                                  media_type=r.headers.get("content-type"))
        if r.status_code >= 500:
            logger.warning("prefill server %s answered %d: the decode server prefills", url,
                           r.status_code)
            return None, None
        try:
            params = r.json().get("kv_transfer_params")
        except (ValueError, AttributeError):
            params = None
        return (params if isinstance(params, dict) else None), None

    async def handle(self, path: str, request: Request) -> Response:
        assert self.client is not None
        # each raises an APIError (413 or 400) before anything is sent to a backend
        check_content_type(request)
        raw = await read_body(request, self.max_request_bytes)
        body = await parse_json_object(raw)
        del raw  # the parsed copy is what goes on; the bytes need not live as long
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED}
        params, err = await self._prefill(path, body, headers)
        if err is not None:
            return err
        d_body = dict(body)
        if params is not None:
            d_body["kv_transfer_params"] = params
        else:
            self.num_fallbacks += 1
            d_body.pop("kv_transfer_params", None)
        url = next(self._d) + path
        req = self.client.build_request("POST", url, json=d_body, headers=headers)
        try:
            resp = await self.client.send(req, stream=bool(body.get("stream")))
        except httpx.HTTPError as e:
            logger.error("decode server %s failed: %s: %s", url, type(e).__name__, e)
            return _error(502, "the decode server failed (see the proxy's log)")
        if not body.get("stream"):
            return Response(resp.content, resp.status_code,
                            media_type=resp.headers.get("content-type"))
        return StreamingResponse(_relay(resp), status_code=resp.status_code,
                                 media_type=resp.headers.get("content-type"),
                                 headers={"Cache-Control": "no-cache"},
                                 background=BackgroundTask(resp.aclose))


async def _relay(resp: httpx.Response) -> AsyncIterator[bytes]:
    async for chunk in resp.aiter_raw():
        yield chunk


def _error(status: int, message: str) -> JSONResponse:
    """The API server's error shape, so a client cannot tell the proxy's errors apart."""
    return error_response(status, message)


def build_app(proxy: PDProxy) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await proxy.start()
        yield
        await proxy.stop()

    app = FastAPI(title="Tandem P/D proxy", lifespan=lifespan)
    # APIError (413, 400) in the API's shape; anything unexpected a bare 500, logged here
    install_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.handle("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await proxy.handle("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        assert proxy.client is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED}
        try:
            r = await proxy.client.get(proxy.decode[0] + "/v1/models", headers=headers)
        except httpx.HTTPError as e:
            logger.error("decode server %s failed: %s: %s", proxy.decode[0], type(e).__name__, e)
            return _error(502, "the decode server failed (see the proxy's log)")
        return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))

    @app.get("/health")
    async def health() -> Response:
        assert proxy.client is not None
        for url in proxy.prefill + proxy.decode:
            try:
                r = await proxy.client.get(url + "/health", timeout=5.0)
            except httpx.HTTPError as e:
                logger.error("backend %s is unreachable: %s: %s", url, type(e).__name__, e)
                return _error(503, "a backend server is unreachable (see the proxy's log)")
            if r.status_code != 200:
                logger.error("backend %s is unhealthy (%d)", url, r.status_code)
                return _error(503, f"a backend server is unhealthy ({r.status_code})")
        return Response(status_code=200)

    @app.get("/pd/backends")
    async def backends() -> dict[str, Any]:
        """The servers behind the proxy (not an OpenAI route)."""
        return {"prefill": proxy.prefill, "decode": proxy.decode,
                "fallbacks": proxy.num_fallbacks}

    return app
