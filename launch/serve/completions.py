"""POST /v1/completions: prompts as text or token ids, n choices each, streamed or not."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from launch.serve.context import ServerContext
from launch.serve.errors import bad_request
from launch.serve.field_checks import check_logprobs
from launch.serve.generation import Delta, pad_logprobs, token_text
from launch.serve.respond import respond
from launch.serve.schemas import CompletionRequest
from launch.serve.structured import constrain, request_constraint


def completion_prompts(ctx: ServerContext, req: CompletionRequest) -> list[list[int]]:
    """`prompt` as a string, a list of strings, a list of token ids or a list of those."""
    p = req.prompt
    if isinstance(p, str):
        return [ctx.encode(p, req.add_special_tokens)]
    if not p:
        raise bad_request("prompt is empty: at least one token is needed", "prompt")
    if isinstance(p[0], int):
        return [list(p)]  # type: ignore[arg-type]
    if isinstance(p[0], str):
        return [ctx.encode(s, req.add_special_tokens) for s in p]  # type: ignore[arg-type]
    return [list(ids) for ids in p]  # type: ignore[union-attr]


def _logprobs(tokenizer: Any, ids: list[int], lps: list[float], offset: int) -> dict[str, Any]:
    tokens = [token_text(tokenizer, t) for t in ids]
    values = pad_logprobs(lps, len(ids))
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {
        "text_offset": offsets,
        "token_logprobs": values,
        "tokens": tokens,
        "top_logprobs": [{t: lp} for t, lp in zip(tokens, values, strict=True)],
    }


async def create_completion(
    ctx: ServerContext, req: CompletionRequest, request: Request
) -> Response:
    ctx.check_model(req.model)
    ctx.check_alive()
    check_logprobs(req.logprobs, "logprobs")
    prompts = await asyncio.to_thread(completion_prompts, ctx, req)  # tokenizing: off the loop
    want_lp = req.logprobs is not None
    max_tokens = 16 if req.max_tokens is None else req.max_tokens
    gen = ctx.start_generation("cmpl", req, prompts, max_tokens, want_lp)
    await constrain(ctx, gen, request_constraint(req.model_extra or {}), "response_format")
    head = ctx.chunk_head(gen, "text_completion")
    tok = ctx.tokenizer
    text_offsets: dict[int, int] = {}

    def chunks(deltas: list[Delta]) -> list[dict[str, Any]]:
        out = []
        for d in deltas:
            c = d.choice
            lp = None
            if want_lp and d.token_ids:
                off = text_offsets.get(c.index, 0)
                lp = _logprobs(tok, d.token_ids, d.logprobs, off)
                text_offsets[c.index] = off + sum(len(t) for t in lp["tokens"])
            choice = {
                "index": c.index,
                "text": d.text,
                "logprobs": lp,
                "finish_reason": d.finish_reason,
                "stop_reason": c.stop_reason if d.finish_reason else None,
            }
            if req.return_token_ids:
                choice["token_ids"] = d.token_ids
            out.append({"choices": [choice]})
        return out

    def body() -> dict[str, Any]:
        choices = []
        for c in gen.choices:
            choice = {
                "index": c.index,
                "text": "".join(c.text),
                "logprobs": _logprobs(tok, c.token_ids, c.logprobs, 0) if want_lp else None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            if req.return_token_ids:
                choice |= {"token_ids": c.token_ids, "prompt_token_ids": c.prompt_ids}
            choices.append(choice)
        return head | {"choices": choices, "usage": gen.usage()} | gen.kv_transfer_fields()

    opts = req.stream_options
    return await respond(
        request,
        gen,
        stream=req.stream,
        head=head,
        chunks=chunks,
        body=body,
        include_usage=bool(opts and opts.include_usage),
        continuous_usage=bool(opts and opts.continuous_usage_stats),
    )
