"""What a router in front of a fleet of vLLM servers asks of each one (vllm-router's calls):

- ``GET /get_load``: ``{"load": n}``, the requests this server is working on (power_of_two);
- ``POST /v1/completions/render`` and ``/v1/chat/completions/render``: the token ids the server
  would run for a request body, without running it (cache_aware / kv_aware route by prefix;
  vllm-router reads ``token_ids``, so the key must stay);
- ``GET /get_server_info``: the KV block size a kv_aware router hashes tokens by;
- ``GET /kv_event_sources``: where this engine publishes its KV cache events (--kv-events-config).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.params import Depends
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from launch.serve.chat import chat_prompt
from launch.serve.completions import completion_prompts
from launch.serve.context import ServerContext
from launch.serve.schemas import ChatCompletionRequest, CompletionRequest

M = TypeVar("M", bound=BaseModel)
Parse = Callable[[Request, type[M]], Awaitable[M]]


def kv_event_sources(ctx: ServerContext) -> list[dict[str, Any]]:
    """The engine's event publisher (one: the engine core publishes for every rank), or none."""
    cfg = getattr(ctx.engine.llm.config, "kv_events_config", None)
    if cfg is None or not cfg.enable_kv_cache_events:
        return []
    return [{"endpoint": cfg.endpoint, "replay_endpoint": cfg.replay_endpoint or None,
             "topic": cfg.topic, "dp_rank": 0, "block_size": ctx.engine.block_size}]


def install_fleet_routes(app: FastAPI, ctx: ServerContext, parse: Parse[Any],
                         guarded: list[Depends]) -> None:
    @app.get("/get_load")
    async def get_load() -> dict[str, int]:
        return {"load": ctx.engine.num_in_flight}

    @app.post("/v1/completions/render", dependencies=guarded)
    async def render_completion(request: Request) -> JSONResponse:
        req: CompletionRequest = await parse(request, CompletionRequest)
        ctx.check_model(req.model)
        prompts = await asyncio.to_thread(completion_prompts, ctx, req)
        # one entry per prompt, as vLLM renders a batch of prompts
        return JSONResponse([_rendered(ctx, ids) for ids in prompts])

    @app.post("/v1/chat/completions/render", dependencies=guarded)
    async def render_chat(request: Request) -> JSONResponse:
        req: ChatCompletionRequest = await parse(request, ChatCompletionRequest)
        ctx.check_model(req.model)
        # the same call the chat route makes, so the ids are the ones a generation would run
        ids = await asyncio.to_thread(chat_prompt, ctx, req.messages, req.add_generation_prompt,
                                      req.add_special_tokens)
        return JSONResponse(_rendered(ctx, ids))

    @app.get("/get_server_info")
    async def get_server_info() -> dict[str, Any]:
        bs = ctx.engine.block_size
        return {
            "model_path": ctx.model_path,
            "served_model_name": ctx.model_name,
            "instance_id": ctx.instance_id,
            "kv_block_size": bs,
            "block_size": bs,
            "effective_attention_block_size": bs,
            "max_model_len": ctx.engine.max_model_len,
            "kv_event_sources": kv_event_sources(ctx),
        }

    @app.get("/kv_event_sources")
    async def get_kv_event_sources() -> dict[str, Any]:
        return {"sources": kv_event_sources(ctx), "block_size": ctx.engine.block_size}


def _rendered(ctx: ServerContext, ids: list[int]) -> dict[str, Any]:
    return {"prompt_token_ids": ids, "token_ids": ids, "model": ctx.model_name}
