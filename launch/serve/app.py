"""The FastAPI app: routes, authentication and request parsing.

Bodies are parsed here rather than by FastAPI so that every malformed request (wrong content
type, broken JSON, wrong field types) gets a 400 with a readable message, never a 422.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from launch.client import EngineDeadError
from launch.serve.admit import admitted
from launch.serve.body import check_content_type, parse_request, read_body
from launch.serve.census import census_body
from launch.serve.chat import chat_prompt, create_chat_completion
from launch.serve.completions import create_completion
from launch.serve.context import ServerContext
from launch.serve.errors import (
    APIError,
    bad_request,
    engine_dead,
    engine_unavailable,
    error_response,
    install_error_handlers,
)
from launch.serve.fleet import install_fleet_routes
from launch.serve.lora import install_lora_routes
from launch.serve.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
)

M = TypeVar("M", bound=BaseModel)


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("tandem")
    except Exception:  # noqa: BLE001 - not installed as a distribution (a source checkout)
        return "0.1.0"


async def parse_body(request: Request, model: type[M], max_bytes: int) -> M:
    check_content_type(request)
    raw = await read_body(request, max_bytes)
    return await parse_request(raw, model)


S = TypeVar("S", bound=SamplingFields)


def with_header_id(req: S, request: Request) -> S:
    """The body's request_id, else the ``X-Request-Id`` header's (a router names the request
    there, and its prefill and decode halves by the same id); validated like the body's."""
    if req.request_id is None:
        header = request.headers.get("x-request-id")
        if header:
            req.request_id = header
    return req


def build_app(ctx: ServerContext) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        ctx.engine.attach(asyncio.get_running_loop())
        yield

    app = FastAPI(title="Tandem", version=_version(), lifespan=lifespan)
    install_error_handlers(app)

    async def authorized(request: Request) -> None:
        if ctx.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), ctx.api_key.encode()
        ):
            raise APIError(401, "Unauthorized: a valid `Authorization: Bearer KEY` is needed")

    guarded = [Depends(authorized)]

    @app.get("/health")
    async def health() -> Response:
        if ctx.engine.dead_reason is not None:
            dead = engine_dead(ctx.engine.dead_reason)
            return error_response(dead.status, dead.message)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": _version()}

    @app.get("/metrics")
    async def metrics() -> Response:
        report = None
        try:
            report = await ctx.engine.stats(max_age_s=0.0)
        except (EngineDeadError, TimeoutError):
            pass  # the histograms and counters are still worth a scrape
        body = ctx.metrics.render(report, ctx.engine.num_in_flight)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", dependencies=guarded)
    async def models() -> dict[str, Any]:
        data: list[dict[str, Any]] = [
            {
                "id": name,
                "object": "model",
                "created": ctx.created,
                "owned_by": "tandem",
                "root": ctx.model_path,
                "parent": None,
                "max_model_len": ctx.engine.max_model_len,
                "permission": [],
            }
            for name in ctx.served_names
        ]
        data += ctx.adapters.model_cards(ctx.created, ctx.engine.max_model_len)
        return {"object": "list", "data": data}

    @app.get("/census")
    async def census() -> JSONResponse:
        """Sizes of the maps that grow with client input, per process (launch/census.py)."""
        try:
            return JSONResponse(await census_body(ctx))
        except (EngineDeadError, TimeoutError) as e:
            err = engine_unavailable("no census", e, ctx.engine.dead_reason)
            return error_response(err.status, err.message)

    # a generation route holds a slot under --max-queued-requests before it reads the body
    @app.post("/v1/completions", dependencies=guarded)
    async def completions(request: Request) -> Response:
        with admitted(ctx, request):
            req = with_header_id(
                await parse_body(request, CompletionRequest, ctx.max_request_bytes), request)
            return await create_completion(ctx, req, request)

    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat_completions(request: Request) -> Response:
        with admitted(ctx, request):
            req = with_header_id(
                await parse_body(request, ChatCompletionRequest, ctx.max_request_bytes), request)
            return await create_chat_completion(ctx, req, request)

    @app.post("/tokenize", dependencies=guarded)
    async def tokenize(request: Request) -> JSONResponse:
        req = await parse_body(request, TokenizeRequest, ctx.max_request_bytes)
        ctx.check_model(req.model)
        if req.messages is not None:
            ids = await asyncio.to_thread(chat_prompt, ctx, req.messages,
                                          req.add_generation_prompt, req.add_special_tokens)
        elif req.prompt is not None:
            ids = await asyncio.to_thread(ctx.encode, req.prompt, req.add_special_tokens)
        else:
            raise bad_request("give either `prompt` or `messages`", "prompt")
        return JSONResponse(
            {"count": len(ids), "max_model_len": ctx.engine.max_model_len, "tokens": ids,
             "token_strs": None}
        )

    @app.post("/detokenize", dependencies=guarded)
    async def detokenize(request: Request) -> JSONResponse:
        req = await parse_body(request, DetokenizeRequest, ctx.max_request_bytes)
        ctx.check_model(req.model)
        tok = ctx.tokenizer
        if tok is None:
            raise bad_request(f"model {ctx.model_path!r} has no tokenizer", "tokens")
        bad = [t for t in req.tokens if not 0 <= t < ctx.engine.vocab_size]
        if bad:
            raise bad_request(
                f"token id {bad[0]} is outside the vocabulary [0, {ctx.engine.vocab_size})",
                "tokens",
            )
        return JSONResponse({"prompt": tok.decode(req.tokens)})

    install_lora_routes(app, ctx, lambda r, m: parse_body(r, m, ctx.max_request_bytes), guarded)
    install_fleet_routes(app, ctx, lambda r, m: parse_body(r, m, ctx.max_request_bytes), guarded)
    return app
