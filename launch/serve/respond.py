"""Turning a Generation into an HTTP response: one JSON body, or server-sent events.

Streaming sends one `data: {json}` event per new token batch of a choice (never a chunk with
choices before the first real token), the usage chunk when asked, then `data: [DONE]`. A
failure after the stream started is sent as an `error` event followed by `[DONE]`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from launch.serve.admit import queue_ticket
from launch.serve.context import ClientGone, SSEResponse, until_disconnected
from launch.serve.errors import APIError, error_body
from launch.serve.generation import Delta, Generation

DONE = "data: [DONE]\n\n"

ChunkFn = Callable[[list[Delta]], list[dict[str, Any]]]


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


async def respond(
    request: Request,
    gen: Generation,
    *,
    stream: bool,
    head: dict[str, Any],
    chunks: ChunkFn,
    body: Callable[[], dict[str, Any]],
    include_usage: bool = False,
    continuous_usage: bool = False,
) -> Response:
    """Run `gen` (already validated) and answer; `head` holds id/object/created/model."""
    gen.submit(queue_ticket(request))
    try:
        first = await until_disconnected(request, gen.first())
    except ClientGone:
        gen.close()
        return Response(status_code=499)
    except BaseException:
        gen.abort()
        raise
    if stream:
        events = _events(gen, first, head, chunks, include_usage, continuous_usage)
        return SSEResponse(events, on_close=gen.close)
    try:
        await until_disconnected(request, _drain(gen, first))
        gen.answered = True
    except ClientGone:
        return Response(status_code=499)
    finally:
        gen.close()
    failed = await gen.failure()
    if failed is not None:
        raise failed
    return JSONResponse(body())


async def _drain(gen: Generation, first: list[Delta]) -> None:
    async for _ in gen.stream(first):
        pass


async def _events(
    gen: Generation,
    first: list[Delta],
    head: dict[str, Any],
    chunks: ChunkFn,
    include_usage: bool,
    continuous_usage: bool,
) -> AsyncIterator[str]:
    async for deltas in gen.stream(first):
        if any(d.finish_reason == "error" for d in deltas):
            failed = await gen.failure()
            err = failed or APIError(500, "request failed")
            gen.answered = True
            yield sse(error_body(err.status, err.message)) + DONE
            return
        parts = []
        for chunk in chunks(deltas):
            obj = head | chunk
            if continuous_usage:
                obj["usage"] = gen.usage()
            parts.append(sse(obj))
        yield "".join(parts)
    gen.answered = True
    tail = sse(head | {"choices": [], "usage": gen.usage()}) if include_usage else ""
    yield tail + DONE
